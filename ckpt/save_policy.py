"""The save-failure policy: a job whose checkpoints keep failing stops instead of training on.

Training on while every save fails loses all the work since the last good checkpoint at the
next fault, and exits 0 at the end as if all were well. So tier-1 failures in a row are counted
(a success resets the count); once `max_failed_saves` is reached, the next save_async() (or
check(), cheap enough to call every step) raises CheckpointSaveError naming the directory and
the last cause. The count is updated on the writer thread as each save finishes; save_async()
first waits for the save in flight (if_busy="wait"), so the loop learns at the save after the
last allowed failure. A conflict found while running (another job writes the shared prefix)
raises the same error at once.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ckpt.errors import CheckpointError, CheckpointSaveError


class SaveFailures:
    """Consecutive failed saves of one Checkpointer."""

    def __init__(self, limit: int | None, root: Path) -> None:
        self.limit = limit
        self.root = root
        self._lock = threading.Lock()
        self.in_a_row = 0
        self.last: CheckpointError | None = None

    def failed(self, error: CheckpointError) -> None:
        with self._lock:
            self.in_a_row += 1
            self.last = error

    def succeeded(self) -> None:
        with self._lock:
            self.in_a_row = 0
            self.last = None

    def check(self, fence: CheckpointError | None = None, *, final: bool = False) -> None:
        """Raise CheckpointSaveError if saving cannot go on; `final` (the run's end): also if its last save
        failed, fewer than `limit` in a row (its end is not checkpointed: a job that exits 0 says it is)."""
        if fence is not None:
            raise CheckpointSaveError(f"checkpoints of {self.root} stop: {fence}", path=self.root) from fence
        with self._lock:
            count, last = self.in_a_row, self.last
        if final and self.limit is not None and last is not None and count < self.limit:
            raise CheckpointSaveError(
                f"the last save to {self.root} failed, so the end of this run is not checkpointed (a restart redoes "
                f"the steps since the newest committed one; max_failed_saves=None only logs this). The failure: "
                f"{last}",
                path=self.root,
            ) from last
        if self.limit is None or count < self.limit or last is None:
            return
        raise CheckpointSaveError(
            f"the last {count} saves to {self.root} failed (max_failed_saves={self.limit}), so "
            f"this job stops instead of training on without checkpoints. The last failure: "
            f"{last}",
            path=self.root,
        ) from last
