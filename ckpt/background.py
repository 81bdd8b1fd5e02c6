"""BackgroundWriter: one daemon thread that runs checkpoint jobs one at a time (ckpt/writer.py has two: the
tier-1 writer and the tier-0 snapshots' finisher), so that at most one save of each kind is in flight."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from core.deadline import Clock, Deadline

logger = logging.getLogger(__name__)


class BackgroundWriter:
    """One daemon thread that runs tier-1 jobs one at a time: at most one save is in flight."""

    def __init__(self, name: str, *, clock: Clock = time.monotonic) -> None:
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        with self._cond:
            return self._busy

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the thread. The writer must be idle (callers wait_idle() first)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            assert not self._busy, "a save is already in flight"
            self._job, self._busy = job, True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no job runs; False if `timeout` seconds passed first."""
        deadline = Deadline.after(timeout, clock=self._clock)
        with self._cond:
            while self._busy:
                if deadline.expired():
                    return False
                self._cond.wait(deadline.remaining())
            return True

    def close(self, timeout: float) -> bool:
        """Let the running job finish (up to `timeout` s), stop the thread and join it."""
        deadline = Deadline.after(timeout, clock=self._clock)
        idle = self.wait_idle(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(deadline.remaining())
            if thread.is_alive():
                logger.error("%s did not stop within %.1fs", self._name, timeout)
                return False
        return idle

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                job = self._job
            try:
                job()
            except BaseException:  # thread boundary: the job reports its own errors
                logger.exception("%s: checkpoint job failed", self._name)
            finally:
                with self._cond:
                    self._job, self._busy = None, False
                    self._cond.notify_all()
