"""The beacon (elastic/liveness.py) holds a connection only while its peer does."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest

from elastic.liveness import LEAVING, Beacon, Monitor, listening_socket

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(ok, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 20
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_beacon_lets_go_of_every_peer_that_closed_and_keeps_the_live_ones() -> None:
    # It held every connection for its agent's life: one file descriptor per node that ever joined (or port scan),
    # until the agent could not accept its round's store connections and its node fell out of the job.
    beacon = Beacon("127.0.0.1")
    host, port = beacon.address.rsplit(":", 1)
    try:
        live = socket.create_connection((host, int(port)), timeout=10)  # a peer that stays
        wait_for(lambda: beacon.held == 1, "the live peer held")
        before = open_fds()
        for _ in range(100):  # peers lost one after another
            socket.create_connection((host, int(port)), timeout=10).close()
        wait_for(lambda: beacon.held == 1, "the closed peers let go")
        assert open_fds() <= before + 2
        live.close()
        wait_for(lambda: beacon.held == 0, "the last peer let go")
        again = socket.create_connection((host, int(port)), timeout=10)  # it accepts on
        wait_for(lambda: beacon.held == 1, "a new peer held")
    finally:
        beacon.close()
    again.settimeout(10)
    # Closing the beacon says its agent leaves on purpose, then closes what it holds: the peer reads EOF.
    assert again.recv(1) == LEAVING and again.recv(1) == b""
    again.close()


def test_a_peer_that_left_on_purpose_is_logged_as_leaving_and_a_dead_one_as_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every normal finish logged the other agents as gone, a warning ("closed its beacon: it is gone").
    lost: list[str] = []
    said: dict[str, bool] = {}
    monitor = Monitor(lambda node, left: (lost.append(node), said.__setitem__(node, left)))
    leaving = Beacon("127.0.0.1")
    dead = listening_socket("127.0.0.1")  # an agent SIGKILLed: its kernel closes the connection, nothing sent
    try:
        monitor.track({"leaving": leaving.address, "dead": f"127.0.0.1:{dead.getsockname()[1]}"})
        held, _ = dead.accept()
        wait_for(lambda: leaving.held == 1, "the monitor connected")
        with caplog.at_level(logging.INFO, logger="elastic.liveness"):
            leaving.close()
            held.close()
            wait_for(lambda: sorted(lost) == ["dead", "leaving"], "both reported lost")
    finally:
        monitor.close()
        dead.close()
    assert said == {"leaving": True, "dead": False}
    by_node = {n: [r for r in caplog.records if n in r.getMessage()] for n in ("leaving", "dead")}
    assert [(r.levelno, "left" in r.getMessage()) for r in by_node["leaving"]] == [(logging.INFO, True)], caplog.text
    assert [(r.levelno, "gone" in r.getMessage()) for r in by_node["dead"]] == [(logging.WARNING, True)], caplog.text
