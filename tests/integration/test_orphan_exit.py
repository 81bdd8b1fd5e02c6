"""A worker whose agent is gone ends itself (elastic/orphan.py), also when its stderr went with the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from core.procfs import alive
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# The "agent": starts the "worker" with its stderr a pipe, closes the pipe's read end (a log collector, tee or
# ssh session that went with the agent), says the worker's pid, and waits to be killed.
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stderr=subprocess.PIPE, start_new_session=True)
    worker.stderr.close()
    print(worker.pid, flush=True)
    time.sleep(60)
""")
WORKER = textwrap.dedent("""
    import time
    from elastic import orphan
    assert orphan.exit_with_parent(0.05)
    time.sleep(60)
""")


def gone(pid: int) -> bool:
    return not alive(pid)  # gone, or a zombie nobody reaps


def test_a_worker_whose_stderr_pipe_went_with_its_agent_still_ends_itself() -> None:
    # Writing its last line raised BrokenPipeError, which ended the watching thread before its os._exit: the worker
    # lived on (seen: 10-26 s, in a collective up to gloo's 30 minutes) after its agent was SIGKILLed.
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        assert agent.stdout is not None
        worker = int(agent.stdout.readline())
        time.sleep(1.0)  # the worker's watch has started
        assert not gone(worker)
        agent.kill()
        agent.wait(10)
        deadline = time.monotonic() + 20
        while not gone(worker):
            assert time.monotonic() < deadline, "the orphaned worker is still running 20 s after its agent died"
            time.sleep(0.1)
    finally:
        agent.kill()
        agent.wait(10)
        if worker is not None and not gone(worker):
            os.kill(worker, signal.SIGKILL)
