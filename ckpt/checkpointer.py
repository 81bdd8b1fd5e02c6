"""The Checkpointer: the one object a training loop holds, a facade over the tiers.

    ckpt = Checkpointer(config, rank=rank, world_size=world, local_world_size=local_world,
                        generation=token)
    restored = ckpt.restore()                       # newest complete checkpoint, or None
    for step in ...:
        ...forward, backward...
        ckpt.wait_staged()                          # "overlapped" mode only, before step()
        optimizer.step()
        if step % every == 0:
            ckpt.save_async(step, state)            # returns once the copy is consistent
        elif ckpt.has_tier0:
            ckpt.snapshot(step, state)              # tier 0 only: host memory, every step
    ckpt.close()                                    # flushes tier 1 and tier 2 (bounded)

The parts (each in its own module):
- tier 0 (ckpt/tier0.py): with a tier-0 directory (host shared memory of the node, CheckpointConfig.
  tier0_dir), every save and snapshot lands in one of the rank's two slots there first;
- saving: `LocalWriter` (ckpt/writer.py) stages the state into a host buffer (a tier-0 slot), writes and commits
  it in tier 1 on a background thread, and hands it to the `Replicator` (ckpt/replicator.py),
  which uploads it to tier 2 and (rank 0) commits it there;
- the tiers: `LocalTier` (ckpt/local.py) and `SharedTier` (ckpt/shared.py), one interface
  (ckpt/tiers.py);
- restoring: `Restorer` (ckpt/restore.py), the restore policy over both tiers and init_from;
- retention: ckpt/retention.py; run identity and ownership: ckpt/identity.py, ckpt/owner.py.

`save(step, state)` is `save_async(step, state).wait_persisted()`: a step is committed in tier 1
once every rank of this directory saved it; there is no separate commit call.

Threads: one tier-1 writer and (with a shared tier) one replicator per Checkpointer, plus a
small hashing pool; all started lazily and joined by close().
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from ckpt import peer_parts
from ckpt.config import CheckpointConfig
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    SharedStorageError,
)
from ckpt.format import INT64_MAX
from ckpt.helper import HelperClient
from ckpt.identity import LOCK_FILE, DirectoryLock, claim_directory, job_id
from ckpt.local import LocalTier
from ckpt.metrics import MetricsLog, SaveMetrics
from ckpt.owner import SharedOwner, claim_shared_prefix
from ckpt.replicator import Replicator
from ckpt.restore import Restored, Restorer
from ckpt.retention import apply_local_retention
from ckpt.save_policy import SaveFailures
from ckpt.shared import SharedTier
from ckpt.snapshot import StateMark
from ckpt.tier0 import HostSlots, HostTier
from ckpt.tiers import Tier
from ckpt.tree import Flat
from ckpt.writer import LocalWriter, PendingSave
from core.deadline import Deadline
from core.numbers import decimal

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "PendingSave"]


class Checkpointer:
    """Saves, lists, loads and restores the checkpoints of one rank.

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
        source = "local_world_size"
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            parsed = decimal(env or "")
            local_world_size = world_size if parsed is None else parsed
            source = "$LOCAL_WORLD_SIZE" if parsed is not None else source
        _check_index(source, local_world_size, minimum=1)
        if local_world_size > world_size:
            raise ValueError(f"{source} {local_world_size} must not exceed world_size {world_size}")
        _check_generation(generation)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self._metrics = MetricsLog()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        read_timeout = config.read_timeout.total_seconds()
        self._local = LocalTier(Path(config.local_dir), read_timeout=read_timeout)
        self._shared: SharedTier | None = None
        self._replicator: Replicator | None = None
        self._owner: SharedOwner | None = None
        if config.shared is not None:
            self._shared = SharedTier(
                config.shared, stop=self._stop, read_timeout=read_timeout, scratch=self._local.root
            )
            self._replicator = Replicator(
                self._shared,
                rank=rank,
                world_size=world_size,
                generation=generation,
                metrics=self._metrics,
                stop=self._stop,
                after_progress=self._apply_local_retention,
            )
        self._failures = SaveFailures(config.max_failed_saves, self._local.root)
        self._writer = LocalWriter(
            config,
            self._local.layout,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            generation=generation,
            metrics=self._metrics,
            failures=self._failures,
            pool=self._hash_pool,
            replicator=self._replicator,
            check=self.check,
            after_commit=self._apply_local_retention,
            on_written=on_written,
        )
        self._staging = self._writer.staging
        shared_uid = self._shared_uid()  # network I/O: before the guard, which other local ranks wait on
        # The local ranks of one job share the directory lock: the identity in RUN.json is read or
        # minted under the guard, so they all commit under one uid.
        self._lock = DirectoryLock.acquire(
            self._local.root, run_name=config.run_name, job=job_id(),
            under_guard=lambda: self._claim_local(shared_uid),
        )
        try:
            self._claim_shared()
        except BaseException:
            self._lock.release()
            raise
        self._local.identity = self._writer.identity = self.identity
        self._host: HostTier | None = None
        tier0_root = config.tier0_root
        if tier0_root is not None and Path(tier0_root).exists() and not Path(tier0_root).is_dir():
            raise CheckpointWriteError(f"tier0_dir {tier0_root} (CheckpointConfig.tier0_dir or $ELASTIC_TIER0_DIR) is "
                                       "not a directory; point it at one in tmpfs (/dev/shm), or leave it unset",
                                       path=tier0_root)
        if tier0_root is not None:
            self._host = HostTier(Path(tier0_root), read_timeout=read_timeout, local_world_size=local_world_size)
            self._host.identity = self.identity
            self._writer.tier0 = HostSlots(Path(tier0_root), rank, self.identity, config.tier0_slots)
            if config.tier0_helper:
                self._writer.helper = HelperClient(tier0_root)
                self._writer.snapshot_helper = HelperClient(tier0_root)
                if self._shared is not None:  # the replicator thread's own connection: tier 2's bytes
                    self._shared.helper = HelperClient(tier0_root)
        self._restorer = Restorer(
            self._local, self._shared, rank=rank, identity=self.identity, config=config, pool=self._hash_pool,
            host=self._host,
        )

    # This run's identity in tier 1 and (when reachable) tier 2; see ckpt/identity.py.
    def _shared_uid(self) -> str | None:
        if self._shared is None:
            return None
        try:
            found = self._shared.read_identity()
        except SharedStorageError as exc:
            logger.warning("run identity of %s not read at start: %s", self._shared.url, exc)
            return None
        return found.uid if found is not None and found.name == self.config.run_name else None

    def _claim_local(self, shared_uid: str | None) -> None:
        self.identity = claim_directory(
            self._local.root, self.config.run_name, committed=self._local.committed, shared_uid=shared_uid
        )

    def _claim_shared(self) -> None:
        if self._shared is not None:
            self._owner = claim_shared_prefix(
                self._shared, self.identity, run_name=self.config.run_name, writer=self.rank == 0, stop=self._stop
            )

    @property
    def generation(self) -> str:
        return self._writer.generation

    def set_generation(self, generation: str) -> None:
        """Set the generation token (see the class docstring) before the first save, e.g. once
        the ranks agreed on one during restore."""
        _check_generation(generation)
        self._writer.thread.wait_idle(self.config.busy_timeout.total_seconds())
        self._writer.generation = generation
        if self._replicator is not None:
            self._replicator.generation = generation

    # -- saving --------------------------------------------------------------------------

    def save_async(self, step: int, state: Mapping[str, Any] | Flat, *, at: StateMark | None = None) -> PendingSave:
        """Snapshot `state` for `step` and persist it in the background (ckpt/writer.py).

        Returns once the copy is consistent ("staged" mode) or at once ("overlapped" mode: call
        wait_staged() before mutating the state). Raises TypeError/ValueError for a state that
        cannot be stored, before anything is copied. Background failures do not raise here:
        they are logged, kept in `metrics`, and raised by wait_persisted()/wait_uploaded().
        If the previous save still persists, this one waits or is skipped (config.if_busy).
        `at`: as for `snapshot`, the state as it was at that `mark()`.
        """
        self._check_open()
        _check_index("step", step, minimum=0)
        return self._writer.save_async(step, state, at=at)

    @property
    def has_tier0(self) -> bool:
        """Whether snapshots have a tier 0 to go to (CheckpointConfig.tier0_dir or $ELASTIC_TIER0_DIR)."""
        return self._writer.tier0 is not None

    @property
    def persisting(self) -> bool:
        """Whether a save is still being written to tier 1 (a save_async now would wait for it, or be skipped)."""
        return self._writer.thread.busy()

    def mark(self) -> StateMark:
        """Where the training streams are now: pass it to a later `snapshot(..., at=...)` to snapshot the state
        as it is at this moment, when nothing changes the state in between except on those streams after the
        mark (trainer/resumable.py takes a snapshot's bookkeeping off the step boundary this way)."""
        self._check_open()
        return self._writer.staging.mark()

    def snapshot(self, step: int, state: Mapping[str, Any] | Flat, *, at: StateMark | None = None) -> PendingSave:
        """Snapshot `state` for `step` into tier 0 only (host memory of the node; ckpt/tier0.py).

        Costs the loop what save_async() costs it (the copy, or nothing in "overlapped" mode) and
        never waits: while both of the rank's slots are in use (the newest snapshot, and one that a
        tier-1 write still reads) or the previous snapshot is still being checksummed, it is skipped
        (PendingSave.skipped). Without a tier 0 every call is skipped. Cheap enough for every step.
        """
        self._check_open()
        _check_index("step", step, minimum=0)
        return self._writer.save_async(step, state, persist=False, at=at)

    @property
    def newest_snapshot(self) -> PendingSave | None:
        """The newest save or snapshot that went to tier 0 (the one `wait_snapshot` waits for)."""
        return self._writer.last_tier0

    def snapshot_ready(self) -> bool:
        """Whether `wait_snapshot` would return True at once (the check a loop makes every step, without the
        deadline's arithmetic)."""
        newest = self._writer.last_tier0
        return (newest is None or newest.in_tier0) and not self._writer.tier0_thread.busy()

    def wait_snapshot(self, timeout: timedelta) -> bool:
        """Block until the newest save or snapshot with a tier-0 slot is in tier 0 (checksummed and published,
        or given up) and the tier-0 thread can take the next snapshot; False at the deadline. A loop that calls
        it before each snapshot never has two unpublished ones: a kill at any moment loses at most the step
        whose snapshot is in flight."""
        deadline = Deadline.after(timeout)
        newest = self._writer.last_tier0
        if newest is not None and not newest.wait_in_tier0(deadline.remaining() or 0.0):
            return False
        return self._writer.tier0_thread.wait_idle(deadline.remaining() or 0.0)

    def save(self, step: int, state: Mapping[str, Any], timeout: timedelta = timedelta(minutes=10)) -> Path:
        """`save_async(step, state).wait_persisted()`, after waiting for the save in flight;
        return this rank's directory of `step`. Raises what those raise, and
        CheckpointTimeoutError when the save is skipped (if_busy="skip" or busy_timeout)."""
        self._check_open()
        self._writer.thread.wait_idle(self.config.busy_timeout.total_seconds())
        pending = self.save_async(step, state)
        if pending.skipped:
            raise CheckpointTimeoutError(f"step {step} was not saved: {pending.metrics.error}")
        pending.wait_persisted(timeout)
        return self._local.layout.rank_dir(step, self.rank)

    def commit(self, step: int) -> None:
        """Check that `step` is committed in local_dir (kept for callers of the former
        synchronous API: save() commits a step once every rank of this directory saved it).
        Raises CheckpointNotFoundError, naming what is missing, when it is not."""
        _check_index("step", step, minimum=0)
        layout = self._local.layout
        step_dir = layout.step_dir(step)
        if not any(rank < self.world_size for rank in layout.rank_dirs(step)):
            raise CheckpointNotFoundError(
                f"nothing was saved for step {step} in {step_dir}; call save({step}, ...) on "
                f"every rank before commit({step})",
                path=step_dir,
            )
        try:
            committed = self._local.read_commit(step) is not None
        except CheckpointError:
            committed = False
        if not committed:
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {step_dir}: not all {self.local_world_size} ranks of "
                f"this directory saved it (this generation, world size {self.world_size})",
                path=step_dir,
            )

    def check(self, *, final: bool = False) -> None:
        """Raise CheckpointSaveError when saving cannot go on (ckpt/save_policy.py): the last
        `max_failed_saves` saves failed, or another live job writes the shared prefix. Cheap:
        no I/O; save_async() calls it too. `final` (at the run's end, after close()): also when the
        last save failed, however few in a row (unless max_failed_saves is None)."""
        fence = None
        if self._shared is not None:
            fence = self._shared.fence or (self._owner.fence if self._owner else None)
        self._failures.check(fence, final=final)

    def prepare(self, state: Mapping[str, Any]) -> int:
        """Allocate the staging buffer for `state` now (e.g. right after restore) so that the
        first save_async() in the loop costs only the copy; return its size in bytes.

        The first save otherwise pays the allocation (and, for CUDA state, page-locking): 2.9 s
        for 8 GiB on an H200 host. Waits for a save in flight first.
        """
        self._check_open()
        return self._writer.prepare(state)

    def wait_staged(self, timeout: timedelta = timedelta(minutes=1)) -> None:
        """Block until the newest save's copy is consistent ("overlapped" mode; cheap otherwise)."""
        if self._writer.last is not None:
            self._writer.last.wait_staged(timeout)

    def wait_persisted(self, timeout: timedelta = timedelta(minutes=10)) -> SaveMetrics | None:
        """Block until the newest save reached tier 1; raise its error if it failed."""
        last = self._writer.last_persist
        return None if last is None else last.wait_persisted(timeout)

    def wait_uploaded(self, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Block until every pending upload finished (rank 0: committed) or was given up.

        Raises CheckpointTimeoutError naming the pending steps and the last tier-2 error.
        """
        deadline = Deadline.after(timeout)
        if self._writer.last_persist is not None:
            self._writer.last_persist._persisted.wait(timeout.total_seconds())
        if self._replicator is None:
            return
        if not self._replicator.wait_idle(deadline.remaining()):
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

    def _apply_local_retention(self, shared_committed: Collection[int] | None = None) -> None:
        """Tier-1 retention (ckpt/retention.py), after a tier-1 commit or a tier-2 round."""
        with self._retention_lock:
            try:
                self._keep_directory_locked()
            except CheckpointError as exc:  # another job took the directory meanwhile: say so at every commit
                logger.error("%s: could not lock it again: %s", self._local.root, exc)
            apply_local_retention(
                self._local,
                keep_last=self.config.keep_last,
                keep_every=self.config.keep_every,
                saved=self._writer.saved,
                shared=self._shared,
                shared_committed=shared_committed,
                uploading=self._replicator.uploading() if self._replicator is not None else None,
            )

    def _keep_directory_locked(self) -> None:
        """The directory deleted (or its LOCK removed) while this job ran: its saves recreate it, but without a
        LOCK nothing keeps another job out. Take the lock again (RUN.json too), loudly: what was saved there
        before is gone."""
        if self._closed or self._lock.held():  # closed: released on purpose (a thread outliving close() ends here)
            return
        root = self._local.root
        logger.error("%s lost its %s while this job ran (was the directory deleted?): the checkpoints saved there "
                     "before are gone; locking it again so that no other job writes there", root, LOCK_FILE)
        lost, self._lock = self._lock, DirectoryLock.acquire(
            root, run_name=self.config.run_name, job=job_id(),
            under_guard=lambda: claim_directory(root, self.config.run_name, committed=self._local.committed,
                                                shared_uid=self.identity.uid))
        lost.release()

    def _hash_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.hash_threads, thread_name_prefix=f"ckpt-hash-r{self.rank}")
            return self._pool

    # -- reading -------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Committed steps of this run in local_dir, newest first. A step with a damaged COMMIT
        is skipped; so is one committed by another run (logged once, naming both runs)."""
        return self._local.committed_steps()

    def latest(self) -> int | None:
        """The newest committed step in local_dir, or None if there is none."""
        steps = self.committed_steps()
        return steps[0] if steps else None

    def has_rank(self, step: int, rank: int) -> bool:
        """Whether `step` is committed here and this local_dir holds rank `rank` of it."""
        try:
            marker = self._local.read_commit(step)
        except CheckpointError:
            return False
        return marker is not None and rank < marker.world_size and self._local.layout.rank_dir(step, rank).is_dir()

    def saved_world_size(self, step: int) -> int:
        """The world size that wrote committed `step`."""
        return self._local.require_commit(step).world_size

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
        return self._local.load(step, rank, pool=self._hash_pool())

    # -- a sharded step's parts between the ranks of a group (ckpt/peer_parts.py, trainer/part_transfer.py) --

    def parts_held(self) -> dict[int, tuple[int, list[int]]]:
        """step -> (its saving world size, the ranks whose parts this node's tiers 0 and 1 hold)."""
        return peer_parts.parts_held(self._node_tiers())

    def open_part(self, step: int, rank: int) -> AbstractContextManager[peer_parts.Part]:
        """Rank `rank`'s part of `step` from this node's tier 0, else tier 1 (CheckpointNotFoundError: none)."""
        return peer_parts.open_part(self._node_tiers(), step, rank)

    def keep_part(self, step: int, rank: int, *, manifest: bytes, size: int,
                  fill: Callable[[memoryview], None]) -> Path:
        """Keep another node's part of `step` in tier 0 as a replica (ckpt/replica.py's checks). Needs a tier 0."""
        root = self.config.tier0_root
        if root is None:
            raise CheckpointNotFoundError("no tier 0 to keep another rank's part in")
        return peer_parts.keep_part(Path(root), receiver=self.rank, step=step, rank=rank, manifest=manifest,
                                    size=size, fill=fill)

    def _node_tiers(self) -> list[Tier]:
        return [t for t in (self._host, self._local) if t is not None]

    def available_steps(self) -> list[int]:
        """Steps committed in either tier, newest first (the shared tier only if reachable)."""
        return self._restorer.available_steps()

    def restore(
        self,
        *,
        step: int | None = None,
        max_step: int | None = None,
        replicated: bool = True,
        into: Mapping[str, Any] | None = None,
        detach: bool = True,
        if_unsure: Literal["raise", "none"] = "raise",
    ) -> Restored | None:
        """Load the newest checkpoint this rank can read completely and intact; None if none.

        Candidates are the steps committed in either tier (only `step` if given; none above
        `max_step`), newest first. For each, this rank's part (or rank 0's, for a rank the
        saving world did not have, when `replicated`) is loaded from the local tier, else the
        shared one. A damaged copy is logged with the file's name and the next copy or older
        step is tried. CheckpointVersionError (written by a newer version) is raised. The
        policy in full: ckpt/restore.py.

        Sharded states (DTensor leaves, ckpt/sharding.py) are resharded on load (ckpt/reshard.py):
        each such leaf comes back as a new DTensor laid out like the DTensor at the same key path
        of `into` (e.g. the state of the current model), or as the whole tensor when `into` has
        none there. ShardMismatchError (another global shape) is raised, not skipped.

        `detach`=False: a state restored from tier 0 is not copied out of the slot (1.2 GB: 0.3-0.5 s of a
        restore on one H200, seconds on a small host): its plain tensors are read-only views of the node's
        shared memory, valid until this rank's second save after the restore rewrites that slot. For a caller
        that copies the state into its model and optimizer at once and keeps nothing else (`trainer` does,
        and then gives the optimizer's CPU tensors memory of their own).

        SharedStorageError when none is restored because the shared tier could not be listed (and this node holds
        no step) or a step could not be downloaded, CheckpointAccessError when this process may not read a newer
        step's files (permissions): starting over, or from an older step, would throw that progress away (the
        first save removes the newer steps). `if_unsure="none"` returns None instead and leaves the error in
        `restore_blocked` (`trainer` first asks its peers for their state, and raises if none has any).
        """
        self._check_open()
        for what, value in (("step", step), ("max_step", max_step)):  # a "5" or a -1 restored nothing: a fresh start
            if value is not None:
                _check_index(what, value, minimum=0)
        restored = self._restorer.restore(step=step, max_step=max_step, replicated=replicated, into=into,
                                          detach=detach)
        if restored is None and self._restorer.blocked is not None and if_unsure == "raise":
            raise self._restorer.blocked
        return restored

    @property
    def restore_blocked(self) -> CheckpointError | None:
        """Why the last `restore(if_unsure="none")` returned None without knowing that no newer step exists."""
        return self._restorer.blocked

    # -- lifecycle -----------------------------------------------------------------------

    def close(self, timeout: timedelta = timedelta(minutes=2), *, world_over: bool = False,
              uploads: timedelta | None = None) -> bool:
        """Finish the save in flight and pending uploads (up to `timeout`), then stop and join
        every thread and free the staging buffer. Returns False if work was left unfinished
        (logged; committed checkpoints are unaffected). Idempotent.

        `uploads`: how long the pending uploads may take once the local writes are done, in place of
        what is left of `timeout` (Resumable.close gives them the shared tier's `retry.deadline`).

        `world_over`: this rank leaves the world it saved for (an in-place re-formation); tier 2 then
        does not wait for other ranks' uploads (see `Replicator.close`)."""
        if self._closed:
            return True
        self._closed = True
        deadline = Deadline.after(timeout)
        finished = self._writer.tier0_thread.close(timeout.total_seconds())
        finished = self._writer.thread.close(timeout.total_seconds()) and finished
        if self._replicator is not None:
            wait = deadline.remaining() if uploads is None else uploads.total_seconds()
            finished = self._replicator.close(wait, world_over=world_over) and finished
        self._stop.set()
        if self._shared is not None and self._shared.helper is not None:
            self._shared.helper.interrupt()  # an upload still waiting on the helper ends (the replicator gave up)
        if self._owner is not None:
            self._owner.close()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        if finished:
            self._staging.release()
            if self._writer.tier0 is not None:
                self._writer.tier0.close()  # unmapped; the snapshots stay in the node's memory
            for helper in self._writer.helpers:
                helper.close()
        with self._retention_lock:  # not while a late commit's retention takes the lock again
            self._lock.release()
        return finished

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this Checkpointer (rank {self.rank}, {self.config.local_dir}) is closed: make a new "
                               "one (or a new Resumable) to save or restore again")


def _check_index(what: str, value: object, *, minimum: int) -> None:
    # At most int64's largest: the manifests and COMMITs hold their step as one (a larger step was "saved", then
    # never committed nor restored).
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT64_MAX:
        raise ValueError(f"{what} must be an int from {minimum} to {INT64_MAX}, got {value!r}")


def _check_generation(generation: object) -> None:
    if not isinstance(generation, str):
        raise ValueError(f"generation must be a str, got {generation!r}")
