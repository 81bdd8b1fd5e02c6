"""Every process a chaos run starts, and every descendant it ever sees, by (pid, start time), so that
the end of the run can prove that none is left: pids are reused, the start time tells them apart.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from core.procfs import alive, cmdline, descendants, stat


class ProcessLedger:
    """Every process started or seen, by (pid, start time). A sampler thread adds descendants."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, int], str] = {}
        self._below_roots: set[int] = set()
        self._roots: list[Callable[[], list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="chaos-ledger", daemon=True)
        self._thread.start()

    def watch(self, roots: Callable[[], list[int]]) -> None:
        """Sample the trees under the pids `roots()` returns, from now on."""
        with self._lock:
            self._roots.append(roots)

    def record(self, pid: int, what: str = "") -> None:
        st = stat(pid)
        if st is not None:
            with self._lock:
                self._seen.setdefault((pid, st.start), what or cmdline(pid)[:160])

    def record_tree(self, pid: int) -> list[int]:
        pids = [pid, *descendants(pid)]
        for p in pids:
            self.record(p)
        return pids

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                roots = list(self._roots)
            for get in roots:
                for pid in get():
                    below = self.record_tree(pid)[1:]
                    with self._lock:
                        self._below_roots.update(below)
            with self._lock:
                orphans = set(self._below_roots)
            _reap_orphans(orphans)

    def survivors(self) -> list[str]:
        """Recorded processes still alive, as 'pid cmdline'."""
        with self._lock:
            items = list(self._seen.items())
        return [f"{pid} {what}" for (pid, start), what in items if alive(pid, start)]

    def kill_survivors(self) -> None:
        with self._lock:
            items = list(self._seen)
        for pid, start in items:
            if alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_SUBREAPER = False


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux), so none escapes the ledger and
    their zombies are reaped here. For the CLI's own process; a library caller decides for itself."""
    global _SUBREAPER
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        _SUBREAPER = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        _SUBREAPER = False
    return _SUBREAPER


def _reap_orphans(candidates: set[int]) -> None:
    """Reap zombies re-parented to us. Only processes first seen below an agent qualify: the status
    of a child we started ourselves belongs to its Popen object."""
    if not _SUBREAPER:
        return
    me = os.getpid()
    for pid in candidates:
        st = stat(pid)
        if st is not None and st.state == "Z" and st.ppid == me:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
