"""Tier 1's write pipeline: from save_async() to a committed step, and the hand-off to tier 2.

    LocalWriter.save_async(step, state)          caller's thread
      flatten -> staging layout -> StagingArea.stage()   copy into the host buffer (ckpt/snapshot.py)
      BackgroundWriter.submit(_persist)                  returns a PendingSave
    LocalWriter._persist                          writer thread
      HostSnapshot.run_deferred_copies / require_consistent   ("overlapped" mode)
      persist_rank()            rank directory written, fsynced, renamed (ckpt/persist.py)
      commit_if_complete()      the last rank of this directory writes COMMIT  -> event ckpt_saved
      Replicator.enqueue()      with a shared tier (ckpt/replicator.py); else local retention

At most one save is in flight: a save that finds the previous one still persisting waits or is
skipped (CheckpointConfig.if_busy). A failure is logged ("checkpoint of step N failed", event
`ckpt_failed`), counted (ckpt/save_policy.py) and raised by PendingSave.wait_persisted().
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from datetime import timedelta
from typing import Any

from ckpt.checksum import CHUNK_BYTES, RANGE_CHUNK_BYTES
from ckpt.config import CheckpointConfig
from ckpt.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    SharedStorageError,
)
from ckpt.identity import RunIdentity
from ckpt.layout import MANIFEST_FILE, STATE_FILE, Layout
from ckpt.manifest import TensorEntry
from ckpt.metrics import MetricsLog, SaveMetrics
from ckpt.persist import WrittenRank, commit_if_complete, persist_rank
from ckpt.replicator import Replicator, UploadJob
from ckpt.safetensors_io import dtype_name
from ckpt.save_policy import SaveFailures
from ckpt.sharding import ShardInfo, split_sharded
from ckpt.snapshot import HostSnapshot, StagingArea, StagingLayout
from ckpt.tree import flatten
from core.deadline import Clock, Deadline
from core.events import emit

logger = logging.getLogger(__name__)


class PendingSave:
    """The handle of one save_async(): wait for its stages, read its metrics."""

    def __init__(self, step: int, metrics: SaveMetrics, snapshot: HostSnapshot | None) -> None:
        self.step = step
        self._metrics = metrics
        self._snapshot = snapshot
        self._staged = threading.Event()
        self._persisted = threading.Event()
        self.error: CheckpointError | None = None
        """Why tier 1 failed (None while it runs or after it succeeded)."""
        self.upload: UploadJob | None = None
        if snapshot is None:  # skipped
            self._staged.set()
            self._persisted.set()

    @property
    def metrics(self) -> SaveMetrics:
        """The live metrics of this save (filled in by the background threads)."""
        return self._metrics

    @property
    def skipped(self) -> bool:
        return self._metrics.status == "skipped"

    def wait_staged(self, timeout: timedelta = timedelta(minutes=1)) -> None:
        """Block until the snapshot is consistent (the state may be mutated afterwards)."""
        started = time.monotonic()
        deadline = Deadline.after(timeout)
        if self._snapshot is not None and not self._staged.is_set():
            if not self._snapshot.wait(timeout.total_seconds()):
                raise CheckpointTimeoutError(
                    f"the copy of step {self.step} was not consistent within {timeout}; do not "
                    f"mutate the state yet (is the device hung?)"
                )
            if not self._staged.wait(deadline.remaining()):
                raise CheckpointTimeoutError(f"step {self.step} was not staged within {timeout}")
        self._metrics.wait_staged_s += time.monotonic() - started

    def wait_persisted(self, timeout: timedelta = timedelta(minutes=10)) -> SaveMetrics:
        """Block until tier 1 finished; raise its CheckpointWriteError if it failed."""
        if not self._persisted.wait(timeout.total_seconds()):
            raise CheckpointTimeoutError(
                f"step {self.step} was not written to tier 1 within {timeout}; the write goes on"
            )
        if self.error is not None:
            raise self.error
        return self._metrics

    def wait_uploaded(self, timeout: timedelta = timedelta(minutes=10)) -> SaveMetrics:
        """Block until tier 2 finished (rank 0: committed); raise SharedStorageError if given up."""
        deadline = Deadline.after(timeout)
        self.wait_persisted(timeout)
        if self.upload is None:
            return self._metrics
        if not self.upload.done.wait(deadline.remaining()):
            raise CheckpointTimeoutError(
                f"step {self.step} was not replicated within {timeout}"
                + (f"; last error: {self._metrics.error}" if self._metrics.error else "")
                + "; the upload goes on in the background"
            )
        if self._metrics.status == "abandoned":
            raise SharedStorageError(f"step {self.step}: {self._metrics.error}")
        return self._metrics


class LocalWriter:
    """The tier-1 write pipeline of one rank (see the module docstring).

    `check()` raises when saving cannot go on (the Checkpointer's check); `after_commit()` runs
    on the writer thread once this rank committed a step without a shared tier (local retention).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        layout: Layout,
        *,
        rank: int,
        world_size: int,
        local_world_size: int,
        generation: str,
        metrics: MetricsLog,
        failures: SaveFailures,
        pool: Callable[[], Executor],
        replicator: Replicator | None,
        check: Callable[[], None],
        after_commit: Callable[[], None],
        on_written: Callable[[int], None] | None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.generation = generation
        self.identity: RunIdentity | None = None
        """This run's identity, recorded in every manifest and COMMIT (set once claimed)."""
        self.on_written = on_written
        self.staging = StagingArea()
        self.thread = BackgroundWriter(f"ckpt-writer-r{rank}")
        self.saved: set[int] = set()
        """Steps this rank saved (ckpt/retention.py: abandoned steps)."""
        self.last: PendingSave | None = None
        self._metrics = metrics
        self._failures = failures
        self._pool = pool
        self._replicator = replicator
        self._check = check
        self._after_commit = after_commit

    def save_async(self, step: int, state: Mapping[str, Any]) -> PendingSave:
        """See Checkpointer.save_async."""
        started = time.monotonic()
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a Mapping, got {type(state).__name__}")
        self._check()
        flat, skeleton = flatten(state)
        tensors, shards = split_sharded(flat)  # a DTensor leaf: this rank's piece, if it writes one
        layout = self.staging.layout_for(tensors)
        replicated = self._replicator.last_replicated if self._replicator else None
        metrics = SaveMetrics(
            step=step,
            rank=self.rank,
            bytes=layout.file_bytes,
            upload_lag_steps=None if replicated is None else step - replicated,
        )
        if self.thread.busy():
            why = self._busy_reason()
            self._check()  # the save just waited for may have been the last one allowed to fail
            if why is not None:
                self._metrics.add(metrics)
                self._metrics.update(
                    metrics, log=True, status="skipped", error=why, stall_s=time.monotonic() - started
                )
                return PendingSave(step, metrics, None)
        self._metrics.add(metrics)
        overlapped = self.config.mode == "overlapped"
        stage_timeout = self.config.stage_timeout.total_seconds()
        try:
            snapshot = self.staging.stage(tensors, layout, overlapped=overlapped, timeout=stage_timeout)
        except CheckpointTimeoutError as exc:
            self._metrics.update(metrics, log=True, status="failed", error=str(exc))
            self._failures.failed(exc)
            raise  # the caller reports it (trainer: "checkpoint of step N failed", ckpt_failed)
        self.saved.add(step)
        pending = PendingSave(step, metrics, snapshot)
        if not overlapped:
            pending._staged.set()
        entries = _tensor_entries(layout, with_offsets=bool(shards))
        self._metrics.update(metrics, stall_s=time.monotonic() - started, status="persisting")
        self.last = pending
        self.thread.submit(lambda: self._persist(pending, snapshot, entries, skeleton, shards))
        return pending

    def _busy_reason(self) -> str | None:
        """Wait for the save in flight (if_busy="wait"); why this save is skipped, or None."""
        previous = self.last.step if self.last else "?"
        if self.config.if_busy == "skip":
            return f"the save of step {previous} is still persisting (if_busy='skip')"
        if not self.thread.wait_idle(self.config.busy_timeout.total_seconds()):
            return f"the save of step {previous} still persisted after busy_timeout {self.config.busy_timeout}"
        return None

    def prepare(self, state: Mapping[str, Any]) -> int:
        """See Checkpointer.prepare."""
        tensors, _ = split_sharded(flatten(state)[0])
        if not self.thread.wait_idle(self.config.busy_timeout.total_seconds()):
            raise CheckpointTimeoutError(
                f"a save still persists after busy_timeout {self.config.busy_timeout}; "
                f"prepare() again later"
            )
        return self.staging.reserve(tensors).data_bytes

    def _persist(
        self,
        pending: PendingSave,
        snapshot: HostSnapshot,
        entries: dict[str, TensorEntry],
        skeleton: Any,
        shards: dict[str, ShardInfo],
    ) -> None:
        metrics = pending.metrics
        try:
            snapshot.run_deferred_copies()
            snapshot.require_consistent(self.config.stage_timeout.total_seconds(), f"step {pending.step}")
            pending._staged.set()
            started = time.monotonic()
            hook = self.on_written
            written = persist_rank(
                self.layout,
                step=pending.step,
                rank=self.rank,
                world_size=self.world_size,
                generation=self.generation,
                parts=snapshot.parts(),
                tensors=entries,
                skeleton=skeleton,
                checksum=self.config.checksum,
                chunk_bytes=RANGE_CHUNK_BYTES if shards else CHUNK_BYTES,
                shards=shards,
                pool=self._pool(),
                before_publish=None if hook is None else lambda: hook(pending.step),
                identity=self.identity,
            )
            committed = commit_if_complete(
                self.layout,
                step=pending.step,
                world_size=self.world_size,
                local_world_size=self.local_world_size,
                generation=self.generation,
                identity=self.identity,
            )
            self._failures.succeeded()
            tier1_s = time.monotonic() - started
            if committed is not None:
                logger.info("committed step %d in %s", pending.step, self.layout.step_dir(pending.step))
                emit("ckpt_saved", step=pending.step, tier="local", seconds=round(tier1_s, 3))
            if self._replicator is not None:
                self._metrics.update(metrics, tier1_s=tier1_s, status="uploading")
                pending.upload = self._enqueue_upload(pending.step, written, metrics)
            else:
                self._metrics.update(metrics, log=True, tier1_s=tier1_s, status="persisted")
                if committed is not None:
                    self._after_commit()
        except CheckpointError as exc:
            self._failed(pending, exc)
            logger.error("checkpoint of step %d failed on rank %d: %s", pending.step, self.rank, exc)
        except Exception as exc:  # thread boundary: report, never kill the writer
            logger.exception("checkpoint of step %d failed on rank %d", pending.step, self.rank)
            self._failed(
                pending,
                CheckpointWriteError(f"checkpoint of step {pending.step} failed: {type(exc).__name__}: {exc}"),
            )
        finally:
            pending._staged.set()
            pending._persisted.set()

    def _failed(self, pending: PendingSave, error: CheckpointError) -> None:
        pending.error = error
        self._failures.failed(error)
        self._metrics.update(pending.metrics, status="failed", error=str(error))
        emit("ckpt_failed", step=pending.step, tier="local", error=str(error))

    def _enqueue_upload(self, step: int, written: WrittenRank, metrics: SaveMetrics) -> UploadJob:
        assert self._replicator is not None
        job = UploadJob(
            step=step,
            rank_dir=written.path,
            files=[STATE_FILE, MANIFEST_FILE],
            manifest_sha256=written.manifest_sha256,
            nbytes=written.nbytes,
            metrics=metrics,
            published_at=time.monotonic(),
        )
        self._replicator.enqueue(job)
        return job


def _tensor_entries(layout: StagingLayout, *, with_offsets: bool) -> dict[str, TensorEntry]:
    prefix = len(layout.prefix)
    return {
        s.name: TensorEntry(STATE_FILE, dtype_name(s.dtype), s.shape, prefix + s.begin if with_offsets else None)
        for s in sorted(layout.slots, key=lambda s: s.name)
    }


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
