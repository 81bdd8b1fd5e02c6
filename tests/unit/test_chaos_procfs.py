"""core.procfs, which the chaos harness (and the test fixtures) use to find and end whole process
trees: state, parent and start time, command line, environment, descendants, kill_tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from core import procfs

pytestmark = pytest.mark.timeout(30)


def test_a_tree_is_found_and_ended_by_pid() -> None:
    # A child shell whose own child (the grandchild) is what a node's workers are to its agent.
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], env={**os.environ, "CHAOS_MARK": "tree-test"},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not procfs.descendants(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        (grandchild,) = procfs.descendants(proc.pid)
        # The shell forks before it execs sleep: until then the grandchild's command line is the shell's (seen once
        # in CI). Waited for, bounded: a cmdline() that never reads "sleep 60" still fails below.
        while procfs.cmdline(grandchild) != "sleep 60" and time.monotonic() < deadline:
            time.sleep(0.02)
        st = procfs.stat(grandchild)
        assert st is not None and st.ppid == proc.pid and st.state in "RSD"
        assert procfs.alive(grandchild) and procfs.alive(grandchild, st.start)
        assert not procfs.alive(grandchild, st.start + 1)  # same pid, another process
        assert procfs.cmdline(grandchild) == "sleep 60"
        assert procfs.environ(proc.pid)["CHAOS_MARK"] == "tree-test"
        assert proc.pid in procfs.pids() and grandchild in procfs.pids()
        assert sorted(procfs.kill_tree(proc.pid, signal.SIGKILL)) == sorted([proc.pid, grandchild])
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while procfs.alive(grandchild) and time.monotonic() < deadline:  # re-parented, reaped by init
            time.sleep(0.02)
        assert not procfs.alive(grandchild)
    finally:
        if proc.poll() is None:
            procfs.kill_tree(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_a_zombie_is_not_alive_and_a_gone_pid_reads_as_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while (st := procfs.stat(proc.pid)) is not None and st.state != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert st is not None and st.state == "Z" and not procfs.alive(proc.pid)  # dead, not yet reaped
    proc.wait(timeout=10)
    assert procfs.stat(proc.pid) is None and procfs.cmdline(proc.pid) == "" and procfs.environ(proc.pid) == {}
    assert procfs.kill_tree(proc.pid) == []
