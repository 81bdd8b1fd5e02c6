"""Tier 0: each rank's newest snapshots in the node's host shared memory, two slots per rank (or more).

    <tier0 dir>/rank_00003/slot_0/state.safetensors   the file image; mapped shared, it IS the staging buffer
    <tier0 dir>/rank_00003/slot_0/manifest.json       written last: the slot's commit (removed before a rewrite)
    <tier0 dir>/rank_00003/slot_1/...

The directory lies in tmpfs and belongs to the node (elastic-run's agent makes it, core/tier0_dir.py),
so a snapshot outlives the worker that wrote it: the worker's replacement restores from memory, with no
disk read, and maps the same slots again as its staging buffers, with no new allocation.

Writing (`HostSlots`, the worker side): a save copies the state straight into a slot's mapped file, laid
out as the safetensors file of tier 1 (ckpt/snapshot.py plans it). The slot's manifest (the tier-1
format, ckpt/manifest.py) is removed before the copy starts and written, by rename, once the copy is
consistent and checksummed; so a crash mid-copy leaves that slot without a manifest, and the other slot,
the previous snapshot, whole. A save never writes the newest slot, nor one whose bytes a background job
still reads (a tier-1 persist writes its file from the slot, ckpt/persist.py); with no slot free a
snapshot is skipped, never waited for. A slot whose step is not below the step being saved is a future
this run went back from (a restore of an older step) and is dropped first.

Reading (`HostTier`, the `Tier` interface of ckpt/tiers.py): the steps whose manifests this node holds for
every one of its ranks (as tier 1's COMMIT counts them), as COMMIT markers made from them, for the restore
policy (ckpt/restore.py), which tries tier 0 first.
Every file is verified as tier 1's are; the checksum is `sum64` (ckpt/checksum.py), fast enough for
every step. A slot of another run (identity), a torn one (no manifest) or a damaged one (checksum) is
never used. A restore copies the tensors out of the slot (`detach`): the slot is rewritten later.

Memory: 2 x the rank's state bytes (page-locked for CUDA state), reserved with fallocate at the first
save so that a full tmpfs is a clear error then (HostMemoryError), never a SIGBUS later. With
CheckpointConfig.tier0_slots = 3 snapshots go on while a tier-1 write reads a slot, at 3 x the bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.checksum import Checksum, chunk_count, digest_parts
from ckpt.commit import CommitMarker
from ckpt.durable import write_atomic
from ckpt.errors import CheckpointError, CheckpointWriteError
from ckpt.identity import RunIdentity
from ckpt.layout import MANIFEST_FILE, STATE_FILE, list_dir, parse_rank_dir_name, rank_dir_name
from ckpt.manifest import FileEntry, Manifest, TensorEntry, parse_manifest, resolve_file
from ckpt.ranges import LocalRange
from ckpt.reader import read_manifest
from ckpt.safe_io import open_own_file, read_regular
from ckpt.sharding import ShardInfo
from ckpt.snapshot import host_register, host_unregister
from ckpt.tiers import TierName
from core import premap
from core.numbers import decimal

logger = logging.getLogger(__name__)

SLOTS = 2
"""Slots per rank unless CheckpointConfig.tier0_slots says more; also the replicas kept per peer rank."""

PEERS_DIR = "peers"
"""In the tier-0 directory: the replicas this node holds for other nodes (ckpt/replica.py)."""


class HostMemoryError(CheckpointWriteError):
    """Tier 0 does not fit in the node's host shared memory."""


def slot_dir(root: Path, rank: int, index: int) -> Path:
    return root / rank_dir_name(rank) / f"slot_{index}"


