"""The node's checkpoint helper process, as elastic-run's agent runs it.

The agent owns the node's tier-0 directory (core/tier0_dir.py) and, beside it, one helper process
(`python -m ckpt.helper_process`, ckpt/helper.py says what it does) that checksums and publishes the
workers' tier-0 snapshots off their training processes. The agent starts it with its workers (not
earlier: a joining node's prestarted workers warm up first, and the helper imports torch too, which on
2 cores made a joiner's first step 6.9 s after its agent's start instead of 4.0 s), checks it on every
monitor tick, starts it again when it died (event `ckpt_helper_restarted`, with the
time the node was without it; the workers publish their snapshots themselves meanwhile) and stops it
at exit. A helper that is alive but does not answer (stopped, wedged) is killed after `MAX_SILENT_PINGS` pings
in a row without an answer (event `ckpt_helper_unresponsive`) and so started again. After `MAX_QUICK_DEATHS`
deaths within a minute of their start it gives up (logged once): something in its environment is broken, and
the workers do the work themselves.

With a rendezvous that has membership records (etcd-v3) the agent also makes a TCP listener once,
advertises it in its record as "replica" and hands it to every helper it starts (so the address stays
the same over helper restarts): the helper keeps other nodes' tier-0 replicas there and sends its own
node's to the next nodes of the round, which `update_targets` writes on every monitor tick when the
round changed (core/replica_targets.py, ckpt/replica.py). In a run with a join token the agent also hands
each helper it starts the run's replica key (elastic/admission.py), through a pipe (never the command line or
the environment): pushes are signed with it, and a helper keeps only pushes that carry it.

`ELASTIC_CKPT_HELPER=0` in the agent's environment: no helper.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from core.deadline import Deadline
from core.events import emit
from core.frames import recv_frame, send_frame
from core.replica_targets import ring_targets, write_targets

log = logging.getLogger(__name__)

ENV = "ELASTIC_CKPT_HELPER"
"""`0` turns the helper off (the workers then checksum and publish their snapshots themselves)."""

SOCKET_NAME = "helper.sock"
"""In the tier-0 directory; ckpt/helper.py's SOCKET_NAME (elastic does not import ckpt)."""

MAX_QUICK_DEATHS = 3
QUICK_S = 60.0

PING_EVERY_S = 5.0
"""How often the agent asks its helper whether it answers (a stopped or wedged helper is alive, not dead)."""
PING_TIMEOUT_S = 10.0
"""How long one ping may take (the helper answers it on a thread of its own, at once)."""
MAX_SILENT_PINGS = 3
"""Pings in a row without an answer after which the helper is killed and started again (~45 s)."""
START_GRACE_S = 60.0
"""A new helper's first seconds (it imports torch): until it has answered once, no answer is not counted."""


