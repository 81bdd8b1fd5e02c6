"""The Checkpointer: snapshot -> tier 1 (local dir) -> tier 2 (shared store), and restore.

Asynchronous use (the training loop blocks only for the copy out of the accelerator):

    ckpt = Checkpointer(config, rank=rank, world_size=world, local_world_size=local_world,
                        generation=token)
    restored = ckpt.restore()                       # newest complete checkpoint, or None
    for step in ...:
        ...forward, backward...
        ckpt.wait_staged()                          # "overlapped" mode only, before step()
        optimizer.step()
        if step % every == 0:
            ckpt.save_async(step, state)            # returns once the copy is consistent
    ckpt.close()                                    # flushes tier 1 and tier 2 (bounded)

Synchronous use (issue A's API, unchanged): `save(step, state)` on every rank, then
`commit(step)` on one process per local_dir once all ranks saved; `load(step)`.

Threads: one tier-1 writer and (with a shared tier) one replicator per Checkpointer, plus a
small hashing pool; all started lazily and joined by close().
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ckpt.commit import CommitMarker, parse_commit
from ckpt.config import CheckpointConfig
from ckpt.durable import discard_tree, remove_quietly, strerror, write_atomic
from ckpt.errors import (
    CheckpointConflictError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointVersionError,
    CheckpointWriteError,
    SharedStorageError,
)
from ckpt.fs_errors import describe
from ckpt.identity import DirectoryLock, RunIdentity, claim_directory, foreign, job_id
from ckpt.init_source import open_source, restore_from_source
from ckpt.layout import MANIFEST_FILE, STATE_FILE, TMP_PREFIX, Layout
from ckpt.manifest import TensorEntry
from ckpt.metrics import MetricsLog, SaveMetrics
from ckpt.owner import SharedOwner
from ckpt.replicator import Replicator, UploadJob
from ckpt.restore import FETCH_PREFIX, Restored, load_from_tier, load_rank_dir, ranks_to_try
from ckpt.retention import abandoned_steps, awaiting_replication, select_deletions
from ckpt.safe_io import read_regular
from ckpt.safetensors_io import dtype_name
from ckpt.save_policy import SaveFailures
from ckpt.shared import SharedTier
from ckpt.snapshot import Snapshot, StagingArea, StagingLayout
from ckpt.tree import flatten
from ckpt.writer import BackgroundWriter, WrittenRank, commit_if_complete, persist_rank

logger = logging.getLogger(__name__)

_FETCH_MAX_AGE_S = 3600.0


class PendingSave:
    """The handle of one save_async(): wait for its stages, read its metrics."""

    def __init__(self, step: int, metrics: SaveMetrics, snapshot: Snapshot | None) -> None:
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
        deadline = started + timeout.total_seconds()
        if self._snapshot is not None and not self._staged.is_set():
            if not self._snapshot.wait(timeout.total_seconds()):
                raise CheckpointTimeoutError(
                    f"the copy of step {self.step} was not consistent within {timeout}; do not "
                    f"mutate the state yet (is the device hung?)"
                )
            if not self._staged.wait(max(0.0, deadline - time.monotonic())):
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
        deadline = time.monotonic() + timeout.total_seconds()
        self.wait_persisted(timeout)
        if self.upload is None:
            return self._metrics
        if not self.upload.done.wait(max(0.0, deadline - time.monotonic())):
            raise CheckpointTimeoutError(
                f"step {self.step} was not replicated within {timeout}"
                + (f"; last error: {self._metrics.error}" if self._metrics.error else "")
                + "; the upload goes on in the background"
            )
        if self._metrics.status == "abandoned":
            raise SharedStorageError(f"step {self.step}: {self._metrics.error}")
        return self._metrics


class Checkpointer:
    """Saves, commits, lists and loads checkpoints of one rank.

    `local_world_size`: how many ranks share `config.local_dir` (default: $LOCAL_WORLD_SIZE,
    else `world_size`); the last of them to publish a step commits it there.
    `generation`: a token equal on every rank of one incarnation of the job and different
    across incarnations (e.g. agreed at start-up with an all-reduce of random numbers). Commits
    count only the ranks of the same generation, so a rank directory left by a crashed earlier
    incarnation is never mixed into a new commit. "" (default) disables that filter; the
    manifest digests in COMMIT still keep a replaced rank directory from being loaded.
    `on_written(step)`: a fault-injection point for tests, called (on the writer thread) once
    this rank's files of `step` are written and fsynced, before they are published and committed.

    Construction locks `config.local_dir` for this job and claims it (and the shared prefix)
    for `config.run_name` (ckpt/identity.py, ckpt/owner.py): it raises CheckpointConflictError
    when another run's checkpoints or another live job are there, CheckpointWriteError when
    the directory cannot be used (the message says why and what to do). close() unlocks.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int,
        world_size: int,
        local_world_size: int | None = None,
        generation: str = "",
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        _check_index("world_size", world_size, minimum=1)
        _check_index("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} must be below world_size {world_size}")
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            local_world_size = int(env) if env and env.isdigit() else world_size
        _check_index("local_world_size", local_world_size, minimum=1)
        if local_world_size > world_size:
            raise ValueError(
                f"local_world_size {local_world_size} must not exceed world_size {world_size}"
            )
        if not isinstance(generation, str):
            raise ValueError(f"generation must be a str, got {generation!r}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.generation = generation
        self.on_written = on_written
        self._layout = Layout(Path(config.local_dir))
        self._metrics = MetricsLog()
        self._staging = StagingArea()
        self._writer = BackgroundWriter(f"ckpt-writer-r{rank}")
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._stop = threading.Event()
        self._last: PendingSave | None = None
        self._closed = False
        self._shared: SharedTier | None = None
        self._replicator: Replicator | None = None
        self._owner: SharedOwner | None = None
        self._failures = SaveFailures(config.max_failed_saves, Path(config.local_dir))
        self._saved: set[int] = set()  # steps this Checkpointer saved (ckpt/retention.py)
        self._unreadable: set[int] = set()  # local steps that failed verification at restore
        self._foreign: dict[int, str] = {}  # local steps committed by another run
        self._read_timeout = config.read_timeout.total_seconds()
        if config.shared is not None:
            self._shared = SharedTier(config.shared, stop=self._stop, read_timeout=self._read_timeout)
            self._replicator = Replicator(
                self._shared,
                rank=rank,
                world_size=world_size,
                generation=generation,
                metrics=self._metrics,
                stop=self._stop,
                after_progress=self._retention_after_upload,
            )
        self._lock = DirectoryLock.acquire(self._layout.root, run_name=config.run_name, job=job_id())
        try:
            self.identity = self._claim()
        except BaseException:
            self._lock.release()
            raise

    def _claim(self) -> RunIdentity:
        """This run's identity in tier 1 and (when reachable) tier 2; see ckpt/identity.py."""
        shared_uid = None
        if self._shared is not None:
            try:
                found = self._shared.read_identity()
                shared_uid = found.uid if found is not None and found.name == self.config.run_name else None
            except SharedStorageError as exc:
                logger.warning("run identity of %s not read at start: %s", self._shared.url, exc)
        identity = claim_directory(
            self._layout.root,
            self.config.run_name,
            committed=lambda: self._scan_commits(None)[0],
            shared_uid=shared_uid,
        )
        if self._shared is not None:
            shared, heartbeat = self._shared, self._shared.config.owner_heartbeat
            read, write, remove, where = shared.owner_io()
            self._owner = SharedOwner(
                read=read,
                write=write,
                remove=remove,
                where=where,
                job=job_id(),
                run_name=self.config.run_name,
                interval=heartbeat.total_seconds(),
                writer=self.rank == 0,
                stop=self._stop,
            )

            def fence(exc: CheckpointConflictError) -> None:
                shared.fence = exc

            self._owner.on_fence = fence

            def claim_shared() -> None:
                assert self._owner is not None
                if not self._owner.claimed:
                    try:
                        self._owner.claim()
                    except CheckpointConflictError as exc:
                        fence(exc)  # found later, from the replicator: saves stop
                        raise
                shared.claim_identity(identity)

            shared.pending_claim = claim_shared
            try:
                claim_shared()
            except SharedStorageError as exc:
                logger.warning(
                    "shared tier %s not claimed at start (%s); tried again before its first use",
                    shared.url,
                    exc,
                )
        return identity

    def set_generation(self, generation: str) -> None:
        """Set the generation token (see the class docstring) before the first save, e.g. once
        the ranks agreed on one during restore."""
        if not isinstance(generation, str):
            raise ValueError(f"generation must be a str, got {generation!r}")
        self._writer.wait_idle(self.config.busy_timeout.total_seconds())
        self.generation = generation
        if self._replicator is not None:
            self._replicator.generation = generation

    # -- asynchronous saving -------------------------------------------------------------

    def save_async(self, step: int, state: Mapping[str, Any]) -> PendingSave:
        """Snapshot `state` for `step` and persist it in the background.

        Returns once the copy is consistent ("staged" mode) or at once ("overlapped" mode: call
        wait_staged() before mutating the state). Raises TypeError/ValueError for a state that
        cannot be stored, before anything is copied. Background failures do not raise here:
        they are logged, kept in `metrics`, and raised by wait_persisted()/wait_uploaded().
        If the previous save still persists, this one waits or is skipped (config.if_busy).
        """
        started = time.monotonic()
        self._check_open()
        _check_index("step", step, minimum=0)
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a Mapping, got {type(state).__name__}")
        self.check()
        tensors, skeleton = flatten(state)
        layout = self._staging.layout_for(tensors)
        replicated = self._replicator.last_replicated if self._replicator else None
        metrics = SaveMetrics(
            step=step,
            rank=self.rank,
            bytes=layout.file_bytes,
            upload_lag_steps=None if replicated is None else step - replicated,
        )
        if self._writer.busy():
            previous = self._last.step if self._last else "?"
            why = None
            if self.config.if_busy == "skip":
                why = f"the save of step {previous} is still persisting (if_busy='skip')"
            elif not self._writer.wait_idle(self.config.busy_timeout.total_seconds()):
                why = (
                    f"the save of step {previous} still persisted after busy_timeout "
                    f"{self.config.busy_timeout}"
                )
            self.check()  # the save just waited for may have been the last one allowed to fail
            if why is not None:
                self._metrics.add(metrics)
                self._metrics.update(
                    metrics,
                    log=True,
                    status="skipped",
                    error=why,
                    stall_s=time.monotonic() - started,
                )
                return PendingSave(step, metrics, None)
        self._metrics.add(metrics)
        overlapped = self.config.mode == "overlapped"
        stage_timeout = self.config.stage_timeout.total_seconds()
        try:
            snapshot = self._staging.stage(tensors, layout, overlapped=overlapped, timeout=stage_timeout)
        except CheckpointTimeoutError as exc:
            self._metrics.update(metrics, log=True, status="failed", error=str(exc))
            self._failures.failed(exc)
            raise
        self._saved.add(step)
        pending = PendingSave(step, metrics, snapshot)
        if not overlapped:
            pending._staged.set()
        entries = _tensor_entries(layout)
        self._metrics.update(metrics, stall_s=time.monotonic() - started, status="persisting")
        self._last = pending
        self._writer.submit(lambda: self._persist(pending, snapshot, entries, skeleton))
        return pending

    def check(self) -> None:
        """Raise CheckpointSaveError when saving cannot go on (ckpt/save_policy.py): the last
        `max_failed_saves` saves failed, or another live job writes the shared prefix. Cheap:
        no I/O; save_async() calls it too."""
        fence = None
        if self._shared is not None:
            fence = self._shared.fence or (self._owner.fence if self._owner else None)
        self._failures.check(fence)

    def prepare(self, state: Mapping[str, Any]) -> int:
        """Allocate the staging buffer for `state` now (e.g. right after restore) so that the
        first save_async() in the loop costs only the copy; return its size in bytes.

        The first save otherwise pays the allocation (and, for CUDA state, page-locking): 2.9 s
        for 8 GiB on an H200 host. Waits for a save in flight first.
        """
        self._check_open()
        tensors, _ = flatten(state)
        if not self._writer.wait_idle(self.config.busy_timeout.total_seconds()):
            raise CheckpointTimeoutError(
                f"a save still persists after busy_timeout {self.config.busy_timeout}; "
                f"prepare() again later"
            )
        return self._staging.reserve(tensors).data_bytes

    def wait_staged(self, timeout: timedelta = timedelta(minutes=1)) -> None:
        """Block until the newest save's copy is consistent ("overlapped" mode; cheap otherwise)."""
        if self._last is not None:
            self._last.wait_staged(timeout)

    def wait_persisted(self, timeout: timedelta = timedelta(minutes=10)) -> SaveMetrics | None:
        """Block until the newest save reached tier 1; raise its error if it failed."""
        return None if self._last is None else self._last.wait_persisted(timeout)

    def wait_uploaded(self, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Block until every pending upload finished (rank 0: committed) or was given up.

        Raises CheckpointTimeoutError naming the pending steps and the last tier-2 error.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        if self._last is not None:
            self._last._persisted.wait(timeout.total_seconds())
        if self._replicator is None:
            return
        if not self._replicator.wait_idle(max(0.0, deadline - time.monotonic())):
            raise CheckpointTimeoutError(
                f"steps {self._replicator.pending_steps()} not replicated to "
                f"{self._replicator.tier.url} within {timeout} (last error: "
                f"{self._replicator.last_error}); uploads go on in the background"
            )

    @property
    def metrics(self) -> list[SaveMetrics]:
        """Copies of the recent saves' metrics, oldest first."""
        return self._metrics.snapshot()

    @property
    def last_error(self) -> str | None:
        """The newest background failure (tier 1 or tier 2) not followed by a success."""
        for m in reversed(self._metrics.snapshot()):
            if m.status in ("failed", "abandoned") or m.error:
                return m.error
            if m.status in ("persisted", "uploaded", "committed"):
                return None
        return None

    def _persist(
        self,
        pending: PendingSave,
        snapshot: Snapshot,
        entries: dict[str, TensorEntry],
        skeleton: Any,
    ) -> None:
        metrics = pending.metrics
        try:
            snapshot.run_deferred_copies()
            snapshot.require_consistent(self.config.stage_timeout.total_seconds(), f"step {pending.step}")
            pending._staged.set()
            started = time.monotonic()
            written = persist_rank(
                self._layout,
                step=pending.step,
                rank=self.rank,
                world_size=self.world_size,
                generation=self.generation,
                parts=snapshot.parts(),
                tensors=entries,
                skeleton=skeleton,
                checksum=self.config.checksum,
                pool=self._hash_pool(),
                before_publish=self._before_publish(pending.step),
                identity=self.identity,
            )
            committed = commit_if_complete(
                self._layout,
                step=pending.step,
                world_size=self.world_size,
                local_world_size=self.local_world_size,
                generation=self.generation,
                identity=self.identity,
            )
            self._failures.succeeded()
            tier1_s = time.monotonic() - started
            if committed is not None:
                logger.info(
                    "committed step %d in %s", pending.step, self._layout.step_dir(pending.step)
                )
            if self._replicator is not None:
                self._metrics.update(metrics, tier1_s=tier1_s, status="uploading")
                pending.upload = self._enqueue_upload(pending.step, written, metrics)
            else:
                self._metrics.update(metrics, log=True, tier1_s=tier1_s, status="persisted")
                if committed is not None:
                    self._apply_local_retention()
        except CheckpointError as exc:
            pending.error = exc
            self._failures.failed(exc)
            self._metrics.update(metrics, status="failed", error=str(exc))
            logger.error(
                "checkpoint of step %d failed on rank %d: %s", pending.step, self.rank, exc
            )
        except Exception as exc:  # thread boundary: report, never kill the writer
            logger.exception("checkpoint of step %d failed on rank %d", pending.step, self.rank)
            pending.error = CheckpointWriteError(
                f"checkpoint of step {pending.step} failed: {type(exc).__name__}: {exc}"
            )
            self._failures.failed(pending.error)
            self._metrics.update(metrics, status="failed", error=str(pending.error))
        finally:
            pending._staged.set()
            pending._persisted.set()

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

    def _before_publish(self, step: int) -> Callable[[], None] | None:
        hook = self.on_written
        return None if hook is None else lambda: hook(step)

    def _hash_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.config.hash_threads, thread_name_prefix=f"ckpt-hash-r{self.rank}"
                )
            return self._pool

    # -- synchronous saving (issue A's API) ----------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Write this rank's `state` for `step` atomically; return the rank directory.

        Raises TypeError/ValueError for a state that cannot be stored (before any I/O) and
        CheckpointWriteError when the disk refuses (the partial write is removed first).
        Saving a step that is committed here un-commits it first; commit it again afterwards.
        With a shared tier, the rank directory is then replicated in the background.
        """
        self._check_open()
        _check_index("step", step, minimum=0)
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a Mapping, got {type(state).__name__}")
        started = time.monotonic()
        tensors, skeleton = flatten(state)
        layout = StagingLayout.of(tensors)  # TypeError before touching the disk
        self._writer.wait_idle(self.config.busy_timeout.total_seconds())
        self._saved.add(step)
        datas = [
            tensors[s.name].detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            for s in layout.slots
        ]
        parts = [memoryview(layout.prefix)] + [_tensor_bytes(d) for d in datas if d.numel()]
        written = persist_rank(
            self._layout,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            generation=self.generation,
            parts=parts,
            tensors=_tensor_entries(layout),
            skeleton=skeleton,
            checksum=self.config.checksum,
            pool=self._hash_pool(),
            before_publish=self._before_publish(step),
            identity=self.identity,
        )
        del parts, datas
        elapsed = time.monotonic() - started
        logger.info(
            "saved rank %d of step %d: %d tensors, %d bytes in %.3fs to %s",
            self.rank,
            step,
            len(tensors),
            written.nbytes,
            elapsed,
            written.path,
        )
        if self._replicator is not None:
            metrics = self._metrics.add(
                SaveMetrics(
                    step=step,
                    rank=self.rank,
                    bytes=written.nbytes,
                    stall_s=elapsed,
                    tier1_s=elapsed,
                    status="uploading",
                )
            )
            self._enqueue_upload(step, written, metrics)
        return written.path

    def commit(self, step: int) -> None:
        """Mark `step` complete in this local_dir, then delete checkpoints beyond retention.

        Call from one process per local_dir, after every rank's `save(step)` returned.
        """
        _check_index("step", step, minimum=0)
        step_dir = self._layout.step_dir(step)
        rank_dirs = self._layout.rank_dirs(step)
        if not any(rank < self.world_size for rank in rank_dirs):
            raise CheckpointNotFoundError(
                f"nothing was saved for step {step} in {step_dir}; call save({step}, ...) on "
                f"every rank before commit({step})",
                path=step_dir,
            )
        marker = CommitMarker(
            step=step,
            world_size=self.world_size,
            run=self.identity.name,
            run_uid=self.identity.uid,
        )
        try:
            current = self._read_commit(step)
        except CheckpointError:
            current = None  # damaged: replaced
        other = None if current is None else foreign(current, self.identity, name=self.identity.name)
        if other is not None:
            raise CheckpointConflictError(
                f"step {step} in {step_dir} is committed by {other}, not by this run "
                f"{self.identity.describe()}; not replacing it. Move that step directory away",
                path=step_dir,
            )
        for rank, path in rank_dirs.items():
            if rank >= self.world_size:  # left by an earlier save with a larger world
                _discard_quietly(path)
        try:
            write_atomic(self._layout.commit_path(step), marker.to_bytes())
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not write {self._layout.commit_path(step)}: "
                f"{describe(exc, self._layout.root)}; step {step} stays uncommitted",
                path=step_dir,
            ) from exc
        logger.info("committed step %d (world size %d) in %s", step, self.world_size, step_dir)
        if self._shared is None:
            self._apply_local_retention()

    # -- retention -----------------------------------------------------------------------

    def _retention_after_upload(self, shared_committed: Collection[int] | None) -> None:
        self._apply_local_retention(shared_committed)

    def _apply_local_retention(self, shared_committed: Collection[int] | None = None) -> None:
        with self._retention_lock:
            committed = self.committed_steps()
            if not committed:
                return
            present = list(self._layout.step_dirs())
            abandoned = abandoned_steps(committed, saved=self._saved, unreadable=self._unreadable)
            rules: dict[str, Any] = {
                "keep_last": self.config.keep_last,
                "keep_every": self.config.keep_every,
                "abandoned": abandoned,
            }
            protected: set[int] = set(self._foreign)
            if self._shared is not None:
                candidates = select_deletions(committed=committed, present=present, **rules)
                releasable = [s for s in candidates if s in committed]
                if releasable:
                    if shared_committed is None:
                        try:
                            shared_committed = set(self._shared.committed())
                        except (SharedStorageError, CheckpointError) as exc:
                            logger.info("local retention waits for the shared tier: %s", exc)
                            return
                    protected |= awaiting_replication(
                        set(releasable) - abandoned,
                        shared_committed=set(shared_committed),
                        shared_keep_every=self._shared.config.keep_every,
                    )
            doomed = set(
                select_deletions(committed=committed, present=present, protected=protected, **rules)
            )
            for step, path in sorted(self._layout.step_dirs().items()):
                if step in doomed:
                    logger.log(
                        logging.WARNING if step in abandoned else logging.INFO,
                        "removing %s step %d (%s)%s",
                        "committed" if step in committed else "uncommitted",
                        step,
                        path,
                        ": unreadable, or newer than the step this run restarted from"
                        if step in abandoned
                        else "",
                    )
                    _discard_quietly(path)
                elif step in committed:
                    for entry in _list_dir(path):
                        if entry.name.startswith(TMP_PREFIX):
                            logger.info("removing stale %s", entry)
                            remove_quietly(entry)
            for entry in _list_dir(self._layout.root):
                if entry.name.startswith(TMP_PREFIX) and not _young_fetch_dir(entry):
                    remove_quietly(entry)

    # -- reading -------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Committed steps of this run in local_dir, newest first. A step with a damaged COMMIT
        is skipped; so is one committed by another run (logged once, naming both runs)."""
        markers, newer = self._scan_commits(getattr(self, "identity", None))
        return sorted(set(markers) | newer, reverse=True)

    def _scan_commits(
        self, identity: RunIdentity | None
    ) -> tuple[dict[int, CommitMarker], set[int]]:
        """(this run's committed steps with their markers, steps committed by a newer version).

        With `identity` None, every readable COMMIT counts (used while claiming the directory)."""
        markers: dict[int, CommitMarker] = {}
        newer: set[int] = set()
        foreign_now: dict[int, str] = {}
        for step in self._layout.step_dirs():
            try:
                marker = self._read_commit(step)
            except CheckpointVersionError:
                newer.add(step)  # committed by a newer version: listed, so load() says "upgrade"
                continue
            except CheckpointError as exc:
                logger.warning("ignoring step %d: %s", step, exc)
                continue
            if marker is None:
                continue
            if identity is not None:
                other = foreign(marker, identity, name=identity.name)
                if other is not None:
                    foreign_now[step] = other
                    if step not in self._foreign:
                        logger.warning(
                            "ignoring %s: it was committed by %s, not by this run %s; to start "
                            "from it, use init_from=%s in a new checkpoint directory",
                            self._layout.commit_path(step),
                            other,
                            identity.describe(),
                            self._layout.step_dir(step),
                        )
                    continue
            markers[step] = marker
        if identity is not None:
            self._foreign = foreign_now
        return markers, newer

    def latest(self) -> int | None:
        """The newest committed step in local_dir, or None if there is none."""
        steps = self.committed_steps()
        return steps[0] if steps else None

    def has_rank(self, step: int, rank: int) -> bool:
        """Whether `step` is committed here and this local_dir holds rank `rank` of it."""
        try:
            marker = self._read_commit(step)
        except CheckpointError:
            return False
        return (
            marker is not None
            and rank < marker.world_size
            and self._layout.rank_dir(step, rank).is_dir()
        )

    def saved_world_size(self, step: int) -> int:
        """The world size that wrote committed `step`."""
        return self._require_commit(step).world_size

    def load(self, step: int, *, rank: int | None = None) -> dict[str, Any]:
        """Load rank `rank` (default: this rank) of `step` committed in local_dir.

        Checks the manifest, then each file's size and checksum, before deserialising.
        Tensors come back on the CPU, mapped from the file (copy-on-write). Raises
        CheckpointNotFoundError when the step is not committed here or this local_dir lacks
        that rank, CheckpointCorruptError / CheckpointVersionError naming the file at fault.
        """
        _check_index("step", step, minimum=0)
        rank = self.rank if rank is None else rank
        _check_index("rank", rank, minimum=0)
        marker = self._require_commit(step)
        rank_dir = self._layout.rank_dir(step, rank)
        if rank >= marker.world_size or not rank_dir.is_dir():
            raise CheckpointNotFoundError(
                f"rank {rank} of step {step} is not in {self._layout.step_dir(step)} "
                f"(saved by world size {marker.world_size}); this node did not write it: "
                f"fetch it from the node that did or load another step",
                path=rank_dir,
            )
        expected = None if marker.manifests is None else marker.manifests.get(rank)
        if marker.manifests is not None and expected is None:
            raise CheckpointNotFoundError(
                f"rank {rank} of step {step} is not part of the commit in "
                f"{self._layout.commit_path(step)}; load another step",
                path=rank_dir,
            )
        state = load_rank_dir(
            rank_dir,
            step=step,
            rank=rank,
            expected_manifest_sha256=expected,
            pool=self._hash_pool(),
            run=self.identity.name,
            timeout=self._read_timeout,
        )
        logger.info("loaded rank %d of step %d from %s", rank, step, rank_dir)
        return state

    def available_steps(self) -> list[int]:
        """Steps committed in either tier, newest first (the shared tier only if reachable)."""
        steps = set(self.committed_steps())
        if self._shared is not None:
            try:
                steps |= set(self._shared.committed())
            except (SharedStorageError, CheckpointError) as exc:
                logger.warning(
                    "shared tier not listed, restoring from the local tier only: %s", exc
                )
        return sorted(steps, reverse=True)

    def restore(
        self,
        *,
        step: int | None = None,
        max_step: int | None = None,
        replicated: bool = True,
    ) -> Restored | None:
        """Load the newest checkpoint this rank can read completely and intact; None if none.

        Candidates are the steps committed in either tier (only `step` if given; none above
        `max_step`), newest first. For each, this rank's part (or rank 0's, for a rank the
        saving world did not have, when `replicated`) is loaded from the local tier, else the
        shared one. A damaged copy is logged with the file's name and the next copy or older
        step is tried. CheckpointVersionError (written by a newer version) is raised.
        """
        self._check_open()
        local = set(self.committed_steps())
        shared: dict[int, CommitMarker] = {}
        unlisted: CheckpointError | None = None
        if self._shared is not None:
            try:
                shared = self._shared.committed()
            except (SharedStorageError, CheckpointError) as exc:
                unlisted = exc
                logger.warning(
                    "shared tier not listed, restoring from the local tier only: %s", exc
                )
        if unlisted is not None and not local and self.config.init_from is not None:
            # Falling back to init_from here could throw away this run's own progress.
            raise SharedStorageError(
                f"cannot tell whether run {self.identity.describe()} has checkpoints of its own: "
                f"{unlisted}; init_from ({self.config.init_from}) is used only once the shared "
                f"tier answers. Restart when it is reachable",
            ) from unlisted
        candidates = sorted(local | set(shared), reverse=True)
        if step is not None:
            candidates = [s for s in candidates if s == step]
        if max_step is not None:
            candidates = [s for s in candidates if s <= max_step]
        for candidate in candidates:
            restored = self._restore_step(
                candidate, candidate in local, shared.get(candidate), replicated
            )
            if restored is not None:
                if (restored.tier == "local" and self._legacy_local(candidate)) or (
                    restored.tier == "shared" and shared[candidate].legacy
                ):
                    logger.warning(
                        "step %d (%s) carries no run identity (written before it existed); "
                        "loading it as run %s",
                        candidate,
                        restored.path,
                        self.identity.describe(),
                    )
                logger.info(
                    "restored step %d (rank %d's part, %s tier) from %s",
                    restored.step,
                    restored.rank,
                    restored.tier,
                    restored.path,
                )
                return restored
        if candidates:
            logger.warning("no intact checkpoint among steps %s", candidates)
        elif self.config.init_from is not None and not (local or shared):
            return self._restore_init(step=step, max_step=max_step, replicated=replicated)
        return None

    def _restore_init(
        self, *, step: int | None, max_step: int | None, replicated: bool
    ) -> Restored | None:
        """Load from config.init_from (ckpt/init_source.py): this run has no checkpoint yet."""
        tier, fixed = open_source(self.config)
        return restore_from_source(
            tier,
            fixed,
            rank=self.rank,
            replicated=replicated,
            step=step,
            max_step=max_step,
            load=lambda t, s, r, m: load_from_tier(
                t,
                s,
                r,
                m,
                own_rank=self.rank,
                fetch_root=self._layout.root,
                pool=self._hash_pool(),
                run=None,
                timeout=self._read_timeout,
                init_from=True,
            ),
        )

    def _restore_step(
        self, step: int, in_local: bool, shared_marker: CommitMarker | None, replicated: bool
    ) -> Restored | None:
        local_marker = None
        if in_local:
            try:
                local_marker = self._read_commit(step)
            except CheckpointVersionError:
                raise
            except CheckpointError as exc:
                logger.warning("ignoring local step %d: %s", step, exc)
        marker = local_marker or shared_marker
        if marker is None:
            return None
        saved_world = marker.world_size

        def has(m: CommitMarker | None, rank: int) -> bool:
            if m is None or rank >= m.world_size:
                return False
            return m.manifests is None or rank in m.manifests

        def local_copy(rank: int) -> bool:
            return has(local_marker, rank) and self._layout.rank_dir(step, rank).is_dir()

        # Bounded by what is on disk, never by the (possibly crafted) world size of the COMMIT.
        on_this_node = [r for r in sorted(self._layout.rank_dirs(step)) if local_copy(r)]
        own = self.rank in on_this_node or has(shared_marker, self.rank)
        for rank in ranks_to_try(
            rank=self.rank,
            saved_world_size=saved_world,
            has_own=own,
            replicated=replicated,
            on_this_node=on_this_node,
        ):
            if rank in on_this_node:
                try:
                    state = self.load(step, rank=rank)
                    return Restored(
                        step,
                        state,
                        rank,
                        rank == self.rank,
                        "local",
                        str(self._layout.rank_dir(step, rank)),
                    )
                except CheckpointVersionError:
                    raise
                except CheckpointError as exc:
                    self._unreadable.add(step)
                    logger.warning(
                        "skipping checkpoint step %d: local copy of rank %d is unusable: %s",
                        step,
                        rank,
                        exc,
                    )
            if has(shared_marker, rank):
                assert shared_marker is not None and self._shared is not None
                try:
                    return load_from_tier(
                        self._shared,
                        step,
                        rank,
                        shared_marker,
                        own_rank=self.rank,
                        fetch_root=self._layout.root,
                        pool=self._hash_pool(),
                        run=self.identity.name,
                        timeout=self._read_timeout,
                    )
                except CheckpointVersionError:
                    raise
                except CheckpointError as exc:
                    if self._replicator is not None:
                        self._replicator.unreadable.add(step)
                    logger.warning(
                        "skipping checkpoint step %d: shared copy of rank %d is unusable: %s",
                        step,
                        rank,
                        exc,
                    )
        return None

    def _require_commit(self, step: int) -> CommitMarker:
        marker = self._read_commit(step)
        other = None if marker is None else foreign(marker, self.identity, name=self.identity.name)
        if other is not None:
            raise CheckpointConflictError(
                f"step {step} in {self._layout.root} was committed by {other}, not by this run "
                f"{self.identity.describe()}; not loading it (start a new run from it with "
                f"init_from={self._layout.step_dir(step)})",
                path=self._layout.commit_path(step),
            )
        if marker is None:
            path = self._layout.commit_path(step)
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self._layout.root} (no {path}); "
                f"committed steps: {self.committed_steps() or 'none'}",
                path=path,
            )
        return marker

    def _read_commit(self, step: int) -> CommitMarker | None:
        """The step's COMMIT marker, or None if it has none."""
        path = self._layout.commit_path(step)
        try:
            data = read_regular(path, timeout=self._read_timeout)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {strerror(exc)}", path=path) from exc
        return parse_commit(data, path=path, step=step)

    def _legacy_local(self, step: int) -> bool:
        try:
            marker = self._read_commit(step)
        except CheckpointError:
            return False
        return marker is not None and marker.legacy

    # -- lifecycle -----------------------------------------------------------------------

    def close(self, timeout: timedelta = timedelta(minutes=2)) -> bool:
        """Finish the save in flight and pending uploads (up to `timeout`), then stop and join
        every thread and free the staging buffer. Returns False if work was left unfinished
        (logged; committed checkpoints are unaffected). Idempotent."""
        if self._closed:
            return True
        self._closed = True
        deadline = time.monotonic() + timeout.total_seconds()
        finished = self._writer.close(timeout.total_seconds())
        if self._replicator is not None:
            finished = self._replicator.close(max(0.0, deadline - time.monotonic())) and finished
        self._stop.set()
        if self._owner is not None:
            self._owner.close()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        if finished:
            self._staging.release()
        self._lock.release()
        return finished

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this Checkpointer (rank {self.rank}) is closed")


def _tensor_entries(layout: StagingLayout) -> dict[str, TensorEntry]:
    return {
        s.name: TensorEntry(STATE_FILE, dtype_name(s.dtype), s.shape)
        for s in sorted(layout.slots, key=lambda s: s.name)
    }


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _young_fetch_dir(entry: Path) -> bool:
    if not entry.name.startswith(FETCH_PREFIX):
        return False
    try:
        return time.time() - entry.stat().st_mtime < _FETCH_MAX_AGE_S
    except OSError:
        return False


def _discard_quietly(path: Path) -> None:
    try:
        discard_tree(path)
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)


def _list_dir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _check_index(what: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")

