"""In-process re-formation, the channel between an agent and its live workers.

On a membership change (a peer lost, a node joining) an agent in in-process mode does not stop its
workers: it runs the next rendezvous round and tells them the round; each worker aborts its process
group, joins the new one and goes on from its last completed step (trainer.Resumable.reform). Only a
worker that said it can (`RoundWatcher.declare_ready`: trainer does it for replicated state) is kept;
scripts that do not use trainer keep the restart behaviour.

Files in the agent's progress directory (tmpfs, elastic/progress.py), all replaced atomically:

    reform_ready_<local_rank>   the worker's pid: it can re-form in place
    round.json                  the newest round: generation, store address, each local rank's rank; or
                                "stop": the job stops below its minimum of nodes (persist, then exit)
    reforming_<local_rank>      "<generation>": the worker left its old process group for that round
    reformed_<local_rank>       "<generation>": the worker joined that round's process group (its ack)
    round_coming                "<generation> <until>": the agent is forming a round after that one, by `until`
                                (time.monotonic(): the host's clock); its rendezvous may wait on etcd meanwhile, and
                                a kept worker waits for the round past the lost-peer grace

A file, not a socket: a worker polls one stat() every 20 ms, and nothing breaks when either side
dies. The agent sets `ELASTIC_REFORM=in-process`, `ELASTIC_ROUND_GENERATION` and
`ELASTIC_REFORM_TIMEOUT_S` for the workers it starts; without them (torchrun, `--reform restart`) the
worker side does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from core.deadline import Deadline

log = logging.getLogger(__name__)

ENV_MODE = "ELASTIC_REFORM"
ENV_GENERATION = "ELASTIC_ROUND_GENERATION"
ENV_TIMEOUT = "ELASTIC_REFORM_TIMEOUT_S"
MODES = ("in-process", "restart")
_ROUND = "round.json"
_COMING = "round_coming"
_POLL_S = 0.02


@dataclass(frozen=True)
class Round:
    """One rendezvous round as one worker sees it."""

    generation: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    stop: str | None = None
    """Not a round to join: the job stops (fewer live nodes than its minimum). Persist, then exit with
    `EXIT_BELOW_MIN`; the text says why."""


@dataclass(frozen=True)
class _LocalRanks:
    generation: int
    master_addr: str
    master_port: int
    ranks: dict[str, tuple[int, int]]  # local rank -> (global rank, world size)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- the agent's side -----------------------------------------------------------------------------


class RoundChannel:
    """What an agent writes and reads in its progress directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def clear(self) -> None:
        """Before a new set of workers starts: forget the old ones' readiness and acks."""
        for pattern in ("reform_ready_*", "reforming_*", "reformed_*", _COMING):
            for f in self.directory.glob(pattern):
                f.unlink(missing_ok=True)

    def ready_pids(self) -> dict[int, int]:
        """Local rank -> pid of each worker that declared it can re-form in place."""
        ready: dict[int, int] = {}
        for f in self.directory.glob("reform_ready_*"):
            try:
                ready[int(f.name.rsplit("_", 1)[1])] = int(f.read_text())
            except (OSError, ValueError):
                continue  # being replaced, or not ours
        return ready

    def announce(self, after: int, within: timedelta) -> None:
        """Tell the kept workers a round after generation `after` is forming, within `within` (the rendezvous's
        longest wait). Seen without it: a node lost while etcd was down; the agent waited in its rendezvous for etcd,
        the kept worker's lost-peer grace ran out first, and it died, a worker failure with `--max-restarts 0`."""
        _write(self.directory / _COMING, f"{after} {time.monotonic() + within.total_seconds():.3f}")

    def publish(self, generation: int, master_addr: str, master_port: int,
                ranks: Iterable[tuple[int, int, int]]) -> None:
        """Tell the workers the round `generation`: (local rank, global rank, world size) of each."""
        doc = _LocalRanks(generation, master_addr, master_port,
                          {str(local): (rank, world) for local, rank, world in ranks})
        self._publish(json.dumps(asdict(doc)))

    def publish_stop(self, generation: int, why: str) -> None:
        """Tell the workers the job stops (no round `generation` will form): persist the newest state, exit."""
        self._publish(json.dumps({"generation": generation, "stop": why}))

    def _publish(self, text: str) -> None:
        _write(self.directory / _ROUND, text)
        (self.directory / _COMING).unlink(missing_ok=True)  # after: a waiting worker looks once more (await_round)

    def acked(self, local_rank: int) -> int:
        """The newest generation the worker joined in place (-1: none)."""
        return self._generation(f"reformed_{local_rank}")

    def leaving(self, local_rank: int) -> int:
        """The newest generation the worker left its old process group for (-1: none)."""
        return self._generation(f"reforming_{local_rank}")

    def _generation(self, name: str) -> int:
        try:
            return int((self.directory / name).read_text())
        except (OSError, ValueError):
            return -1