class NodeHelper:
    def __init__(self, tier0_dir: str, replica_listener: socket.socket | None = None,
                 replica_key: bytes | None = None) -> None:
        self.tier0 = Path(tier0_dir)
        self.socket = self.tier0 / SOCKET_NAME
        self.replica_listener = replica_listener
        self.replica_key = replica_key
        self._targets: tuple[str, tuple[object, ...], str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._begun = False  # its process was started once (or the helper stopped): begin() does nothing
        self._started_at = 0.0
        self._quick_deaths = 0
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self.restarts = 0

    @classmethod
    def start(cls, tier0_dir: str, replica_listener: socket.socket | None = None, *,
              spawn: bool = True, replica_key: bytes | None = None) -> NodeHelper | None:
        """The node's helper, started (None when ELASTIC_CKPT_HELPER=0). `replica_listener`: a listening TCP
        socket for peer replicas (the helper then keeps and sends them), `replica_key` the key that signs them
        (None: unsigned, a run without a join token). `spawn=False`: its process starts at
        `begin()` (the agent's, once a joining node's workers are warm: both import torch, on the same cores)."""
        if os.environ.get(ENV, "1") == "0":
            if replica_listener is not None:
                replica_listener.close()
            return None
        helper = cls(tier0_dir, replica_listener, replica_key)
        if spawn:
            helper._spawn()
        return helper

    def begin(self) -> None:
        """Start the helper's process if it has not been started (start(spawn=False))."""
        if not self._begun:
            self._spawn()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> None:
        self._begun = True
        # Its few lines ("[ckpt-helper] ...") go to the agent's stderr, beside the agent's own.
        argv = [sys.executable, "-m", "ckpt.helper_process", "--socket", str(self.socket), "--parent", str(os.getpid())]
        fds: tuple[int, ...] = ()
        key_fd = None
        if self.replica_listener is not None:
            fds = (self.replica_listener.fileno(),)
            argv += ["--replica-fd", str(fds[0])]
            if self.replica_key is not None:
                key_fd = _pipe_holding(self.replica_key)
                fds += (key_fd,)
                argv += ["--replica-key-fd", str(key_fd)]
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                          stderr=subprocess.STDOUT, pass_fds=fds)
        finally:
            if key_fd is not None:
                os.close(key_fd)
        self._started_at = time.monotonic()
        if self._watch is None:
            self._watch = threading.Thread(target=self._watch_answers, name="ckpt-helper-watch", daemon=True)
            self._watch.start()

    def _watch_answers(self) -> None:
        """Kill a helper that is alive but does not answer (stopped, wedged): `ensure_running`, on the next monitor
        tick, then starts a new one. Seen: a SIGSTOPped helper was never replaced, and every worker waited 30 s for
        it every few seconds, skipping its snapshots meanwhile."""
        silent, answered = 0, None  # answered: the process that answered a ping (a new one is starting up)
        while not self._stopping.wait(PING_EVERY_S):
            proc = self._proc
            if proc is None or proc.poll() is not None:
                silent = 0
                continue
            error = ping(self.socket, PING_TIMEOUT_S)
            if error is None:
                silent, answered = 0, proc
                continue
            if answered is not proc and time.monotonic() - self._started_at < START_GRACE_S:
                continue  # not up yet (it imports torch)
            silent += 1
            if silent < MAX_SILENT_PINGS or self._stopping.is_set():
                continue
            log.warning("agent: the node's checkpoint helper (pid %d) did not answer %d pings in a row (%s); "
                        "killing it, a new one starts", proc.pid, silent, error)
            emit("ckpt_helper_unresponsive", pid=proc.pid, pings=silent, error=error)
            proc.kill()
            silent = 0

    def ensure_running(self) -> None:
        """On each monitor tick: start the helper again if it died (bounded, see the module docstring)."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return
        now = time.monotonic()
        self._quick_deaths = self._quick_deaths + 1 if now - self._started_at < QUICK_S else 0
        self._proc = None
        if self._quick_deaths >= MAX_QUICK_DEATHS:
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

    def update_targets(self, node: str, members: tuple[str, ...], addrs: dict[str, str], job: str = "") -> None:
        """Tell the helper where to send this node's replicas: the round's next members (a ring); `job`, the run
        id its pushes carry and the only one it keeps pushes of."""
        if self.replica_listener is None:
            return
        targets = ring_targets(members, node, addrs)
        if self._targets == (node, tuple(targets), job):
            return
        try:
            write_targets(self.tier0, node, targets, job)
        except OSError as exc:
            log.warning("agent: could not write the replica targets in %s: %s", self.tier0, exc)
            return
        self._targets = (node, tuple(targets), job)
        if targets:
            log.info("agent: tier-0 replicas of this node go to %s", ", ".join(f"{t.node} ({t.addr})" for t in targets))

    def stop(self, timeout: float = 5.0) -> None:
        self._begun = True
        self._stopping.set()
        if self.replica_listener is not None:
            self.replica_listener.close()
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds `data` and then ends (a key far smaller than a pipe's buffer)."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read


def ping(path: Path, timeout: float) -> str | None:
    """None if the helper listening at `path` answers a ping within `timeout` seconds, else why not."""
    deadline = Deadline.after(timeout)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            send_frame(sock, {"op": "ping"})
            reply, _ = recv_frame(sock, deadline)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if reply.get("ok") else f"it answered {str(reply)[:200]}"