class HostSlot:
    """One slot: a file in tmpfs, mapped shared, sized to the file image of one snapshot."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.step: int | None = None
        """The step whose manifest this slot holds (None: none, or being rewritten)."""
        self._map: mmap.mmap | None = None
        self._size = 0
        self._pinned = False

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_FILE

    @property
    def data_path(self) -> Path:
        return self.path / STATE_FILE

    def invalidate(self) -> None:
        """Remove the manifest: from now on readers see no snapshot here."""
        self.step = None
        try:
            self.manifest_path.unlink(missing_ok=True)
        except NotADirectoryError:  # a file in place of the slot's directory (left it stuck busy): made anew
            self.close()
            self.path.unlink()

    def buffer(self, prefix: bytes, data_bytes: int, *, pin: bool, room: int) -> torch.Tensor:
        """The slot's data region (uint8) for a file of `prefix` + `data_bytes`, its header written.

        Maps the file again only when the size changes. `room`: bytes tmpfs must still have for
        the other slots this process is about to fill (for the message of HostMemoryError)."""
        size = len(prefix) + data_bytes
        if self._map is None or size != self._size or (pin and not self._pinned):
            self._remap(size, pin=pin, room=room)
        assert self._map is not None
        self._map[: len(prefix)] = prefix
        return torch.frombuffer(self._map, dtype=torch.uint8)[len(prefix) : size]

    def _remap(self, size: int, *, pin: bool, room: int) -> None:
        self.close()
        self.path.mkdir(parents=True, exist_ok=True)
        fd = open_own_file(self.data_path)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS later
            except OSError as exc:
                raise _no_room(self.path.parent.parent, size, room, exc) from exc
            adopted = premap.take(self.data_path, os.fstat(fd).st_ino, size)
            if adopted is not None:  # mapped (and page-locked) by this process while it was a warm spare
                self._map, self._pinned = adopted
            else:
                self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._size = size
        if pin and not self._pinned:
            self._pinned = host_register(_address(self._map), size)

    def view(self) -> memoryview:
        """The whole file image (valid while mapped)."""
        assert self._map is not None
        return memoryview(self._map)[: self._size]

    def publish(self, step: int, manifest: bytes | None) -> None:
        """`manifest` None: the node's helper wrote it (ckpt/helper.py)."""
        if manifest is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.manifest_path, manifest)
        self.step = step

    def close(self) -> None:
        if self._map is not None:
            if self._pinned:
                host_unregister(_address(self._map))
            try:
                self._map.close()
            except BufferError:  # a view is still alive (a tensor of a finished save): the GC unmaps it
                logger.debug("tier-0 slot %s still viewed at close", self.path)
        self._map, self._size, self._pinned = None, 0, False


def _pin(mapping: mmap.mmap, size: int) -> bool:
    return host_register(_address(mapping), size)


def _unpin(mapping: mmap.mmap) -> None:
    host_unregister(_address(mapping))


# Where a warm spare finds the slot files it maps ahead for the worker it becomes (core/premap.py).
premap.configure(f"rank_*/slot_*/{STATE_FILE}", _pin, _unpin)


def snapshot_manifest(
    image: memoryview,
    *,
    step: int,
    rank: int,
    world_size: int,
    generation: str,
    run: str,
    run_uid: str,
    chunk_bytes: int,
    tensors: dict[str, TensorEntry],
    shards: dict[str, ShardInfo],
    skeleton: Any,
    pool: Executor | None,
    checksum: Checksum | None = None,
) -> bytes:
    """The manifest of a slot whose file image is `image`: its sum64 checksum (`checksum` when the GPU summed
    it, ckpt/device_image.py), the tensors, the skeleton. Made by the worker's writer, or by the node's helper
    process (ckpt/helper.py)."""
    if checksum is None:
        checksum = digest_parts([image], algorithm="sum64", chunk_bytes=chunk_bytes, pool=pool)
    elif checksum.algorithm != "sum64" or checksum.chunk_bytes != chunk_bytes or (
            len(checksum.chunks) != 8 * chunk_count(len(image), chunk_bytes)):
        raise ValueError(f"a {checksum.describe()} of {len(checksum.chunks) // 8} chunks does not fit a "
                         f"{len(image)}-byte slot in {chunk_bytes}-byte sum64 chunks")
    return Manifest(
        step=step,
        rank=rank,
        world_size=world_size,
        generation=generation,
        run=run,
        run_uid=run_uid,
        files={STATE_FILE: FileEntry.of(checksum, len(image), checksum.chunks if shards else b"")},
        tensors=tensors,
        shards=shards,
        state=skeleton,
    ).to_bytes()


