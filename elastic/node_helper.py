"""The node's checkpoint helper process, as elastic-run's agent runs it.

The agent owns the node's tier-0 directory (core/tier0_dir.py) and, beside it, one helper process
(`python -m ckpt.helper_process`, ckpt/helper.py says what it does) that checksums and publishes the
workers' tier-0 snapshots off their training processes. The agent starts it with the directory,
checks it on every monitor tick, starts it again when it died (event `ckpt_helper_restarted`, with the
time the node was without it; the workers publish their snapshots themselves meanwhile) and stops it
at exit. After `MAX_QUICK_DEATHS` deaths within a minute of their start it gives up (logged once):
something in its environment is broken, and the workers do the work themselves.

`ELASTIC_CKPT_HELPER=0` in the agent's environment: no helper.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from core.events import emit

log = logging.getLogger(__name__)

ENV = "ELASTIC_CKPT_HELPER"
"""`0` turns the helper off (the workers then checksum and publish their snapshots themselves)."""

SOCKET_NAME = "helper.sock"
"""In the tier-0 directory; ckpt/helper.py's SOCKET_NAME (elastic does not import ckpt)."""

MAX_QUICK_DEATHS = 3
QUICK_S = 60.0


class NodeHelper:
    def __init__(self, tier0_dir: str) -> None:
        self.socket = Path(tier0_dir) / SOCKET_NAME
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._quick_deaths = 0
        self.restarts = 0

    @classmethod
    def start(cls, tier0_dir: str) -> NodeHelper | None:
        """The node's helper, started (None when ELASTIC_CKPT_HELPER=0)."""
        if os.environ.get(ENV, "1") == "0":
            return None
        helper = cls(tier0_dir)
        helper._spawn()
        return helper

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> None:
        # Its few lines ("[ckpt-helper] ...") go to the agent's stderr, beside the agent's own.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ckpt.helper_process", "--socket", str(self.socket), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), stderr=subprocess.STDOUT)
        self._started_at = time.monotonic()

    def ensure_running(self) -> None:
        """On each monitor tick: start the helper again if it died (bounded, see the module docstring)."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return
        now = time.monotonic()
        self._quick_deaths = self._quick_deaths + 1 if now - self._started_at < QUICK_S else 0
        self._proc = None
        if self._quick_deaths > MAX_QUICK_DEATHS:
            log.error("agent: the node's checkpoint helper died %d times within %.0f s of its start (exit %s); "
                      "not starting it again: the workers publish their snapshots themselves",
                      self._quick_deaths, QUICK_S, proc.returncode)
            return
        log.warning("agent: the node's checkpoint helper (pid %d) exited with %s; starting it again",
                    proc.pid, proc.returncode)
        self._spawn()
        self.restarts += 1
        emit("ckpt_helper_restarted", dead_pid=proc.pid, pid=self.pid, exit_code=proc.returncode,
             restarts=self.restarts)

    def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
