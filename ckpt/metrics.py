"""Per-save metrics: what a save cost the loop, and how far each tier got.

The checkpointer fills a `SaveMetrics` as the save moves through its stages, logs it when the
save is done, and keeps the recent ones in `Checkpointer.metrics` for the loop to read.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

STATUSES = (
    "staging",  # copying into the staging buffer (or a tier-0 slot)
    "snapshot",  # in tier 0 only (host memory), whole and checksummed: final for a snapshot
    "persisting",  # tier-1 writer at work
    "persisted",  # rank directory published in tier 1 (no shared tier: final)
    "uploading",  # waiting for / in tier-2 upload
    "uploaded",  # this rank's files and marker are in tier 2 (rank != 0: final)
    "committed",  # rank 0 wrote the tier-2 COMMIT (rank 0: final)
    "skipped",  # not saved: the previous save still persisted (if_busy)
    "failed",  # tier 1 failed (`error` says why); nothing partial is visible
    "abandoned",  # tier 2 gave the step up (`error` says why); tier 1 keeps it
)


@dataclass
class SaveMetrics:
    """One save of one rank."""

    step: int
    rank: int
    bytes: int = 0
    """Bytes of this rank's checkpoint file."""
    stall_s: float = 0.0
    """Time save_async() blocked the caller (the copy in "staged" mode, plus any wait for a busy
    writer); in "overlapped" mode add `wait_staged_s`."""
    wait_staged_s: float = 0.0
    """Time the loop spent in wait_staged() ("overlapped" mode)."""
    copy_s: float | None = None
    """From the save's start to its consistent copy (the device-to-host copies, overlapped with the loop)."""
    tier0_s: float | None = None
    """From the consistent copy to the tier-0 slot's published manifest (its checksum)."""
    tier1_s: float | None = None
    """From the consistent copy to the published (fsynced, renamed) rank directory."""
    tier2_s: float | None = None
    """From the published rank directory to the uploaded marker (rank 0: to the written COMMIT)."""
    upload_lag_steps: int | None = None
    """At save time: this step minus the newest step this rank had replicated (None: none yet)."""
    status: str = "staging"
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.status in (
            "snapshot",
            "persisted",
            "uploaded",
            "committed",
            "skipped",
            "failed",
            "abandoned",
            "superseded",
        )

    def describe(self) -> str:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}s"

        text = (
            f"checkpoint step {self.step} rank {self.rank}: {self.status}, {self.bytes} bytes, "
            f"stall {self.stall_s + self.wait_staged_s:.3f}s, tier1 {s(self.tier1_s)}, "
            f"tier2 {s(self.tier2_s)}, upload lag "
            f"{'-' if self.upload_lag_steps is None else self.upload_lag_steps} steps"
        )
        return text + (f"; error: {self.error}" if self.error else "")


class MetricsLog:
    """The recent SaveMetrics of one checkpointer; updates are serialised by a lock."""

    def __init__(self, maxlen: int = 256) -> None:
        self._lock = threading.Lock()
        self._items: deque[SaveMetrics] = deque(maxlen=maxlen)

    def add(self, metrics: SaveMetrics) -> SaveMetrics:
        with self._lock:
            self._items.append(metrics)
        return metrics

    def update(self, metrics: SaveMetrics, *, log: bool = False, **changes: object) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(metrics, key, value)
            text = metrics.describe()
        if log:
            if metrics.error:
                logger.error("%s", text)
            else:
                logger.info("%s", text)

    def snapshot(self) -> list[SaveMetrics]:
        with self._lock:
            return [dataclasses.replace(m) for m in self._items]