class SlotLock:
    """The slot's lock (flock of its data file), held by the node's helper while it publishes the slot or
    writes it to tier 1 (ckpt/helper_process.py). A worker that gave up on the helper takes it before it
    publishes or reuses the slot itself: a helper that still holds it could write a manifest over bytes
    the worker already replaced. `with SlotLock(path, wait=False) as taken:` (taken: whether it was got;
    `wait`=False: without waiting); `release()` lets it go early (a tier-1 write done reading the slot)."""

    def __init__(self, data_path: Path, *, wait: bool) -> None:
        self._fd: int | None = None
        self.taken = True
        try:
            self._fd = os.open(data_path, os.O_RDONLY)
        except FileNotFoundError:
            return  # no slot file: nothing to protect
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            self.taken = False
            self.release()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the lock

    def __enter__(self) -> bool:
        return self.taken

    def __exit__(self, *_: object) -> None:
        self.release()


def _address(mapping: mmap.mmap) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()


def _no_room(root: Path, size: int, room: int, exc: OSError) -> HostMemoryError:
    try:
        st = os.statvfs(root)
        free = f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB free of {st.f_blocks * st.f_frsize / 2**30:.2f} GiB"
    except OSError:
        free = "free space unknown"
    return HostMemoryError(
        f"tier 0 does not fit in {root} ({free}): a slot of {size / 2**30:.2f} GiB could not be reserved "
        f"({os.strerror(exc.errno or 0)}), and this node needs {room / 2**30:.2f} GiB more for the rest of its "
        f"slots (tier0_slots per rank). Give /dev/shm more room (docker run --shm-size, a larger tmpfs), run fewer "
        f"ranks per node, use fewer tier0_slots (2 at least), or turn tier 0 off with tier0_dir=\"\" (every save "
        f"then goes to disk)",
        path=root,
    )


class HostSlots:
    """The tier-0 slots of one rank (`count`, at least 2), on the writing side (see the module docstring)."""

    def __init__(self, root: Path, rank: int, identity: RunIdentity | None, count: int = SLOTS) -> None:
        self.root = root
        self.rank = rank
        self.identity = identity
        self.slots = [HostSlot(slot_dir(root, rank, i)) for i in range(count)]
        # Slots a predecessor with more of them left: never written again here, so never trusted again (a
        # restore of an older step would not drop them as a future it went back from).
        for extra in list_dir(root / rank_dir_name(rank)):
            number = decimal(extra.name.removeprefix("slot_"))
            if extra.name.startswith("slot_") and number is not None and number >= count:
                shutil.rmtree(extra, ignore_errors=True)
        premap.drop_except(root / rank_dir_name(rank))  # a former spare's mappings of other ranks' slots
        self._busy: set[int] = set()
        self._held: set[int] = set()
        """Busy slots the node's helper may still publish (a request given up on): free once their lock is."""
        self._newest: int | None = None
        self._lock = threading.Lock()
        for index, slot in enumerate(self.slots):  # a restarted worker finds its predecessor's slots
            manifest = _read_own(slot.manifest_path, identity)
            if manifest is not None and manifest.rank == rank:
                slot.step = manifest.step
                if self._newest is None or manifest.step > (self.slots[self._newest].step or -1):
                    self._newest = index

    def claim(self, step: int) -> HostSlot | None:
        """A slot to write `step` into, its manifest removed; None when none is free (skip the snapshot)."""
        with self._lock:
            for index in list(self._held):
                with SlotLock(self.slots[index].data_path, wait=False) as unlocked:
                    if unlocked:
                        self._held.discard(index)
                        self._busy.discard(index)
            for index, slot in enumerate(self.slots):
                if slot.step is not None and slot.step >= step and index not in self._busy:
                    slot.invalidate()  # a future we went back from
                    if self._newest == index:
                        self._newest = None
            free = [i for i in range(len(self.slots)) if i != self._newest and i not in self._busy]
            if not free:
                return None
            index = min(free, key=lambda i: _step_or_minus_one(self.slots[i]))
            self._busy.add(index)
            slot = self.slots[index]
        slot.invalidate()
        return slot

    def claim_unmapped(self, file_bytes: int, pin: bool) -> HostSlot | None:
        """A slot that is free (not the newest, not in use) but not mapped for a file of `file_bytes` (pinned
        if `pin`), claimed and its manifest removed; None when there is none. For mapping it off the loop
        once the state's layout changed (the optimizer's state appears at the first step)."""
        with self._lock:
            for index, slot in enumerate(self.slots):
                if index == self._newest or index in self._busy:
                    continue
                if slot._size != file_bytes or (pin and not slot._pinned):
                    self._busy.add(index)
                    break
            else:
                return None
        slot.invalidate()
        return slot

    def published(self, slot: HostSlot, step: int, manifest: bytes | None) -> None:
        """`slot` now holds `step`, whole: it becomes the newest (`manifest` None: written by the helper)."""
        slot.publish(step, manifest)
        with self._lock:
            self._newest = self.slots.index(slot)

    def release(self, slot: HostSlot) -> None:
        """No job reads or writes `slot` any more: a later save may take it (a held one: once its lock is free)."""
        with self._lock:
            index = self.slots.index(slot)
            if index not in self._held:
                self._busy.discard(index)

    def hold(self, slot: HostSlot) -> None:
        """The node's helper may still write `slot`'s manifest: keep it until its lock is free (claim)."""
        with self._lock:
            self._held.add(self.slots.index(slot))

    def room_needed(self, file_bytes: int) -> int:
        """Bytes the slots of this rank not mapped yet will still take."""
        return sum(file_bytes for s in self.slots if s._size != file_bytes)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


