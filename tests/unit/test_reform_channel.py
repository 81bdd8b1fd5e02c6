"""The round channel between an agent and its kept workers (elastic/reform.py), over real files and the real
watcher thread: a kept worker waits past its lost-peer grace only while its agent says a round is forming.

Seen without it: a node lost while etcd was down; the agent waited in its rendezvous for etcd, the kept worker's
grace ran out first and it died, a worker failure that ended a `--max-restarts 0` job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from core.deadline import Deadline
from elastic import peer_loss
from elastic.reform import Round, RoundChannel, RoundWatcher
from trainer import regroup

pytestmark = pytest.mark.timeout(60)

GRACE_S = 0.3
WITHIN = timedelta(seconds=20)  # the agent's rendezvous may take this long


@pytest.fixture
def watcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RoundWatcher]:
    monkeypatch.setenv(peer_loss.ENV_GRACE, str(GRACE_S))
    w = RoundWatcher(tmp_path, local_rank=0, generation=3, on_new_round=lambda _: None)
    w._thread.start()
    yield w
    w.stop()


def publish_after(channel: RoundChannel, seconds: float, generation: int = 4) -> threading.Thread:
    def later() -> None:
        time.sleep(seconds)
        channel.publish(generation, "127.0.0.1", 29500, [(0, 1, 2)])

    t = threading.Thread(target=later, daemon=True)
    t.start()
    return t


def test_an_announced_round_is_waited_for_past_the_grace(tmp_path: Path, watcher: RoundWatcher) -> None:
    channel = RoundChannel(tmp_path)
    channel.announce(3, WITHIN)
    assert watcher.coming()
    started = time.monotonic()
    publish_after(channel, 6 * GRACE_S)
    got = regroup.await_round(watcher)
    assert got == Round(4, 1, 2, "127.0.0.1", 29500) and time.monotonic() - started >= 6 * GRACE_S
    assert not watcher.coming()  # publishing the round ends the announcement


def test_without_an_announcement_the_grace_is_the_wait(tmp_path: Path, watcher: RoundWatcher) -> None:
    channel = RoundChannel(tmp_path)
    late = publish_after(channel, 10 * GRACE_S)
    assert regroup.await_round(watcher) is None
    late.join(timeout=30)


def test_an_older_rounds_announcement_or_one_withdrawn_is_not_waited_for(
        tmp_path: Path, watcher: RoundWatcher) -> None:
    channel = RoundChannel(tmp_path)
    channel.announce(2, WITHIN)  # left from before this worker's round
    assert not watcher.coming()
    channel.announce(3, WITHIN)
    started = time.monotonic()
    threading.Timer(4 * GRACE_S, channel.clear).start()  # the agent starts new workers instead
    assert regroup.await_round(watcher) is None
    assert time.monotonic() - started < 15  # not the 20 s it announced


def test_an_announcement_ends_at_its_time_and_a_stop_ends_it(tmp_path: Path, watcher: RoundWatcher) -> None:
    channel = RoundChannel(tmp_path)
    channel.announce(3, timedelta(seconds=6 * GRACE_S))
    assert regroup.await_round(watcher) is None  # the agent's rendezvous took longer than it said: no wait for good
    assert not watcher.coming()
    channel.announce(3, WITHIN)
    channel.publish_stop(4, "below the minimum")
    assert not watcher.coming()
    got = regroup.await_round(watcher)
    assert got is not None and got.stop == "below the minimum"


def test_a_round_newer_than_the_one_being_joined_is_waited_for(tmp_path: Path, watcher: RoundWatcher) -> None:
    channel = RoundChannel(tmp_path)
    channel.publish(4, "127.0.0.1", 29500, [(0, 1, 2)])
    assert watcher.wait(Deadline.after(5)) is not None
    channel.announce(4, WITHIN)  # joining round 4 failed: the agent forms round 5
    publish_after(channel, 4 * GRACE_S, generation=5)
    got = regroup.await_round(watcher, newer_than=4)
    assert got is not None and got.generation == 5