# -- the worker's side ----------------------------------------------------------------------------


def join_timeout() -> timedelta:
    """How long a kept worker waits for the new round's process group (the agent restarts it after)."""
    return timedelta(seconds=float(os.environ.get(ENV_TIMEOUT) or 300))


def enabled() -> bool:
    """Whether this worker's agent re-forms its workers in place."""
    return os.environ.get(ENV_MODE) == "in-process" and bool(os.environ.get("ELASTIC_PROGRESS_DIR"))


class RoundWatcher:
    """Watches the agent's round file from a daemon thread; `newest()` is a round newer than the one
    this worker is in. `on_new_round` runs on that thread once per new round (trainer aborts the
    process group there, so a collective waiting on a lost peer fails at once)."""

    def __init__(self, directory: str | Path, local_rank: int, generation: int,
                 on_new_round: Callable[[Round], None]) -> None:
        self.directory = Path(directory)
        self.local_rank = local_rank
        self.generation = generation
        """The round this worker's process group belongs to."""
        self._on_new_round = on_new_round
        self._newest: Round | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._seen: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._run, name="elastic-round-watch", daemon=True)

    @staticmethod
    def start(on_new_round: Callable[[Round], None]) -> RoundWatcher | None:
        """The watcher for this worker, running; None outside an in-process agent."""
        if not enabled():
            return None
        watcher = RoundWatcher(os.environ["ELASTIC_PROGRESS_DIR"], int(os.environ.get("LOCAL_RANK", "0")),
                               int(os.environ.get(ENV_GENERATION, "0")), on_new_round)
        watcher._thread.start()
        return watcher

    def declare_ready(self) -> None:
        """Tell the agent it may keep this process over a membership change."""
        _write(self.directory / f"reform_ready_{self.local_rank}", str(os.getpid()))

    def withdraw(self) -> None:
        """From now on the agent restarts this process instead (e.g. it is tearing down)."""
        (self.directory / f"reform_ready_{self.local_rank}").unlink(missing_ok=True)

    def newest(self) -> Round | None:
        """A round newer than the one this worker is in, if the agent published one."""
        with self._changed:
            return self._newest

    def wait(self, deadline: Deadline, *, newer_than: int | None = None) -> Round | None:
        """The newer round (one newer than generation `newer_than`, if given: a round being joined is still the
        newest until `joined`), waiting for the agent to publish it until `deadline`."""
        def waiting() -> bool:
            return self._newest is None or (newer_than is not None and self._newest.generation <= newer_than)

        with self._changed:
            while waiting() and not deadline.expired():
                self._changed.wait(deadline.capped(0.5))
            return None if waiting() else self._newest

    def coming(self) -> bool:
        """Whether the agent says it is forming a round newer than this worker's, and its time is not up
        (`RoundChannel.announce`)."""
        try:
            after, until = (self.directory / _COMING).read_text().split()
            return int(after) >= self.generation and time.monotonic() < float(until)
        except (OSError, ValueError):
            return False

    def leaving(self, round_: Round) -> None:
        """The worker is leaving its old process group for `round_` (the agent then waits for the join)."""
        _write(self.directory / f"reforming_{self.local_rank}", str(round_.generation))

    def joined(self, round_: Round) -> None:
        """The worker is in `round_`'s process group now: ack it to the agent."""
        with self._changed:
            self.generation = round_.generation
            if self._newest is not None and self._newest.generation <= round_.generation:
                self._newest = None
        _write(self.directory / f"reformed_{self.local_rank}", str(round_.generation))

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        path = self.directory / _ROUND
        while not self._stop.wait(_POLL_S):
            try:
                st = path.stat()
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            if key == self._seen:
                continue
            self._seen = key
            round_ = self._read(path)
            if round_ is None:
                continue
            with self._changed:
                if round_.generation <= self.generation or (
                        self._newest is not None and round_.generation <= self._newest.generation):
                    continue
                self._newest = round_
                self._changed.notify_all()
            log.info("round %d published: this worker becomes rank %d of %d", round_.generation, round_.rank,
                     round_.world_size)
            try:
                self._on_new_round(round_)
            except Exception as exc:  # noqa: BLE001 - the training thread still sees the round
                log.warning("aborting the process group for round %d failed: %s", round_.generation, exc)

    def _read(self, path: Path) -> Round | None:
        try:
            doc = json.loads(path.read_text())
            if doc.get("stop"):
                return Round(int(doc["generation"]), -1, 0, "", 0, stop=str(doc["stop"]))
            rank, world = doc["ranks"][str(self.local_rank)]
            return Round(int(doc["generation"]), int(rank), int(world), str(doc["master_addr"]),
                         int(doc["master_port"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("round file %s unreadable (%s); waiting for the next write", path, exc)
            return None