def _step_or_minus_one(slot: HostSlot) -> int:
    return -1 if slot.step is None else slot.step


def _read_own(path: Path, identity: RunIdentity | None, *, timeout: float = 10.0) -> Manifest | None:
    """The manifest at `path` if it is readable and this run's (identity), else None."""
    try:
        manifest = parse_manifest(read_regular(path, timeout=timeout), path=path)
    except (OSError, CheckpointError):
        return None
    if identity is not None and (manifest.run, manifest.run_uid) != (identity.name, identity.uid):
        logger.warning("ignoring tier-0 snapshot %s: written by run %r (uid %s), this is %s",
                       path, manifest.run, manifest.run_uid or "?", identity.describe())
        return None
    return manifest


@dataclass(frozen=True)
class _Found:
    step: int
    rank: int
    world_size: int
    path: Path
    sha256: str
    mtime: float
    generation: str
    replica: bool
    """A peer node's replica (ckpt/replica.py), not a slot of this node's own ranks."""


def _choose(pieces: list[_Found]) -> dict[int, _Found]:
    """One piece per rank of a step: this node's own slots first (of the world size of the newest; the newer
    of two slots of one rank wins), then replicas of ranks not among them, of the same world size and
    incarnation (generation), so that a replica left from a future this run went back from is not mixed in."""
    own = [f for f in pieces if not f.replica]
    newest = max(own or pieces, key=lambda f: f.mtime)
    chosen: dict[int, _Found] = {}
    for f in sorted(own, key=lambda f: f.mtime):
        if f.world_size == newest.world_size:
            chosen[f.rank] = f
    replicas: dict[int, _Found] = {}
    for f in sorted(pieces, key=lambda f: f.mtime):
        if f.replica and f.rank not in chosen and (f.world_size, f.generation) == (newest.world_size,
                                                                                   newest.generation):
            replicas[f.rank] = f
    return {**replicas, **chosen}


