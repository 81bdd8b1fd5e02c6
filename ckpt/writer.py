"""The save pipeline: from save_async() to a tier-0 snapshot, a committed step, and the hand-off to tier 2.

    LocalWriter.save_async(step, state, persist=)  caller's thread
      flatten -> staging layout -> StagingArea.stage()   copy into a tier-0 slot (ckpt/tier0.py), else
                                                         into the host buffer (ckpt/snapshot.py)
      BackgroundWriter.submit(_persist)                  returns a PendingSave
    LocalWriter._persist                          writer thread (tier-0 thread for a snapshot only)
      HostSnapshot.run_deferred_copies / require_consistent   ("overlapped" mode)
      tier 0: sum64 checksum, the slot's manifest    -> the slot is the rank's newest snapshot (done by the
                                                         node's helper process when there is one: ckpt/helper.py)
      persist_rank()            rank directory written (from the slot), fsynced, renamed (ckpt/persist.py)
      commit_if_complete()      the last rank of this directory writes COMMIT  -> event ckpt_saved
      Replicator.enqueue()      with a shared tier (ckpt/replicator.py); else local retention

At most one persist is in flight: a persisted save that finds the previous one still persisting waits
or is skipped (CheckpointConfig.if_busy). A snapshot for tier 0 only (persist=False) never waits: with
its thread or both slots busy it is skipped. A failure is logged ("checkpoint of step N failed", event
`ckpt_failed`), counted (ckpt/save_policy.py) and raised by PendingSave.wait_persisted().
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckpt.background import BackgroundWriter
from ckpt.checksum import CHUNK_BYTES, RANGE_CHUNK_BYTES, Checksum
from ckpt.config import CheckpointConfig
from ckpt.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    SharedStorageError,
)
from ckpt.format import dumps
from ckpt.helper import HelperClient, HelperError
from ckpt.identity import RunIdentity
from ckpt.layout import MANIFEST_FILE, STATE_FILE, Layout
from ckpt.manifest import FileEntry, Manifest, TensorEntry
from ckpt.metrics import MetricsLog, SaveMetrics
from ckpt.persist import WrittenRank, commit_if_complete, persist_rank
from ckpt.replicator import Replicator, UploadJob
from ckpt.safetensors_io import dtype_name
from ckpt.save_policy import SaveFailures
from ckpt.sharding import ShardInfo, split_sharded
from ckpt.snapshot import HostSnapshot, StagingArea, StagingLayout, StateMark
from ckpt.tier0 import HostMemoryError, HostSlot, HostSlots, SlotLock, snapshot_manifest
from ckpt.tree import Flat, flatten
from core.deadline import Deadline
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
        self._in_tier0 = threading.Event()
        """Set once the save's tier-0 slot is published, or the save gave up on tier 0 (or never had a slot)."""
        self.error: CheckpointError | None = None
        """Why tier 1 failed (None while it runs or after it succeeded)."""
        self.upload: UploadJob | None = None
        self.created = time.monotonic()  # once staged (overlapped: its copies launched or deferred)
        if snapshot is None:  # skipped
            self._staged.set()
            self._persisted.set()
            self._in_tier0.set()

    @property
    def in_tier0(self) -> bool:
        """Whether this save's tier-0 snapshot is published (or given up)."""
        return self._in_tier0.is_set()

    def wait_in_tier0(self, timeout: float) -> bool:
        """Block until this save's tier-0 snapshot is published (or given up); False at the deadline."""
        return self._in_tier0.wait(timeout)

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
        tier0: HostSlots | None = None,
        helper: HelperClient | None = None,
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
        self.tier0 = tier0
        self.helper = helper
        """The node's checkpoint helper, as the writer thread's connection (ckpt/helper.py)."""
        self.snapshot_helper: HelperClient | None = None
        """The tier-0 thread's own connection: a snapshot is not held up by a tier-1 write in flight."""
        self._helper_template: tuple[dict[str, TensorEntry], dict[str, ShardInfo], bytes, int] | None = None
        self.tier0_thread = BackgroundWriter(f"ckpt-tier0-r{rank}")
        """Finishes snapshots that go to tier 0 only (a persist in flight does not hold them up)."""
        self.saved: set[int] = set()
        """Steps this rank saved (ckpt/retention.py: abandoned steps)."""
        self.last: PendingSave | None = None
        """The newest save or snapshot (wait_staged)."""
        self._entries_cache: tuple[StagingLayout, bool, dict[str, TensorEntry]] | None = None
        self.last_persist: PendingSave | None = None
        """The newest save that goes to tier 1 (wait_persisted)."""
        self.last_tier0: PendingSave | None = None
        """The newest save or snapshot with a tier-0 slot (Checkpointer.wait_snapshot)."""
        self._metrics = metrics
        self._failures = failures
        self._pool = pool
        self._replicator = replicator
        self._check = check
        self._after_commit = after_commit

    def save_async(self, step: int, state: Mapping[str, Any] | Flat, *, persist: bool = True,
                   at: StateMark | None = None) -> PendingSave:
        """See Checkpointer.save_async (persist=False: Checkpointer.snapshot)."""
        started = time.monotonic()
        if not isinstance(state, (Mapping, Flat)):
            raise TypeError(f"state must be a Mapping, got {type(state).__name__}")
        self._check()
        flat, skeleton = (state.tensors, state.skeleton) if isinstance(state, Flat) else flatten(state)
        tensors, shards = split_sharded(flat)  # a DTensor leaf: this rank's piece, if it writes one
        layout = self.staging.layout_for(tensors)
        replicated = self._replicator.last_replicated if self._replicator else None
        metrics = SaveMetrics(
            step=step,
            rank=self.rank,
            bytes=layout.file_bytes,
            upload_lag_steps=None if replicated is None else step - replicated,
        )
        why = self._why_not_now(persist)
        slot = None
        if why is None and self.tier0 is not None:
            slot = self.tier0.claim(step)
            if slot is None:
                why = f"both tier-0 slots of rank {self.rank} are in use (the newest snapshot and one being read)"
        if why is not None:
            self._metrics.add(metrics)
            self._metrics.update(metrics, log=persist, status="skipped", error=why, stall_s=time.monotonic() - started)
            return PendingSave(step, metrics, None)
        self._metrics.add(metrics)
        overlapped = self.config.mode == "overlapped"
        stage_timeout = self.config.stage_timeout.total_seconds()
        try:
            into = None
            if slot is not None:
                into = self._slot_buffer(slot, layout, tensors)
                if into is None:  # tier 0 did not fit and was given up: the host buffer, as without it
                    slot = None
                    if not persist:
                        self._metrics.update(metrics, status="skipped", error="tier 0 does not fit (logged)")
                        return PendingSave(step, metrics, None)
            image = slot is not None and self.config.device_image
            image_chunk = (RANGE_CHUNK_BYTES if shards else CHUNK_BYTES) if image else None
            snapshot = self.staging.stage(tensors, layout, overlapped=overlapped, timeout=stage_timeout, into=into,
                                          at=at, image_chunk=image_chunk)
        except BaseException as exc:
            if slot is not None and self.tier0 is not None:
                self.tier0.release(slot)  # else a failed copy (a tensor resized in place) kept it from every later save
            known = exc if isinstance(exc, CheckpointError) else None
            error = str(exc) if known else f"{type(exc).__name__}: {exc}"
            self._metrics.update(metrics, log=True, status="failed", error=error)
            if known is not None:
                self._failures.failed(known)
            raise  # the caller reports it (trainer: "checkpoint of step N failed", ckpt_failed)
        self.saved.add(step)
        pending = PendingSave(step, metrics, snapshot)
        if not overlapped:
            pending._staged.set()
        entries = self._entries(layout, with_offsets=bool(shards) or slot is not None)
        self._metrics.update(metrics, stall_s=time.monotonic() - started, status="persisting" if persist else "staging")
        self.last = pending
        if persist:
            self.last_persist = pending
        if slot is not None:
            self.last_tier0 = pending
        thread = self.thread if persist else self.tier0_thread
        remap = slot is not None and self.tier0 is not None and any(
            s._size != layout.file_bytes for s in self.tier0.slots)
        pin = remap and self.staging.needs_pin(tensors)

        # The layout changed (an optimizer's state appears at its first step, after prepare() mapped the slots
        # for the model alone): the other slot is mapped now, in this one save's stall, not in a later step's
        # (1.2 GB reserved, mapped and pinned: ~0.3-0.5 s on one H200; cudaHostRegister holds up the training
        # thread's kernel launches even from another thread: a 0.33 s step in the loop). One that holds the
        # newest snapshot is mapped once this save has replaced it.
        if remap:
            self._map_free_slots(layout, pin)
        then = (lambda: self._map_free_slots(layout, pin)) if remap else None
        thread.submit(lambda: self._persist(pending, snapshot, entries, skeleton, shards, slot=slot, persist=persist,
                                            then=then))
        return pending

    def _map_free_slots(self, layout: StagingLayout, pin: bool) -> None:
        """Map (and pin) the free slots not yet mapped for `layout`, and have the helper map them too."""
        tier0 = self.tier0
        mapped: list[tuple[Path, int]] = []
        for _ in range(len(tier0.slots) if tier0 is not None else 0):  # bounded: a pin that fails leaves it unpinned
            slot = tier0.claim_unmapped(layout.file_bytes, pin) if tier0 is not None else None
            if tier0 is None or slot is None:
                break
            try:
                slot.buffer(layout.prefix, layout.data_bytes, pin=pin, room=tier0.room_needed(layout.file_bytes))
                mapped.append((slot.path, len(slot.view())))
            except Exception as exc:  # noqa: BLE001 - the next save that takes this slot maps it (and reports)
                logger.warning("could not map tier-0 slot %s ahead of use: %s", slot.path, exc)
                break
            finally:
                tier0.release(slot)
        if mapped and self.helper is not None and self.helper.available():
            # A connection of its own, on a thread of its own: the writer's and the tier-0 thread's connections
            # each have one user, and the helper's first read of 1.2 GB takes ~0.4 s.
            own = HelperClient(self.helper.path.parent)

            def map_in_helper() -> None:
                try:
                    for path, size in mapped:
                        own.map(path, size)
                finally:
                    own.close()

            threading.Thread(target=map_in_helper, daemon=True, name=f"ckpt-map-r{self.rank}").start()

    def _entries(self, layout: StagingLayout, *, with_offsets: bool) -> dict[str, TensorEntry]:
        """The manifest's tensor entries of `layout`, made once per layout (hundreds per save)."""
        cached = self._entries_cache
        if cached is None or cached[0] is not layout or cached[1] != with_offsets:
            cached = self._entries_cache = (layout, with_offsets, _tensor_entries(layout, with_offsets=with_offsets))
        return cached[2]

    def _why_not_now(self, persist: bool) -> str | None:
        """Why this save is skipped (None: go ahead), after any wait if_busy allows a persisted save."""
        if not persist:
            if self.tier0 is None:
                return "no tier 0 (CheckpointConfig.tier0_dir): a snapshot needs host shared memory"
            if self.tier0_thread.busy():
                return f"the snapshot of step {self.last.step if self.last else '?'} is still being checksummed"
            return None
        why = None
        if self.thread.busy():
            why = self._busy_reason()
            self._check()  # the save just waited for may have been the last one allowed to fail
        if why is None and not self.tier0_thread.wait_idle(self.config.busy_timeout.total_seconds()):
            why = f"the tier-0 snapshot in flight did not finish within busy_timeout {self.config.busy_timeout}"
        return why

    def _busy_reason(self) -> str | None:
        """Wait for the save in flight (if_busy="wait"); why this save is skipped, or None."""
        previous = self.last_persist.step if self.last_persist else "?"
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
        if self.tier0 is not None:
            layout = self.staging.layout_for(tensors)
            # Map (and reserve) both slots now, not in the loop; the helper maps them too, on the writer thread
            # (its connection's one user), not holding up a restore.
            if all(self._slot_buffer(slot, layout, tensors) is not None for slot in list(self.tier0.slots)):
                helper = self.helper
                if helper is not None and helper.available() and self.tier0 is not None:
                    slots = [(slot.path, len(slot.view())) for slot in self.tier0.slots]

                    def map_slots() -> None:
                        for path, size in slots:
                            helper.map(path, size)

                    self.thread.submit(map_slots)
                return len(self.tier0.slots) * layout.data_bytes
        return self.staging.reserve(tensors).data_bytes

    def _slot_buffer(self, slot: HostSlot, layout: StagingLayout, tensors: Mapping[str, Any]) -> Any:
        """The slot's data region for `layout`. When tier 0 does not fit: HostMemoryError if it was asked
        for (CheckpointConfig.tier0_dir); if it only came from elastic-run's $ELASTIC_TIER0_DIR, a warning,
        and tier 0 is given up (None): saves go to disk as without it (a container's 64 MiB /dev/shm)."""
        tier0 = self.tier0
        assert tier0 is not None
        try:
            return slot.buffer(layout.prefix, layout.data_bytes, pin=self.staging.needs_pin(tensors),
                               room=tier0.room_needed(layout.file_bytes))
        except HostMemoryError as exc:
            tier0.release(slot)
            if self.config.tier0_dir is not None:
                raise
            logger.warning("%s. Going on without tier 0 on rank %d: every checkpoint comes from disk", exc, self.rank)
            emit("ckpt_failed", step=-1, tier="memory", error=str(exc))
            tier0.close()
            self.tier0 = None
            return None

    def _persist(
        self,
        pending: PendingSave,
        snapshot: HostSnapshot,
        entries: dict[str, TensorEntry],
        skeleton: Any,
        shards: dict[str, ShardInfo],
        *,
        slot: HostSlot | None,
        persist: bool,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Finish the save (tier 0, tier 1, the upload's start); `then` runs before it counts as persisted."""
        metrics = pending.metrics
        try:
            snapshot.run_deferred_copies()
            snapshot.require_consistent(self.config.stage_timeout.total_seconds(), f"step {pending.step}")
            metrics.copy_s = time.monotonic() - pending.created
            pending._staged.set()
            in_tier0 = False
            if slot is not None:
                in_tier0 = self._publish_snapshot(pending, slot, entries, skeleton, shards, final=not persist,
                                                  checksum=snapshot.checksum())
            pending._in_tier0.set()
            if slot is not None and not persist:
                return
            started = time.monotonic()
            done = self._persist_by_helper(pending.step, slot, entries, skeleton, shards) if in_tier0 else None
            if done is not None:
                written, committed = done
            else:
                hook = self.on_written
                written = persist_rank(
                    self.layout,
                    step=pending.step,
                    rank=self.rank,
                    world_size=self.world_size,
                    generation=self.generation,
                    # A tier-0 slot is the file's whole image, page-aligned: its blocks go around the page
                    # cache (ckpt/direct_io.py), as the helper writes them.
                    parts=[slot.view()] if slot is not None else snapshot.parts(),
                    tensors=entries,
                    skeleton=skeleton,
                    checksum=self.config.checksum,
                    chunk_bytes=RANGE_CHUNK_BYTES if shards else CHUNK_BYTES,
                    shards=shards,
                    pool=self._pool(),
                    before_publish=None if hook is None else lambda: hook(pending.step),
                    identity=self.identity,
                    release=None if slot is None else lambda: self._release(slot),
                )
                committed = commit_if_complete(
                    self.layout,
                    step=pending.step,
                    world_size=self.world_size,
                    local_world_size=self.local_world_size,
                    generation=self.generation,
                    identity=self.identity,
                ) is not None
            self._failures.succeeded()
            tier1_s = time.monotonic() - started
            if committed:
                logger.info("committed step %d in %s", pending.step, self.layout.step_dir(pending.step))
                emit("ckpt_saved", step=pending.step, tier="local", seconds=round(tier1_s, 3))
            if self._replicator is not None:
                self._metrics.update(metrics, tier1_s=tier1_s, status="uploading")
                pending.upload = self._enqueue_upload(pending.step, written, metrics)
            else:
                self._metrics.update(metrics, log=True, tier1_s=tier1_s, status="persisted")
                if committed:
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
            if slot is not None:
                self._release(slot)
            pending._staged.set()
            pending._in_tier0.set()
            if then is not None:
                then()
            pending._persisted.set()

    def _replicas(self, step: int) -> int:
        """How many peer nodes get this step's snapshot (CheckpointConfig.replicas, replica_every)."""
        return self.config.replicas if step % self.config.replica_every == 0 else 0

    def _publish_snapshot(self, pending: PendingSave, slot: HostSlot, entries: dict[str, TensorEntry],
                          skeleton: Any, shards: dict[str, ShardInfo], *, final: bool,
                          checksum: Checksum | None = None) -> bool:
        """Checksum the slot and write its manifest: it becomes this rank's newest tier-0 snapshot. The
        node's helper process does it when there is one (ckpt/helper.py), else this thread. `checksum`: the
        slot's, summed on the GPU (ckpt/device_image.py), so nobody reads the slot back for it. False: the
        snapshot is not in tier 0 (a helper that did not answer still holds the slot)."""
        assert self.tier0 is not None
        started = time.monotonic()
        run, run_uid = self._run_ids()
        chunk_bytes = RANGE_CHUNK_BYTES if shards else CHUNK_BYTES
        helper = self.snapshot_helper if final else self.helper
        try:
            if helper is None or not helper.available():
                raise HelperError("no helper")
            key, template = self._template(entries, shards, chunk_bytes)
            held = helper.publish(template_key=key, template=template, path=slot.path, size=len(slot.view()),
                           step=pending.step, rank=self.rank, world_size=self.world_size,
                           generation=self.generation, run=run, run_uid=run_uid, chunk_bytes=chunk_bytes,
                           state_json=dumps(skeleton), replicate=self._replicas(pending.step), checksum=checksum)
        except HelperError:
            # Only a helper can hold the slot's lock: without one, no open and flock on every snapshot.
            with SlotLock(slot.data_path, wait=False) if helper is not None else nullcontext(True) as free:
                if not free:  # the helper is still at it: leave the slot to it (ckpt/tier0.py, SlotLock)
                    self.tier0.hold(slot)
                    why = f"the node's checkpoint helper still holds tier-0 slot {slot.path}"
                    if final:
                        self._metrics.update(pending.metrics, status="skipped", error=why)
                    return False
                manifest = snapshot_manifest(slot.view(), step=pending.step, rank=self.rank,
                                             world_size=self.world_size, generation=self.generation, run=run,
                                             run_uid=run_uid, chunk_bytes=chunk_bytes, tensors=entries,
                                             shards=shards, skeleton=skeleton, pool=self._pool(), checksum=checksum)
                self.tier0.published(slot, pending.step, manifest)
        else:
            self.tier0.published(slot, pending.step, None)  # the helper wrote the manifest
            if held:  # the helper copies it for a peer replica: not reused before its lock is free
                self.tier0.hold(slot)
        if final:
            self._metrics.update(pending.metrics, tier0_s=time.monotonic() - started, status="snapshot")
        else:
            self._metrics.update(pending.metrics, tier0_s=time.monotonic() - started)
        return True

    def _run_ids(self) -> tuple[str, str]:
        """(run name, run uid) as manifests record them ("" before the run identity is claimed)."""
        return (self.identity.name, self.identity.uid) if self.identity else ("", "")

    @property
    def helpers(self) -> list[HelperClient]:
        return [h for h in (self.helper, self.snapshot_helper) if h is not None]

    def _persist_by_helper(self, step: int, slot: HostSlot | None, entries: dict[str, TensorEntry], skeleton: Any,
                           shards: dict[str, ShardInfo]) -> tuple[WrittenRank, bool] | None:
        """Have the node's helper write tier 1 from the tier-0 slot: (the rank directory, committed), or
        None when this thread should write it (no helper, it failed, or a fault-injection hook wants to run
        between the files and their publication, which only this process can do).
        Raises CheckpointWriteError when the helper that gave no answer may still be writing."""
        helper = self.helper
        if helper is None or slot is None or self.on_written is not None or not helper.available():
            return None
        run, run_uid = self._run_ids()
        chunk_bytes = RANGE_CHUNK_BYTES if shards else CHUNK_BYTES
        key, template = self._template(entries, shards, chunk_bytes)
        released = threading.Event()

        def on_released() -> None:
            released.set()
            self._release(slot)

        try:
            reply = helper.persist(template_key=key, template=template, path=slot.path, size=len(slot.view()),
                                   step=step, rank=self.rank, world_size=self.world_size,
                                   local_world_size=self.local_world_size, generation=self.generation, run=run,
                                   run_uid=run_uid, root=self.layout.root, checksum=self.config.checksum,
                                   chunk_bytes=chunk_bytes, state_json=dumps(skeleton), on_released=on_released)
        except HelperError as exc:
            if released.is_set():  # the slot may hold a newer snapshot by now: the step cannot be written again
                raise CheckpointWriteError(
                    f"the node's checkpoint helper did not finish writing step {step} ({exc}); this save is "
                    f"counted as failed, the next one goes on") from exc
            with SlotLock(slot.data_path, wait=False) as free:
                if not free:
                    assert self.tier0 is not None
                    self.tier0.hold(slot)
                    raise CheckpointWriteError(
                        f"the node's checkpoint helper did not finish step {step} in time and still writes it "
                        f"({exc}); this save is counted as failed, the next one goes on") from exc
            return None
        try:
            return WrittenRank(Path(reply["path"]), int(reply["nbytes"]), str(reply["manifest_sha256"])), \
                bool(reply["committed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointWriteError(f"the node's checkpoint helper's reply to the write of step {step} lacks "
                                       f"{exc} ({str(reply)[:200]}); this save is counted as failed") from exc

    def _template(self, entries: dict[str, TensorEntry], shards: dict[str, ShardInfo],
                  chunk_bytes: int) -> tuple[int, bytes]:
        """The helper's template of this layout (its tensors and shards), made once per layout."""
        cached = self._helper_template
        if cached is None or cached[0] is not entries or cached[1] != shards:
            placeholder = FileEntry.of(Checksum("sum64", chunk_bytes, "0" * 64), 0)
            template = Manifest(step=0, rank=0, world_size=1, files={STATE_FILE: placeholder}, tensors=entries,
                                shards=shards, state=None).to_bytes()
            cached = self._helper_template = (entries, dict(shards), template, id(template))
        return cached[3], cached[2]

    def _release(self, slot: HostSlot) -> None:
        assert self.tier0 is not None
        self.tier0.release(slot)

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