class HostTier:
    """Tier 0 as restore sees it: the snapshots of every rank on this node (the `Tier` interface)."""

    def __init__(self, root: Path, *, read_timeout: float, local_world_size: int = 1) -> None:
        self.name: TierName = "memory"
        self.root = root
        self.local_world_size = local_world_size
        """A step counts once this many ranks of this node hold it, as tier 1's COMMIT: a rank killed
        before its snapshot of step N was whole resumes the node from N-1 with its own RNG streams,
        rather than from another rank's copy of N."""
        self.identity: RunIdentity | None = None
        self.unreadable: set[int] = set()
        self._read_timeout = read_timeout
        self._where: dict[tuple[int, int], Path] = {}
        self.replicated: set[tuple[int, int]] = set()
        """(step, rank) whose chosen piece is a peer node's replica (set by `committed`)."""
        self.with_replicas = True
        """Whether the replicas this node holds for its peers count (False: its own ranks' snapshots only)."""

    def _scan(self) -> dict[int, list[_Found]]:
        found: dict[int, list[_Found]] = {}
        peers = list_dir(self.root / PEERS_DIR) if self.with_replicas else []
        for node_path in [self.root, *peers]:  # own slots, then other nodes' replicas
            replica = node_path != self.root
            for rank_path in list_dir(node_path):
                rank = parse_rank_dir_name(rank_path.name)
                if rank is None:
                    continue
                for slot in list_dir(rank_path):
                    piece = self._read_slot(slot, rank, replica)
                    if piece is not None:
                        found.setdefault(piece.step, []).append(piece)
        return found

    def _read_slot(self, slot: Path, rank: int, replica: bool) -> _Found | None:
        path = slot / MANIFEST_FILE
        try:
            data = read_regular(path, timeout=self._read_timeout)
            manifest = parse_manifest(data, path=path)
            mtime = path.stat().st_mtime
        except (OSError, CheckpointError):
            return None  # no manifest: torn or being rewritten
        # A replica carries its source node's run uid (minted per node's tier 1 unless a shared tier gives one):
        # the run name is what the nodes of one job share. Only peers of this agent's rounds know its port.
        ours = self.identity is None or (manifest.run, manifest.run_uid) == (self.identity.name, self.identity.uid) or (
            replica and manifest.run == self.identity.name)
        if not ours or manifest.rank != rank:
            return None
        return _Found(manifest.step, rank, manifest.world_size, slot, hashlib.sha256(data).hexdigest(), mtime,
                      manifest.generation, replica)

    def committed(self) -> dict[int, CommitMarker]:
        markers: dict[int, CommitMarker] = {}
        self._where = {}
        scan = self._scan()
        ours: dict[tuple[int, str], set[int]] = {}  # (world size, generation) -> the ranks this node snapshots
        for f in (f for pieces in scan.values() for f in pieces if not f.replica):
            ours.setdefault((f.world_size, f.generation), set()).add(f.rank)
        for step, pieces in scan.items():
            chosen = _choose(pieces)
            world = next(iter(chosen.values())).world_size
            if len(chosen) < min(self.local_world_size, world):
                continue
            # A peer's replica stands in for a rank of the peer's (a lost node's), never for one of this node's own:
            # counted, a rank killed before its snapshot of this step was whole resumed from another rank's copy.
            mine = set().union(*(ours.get((world, f.generation), set()) for f in chosen.values()))
            if not mine <= {r for r, f in chosen.items() if not f.replica}:
                continue
            self._where.update({(step, r): f.path for r, f in chosen.items()})
            markers[step] = CommitMarker(
                step=step, world_size=world, run=self.identity.name if self.identity else "",
                run_uid=self.identity.uid if self.identity else "",
                manifests={r: f.sha256 for r, f in chosen.items()})
        self.replicated = {key for key, path in self._where.items() if self.root / PEERS_DIR in path.parents}
        return markers

    def committed_steps(self) -> list[int]:
        return sorted(self.committed(), reverse=True)

    def read_commit(self, step: int) -> CommitMarker | None:
        return self.committed().get(step)

    def has_rank(self, step: int, rank: int, marker: CommitMarker) -> bool:
        return marker.manifests is not None and rank in marker.manifests and (step, rank) in self._where

    def ranks_here(self, step: int, marker: CommitMarker) -> list[int]:
        return sorted(r for r in (marker.manifests or {}) if (step, r) in self._where)

    def _slot(self, step: int, rank: int) -> Path:
        return self._where.get((step, rank), slot_dir(self.root, rank, 0))

    def describe_rank(self, step: int, rank: int) -> str:
        kind = "a peer's replica in tier 0" if (step, rank) in self.replicated else "tier 0"
        return f"{self._slot(step, rank)} ({kind}, step {step})"

    @contextmanager
    def open_rank(self, step: int, rank: int, *, expected_manifest_sha256: str | None) -> Iterator[Path]:
        yield self._slot(step, rank)

    def read_manifest(self, step: int, rank: int, *, expected_sha256: str | None) -> Manifest:
        path = self._slot(step, rank) / MANIFEST_FILE
        return read_manifest(path, expected_sha256=expected_sha256, timeout=self._read_timeout)[0]

    def range_source(self, step: int, rank: int, name: str) -> LocalRange:
        slot = self._slot(step, rank)
        return LocalRange(resolve_file(slot, name, manifest_path=slot / MANIFEST_FILE), timeout=self._read_timeout)

    def delete_step(self, step: int) -> None:
        for (s, _), path in list(self._where.items()):
            if s == step:
                (path / MANIFEST_FILE).unlink(missing_ok=True)

    def sweep_temp(self, committed: Any) -> None:
        """Nothing to sweep: a slot is rewritten in place."""


def detach(tree: Any) -> Any:
    """`tree` with every tensor copied out of the slot it was mapped from (the slot is rewritten later)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: detach(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(detach(v) for v in tree)
    return tree
