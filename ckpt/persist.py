"""Tier 1's files: write one rank's snapshot durably into the local directory, then commit the step.

`persist_rank` turns file bytes (safetensors prefix + staged data) into a published rank
directory:

    step_.../.tmp-rank_00003-<hex>/state.safetensors   streamed, hashed in parallel, fsync
    step_.../.tmp-rank_00003-<hex>/manifest.json       fsync, then fsync of the directory
    rename to step_.../rank_00003, fsync of the step directory

`commit_if_complete` writes the step's COMMIT once every rank of this directory (of this
generation) has published: each rank calls it after its own rename, so the last one commits,
without any collective. The pipeline that calls both, on a background thread, is ckpt/writer.py.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.checksum import CHUNK_BYTES, Checksum, PendingDigest, digest_parts
from ckpt.commit import CommitMarker, parse_commit
from ckpt.direct_io import direct_plan, write_parts
from ckpt.durable import (
    discard_tree,
    fsync_dir,
    publish_dir,
    remove_quietly,
    write_atomic,
    write_new_file,
)
from ckpt.errors import CheckpointConflictError, CheckpointError, CheckpointWriteError
from ckpt.fs_errors import describe
from ckpt.identity import RunIdentity, foreign
from ckpt.layout import MANIFEST_FILE, STATE_FILE, Layout
from ckpt.manifest import FileEntry, Manifest, TensorEntry, parse_manifest
from ckpt.safe_io import read_regular
from ckpt.sharding import ShardInfo

_RECORD_TIMEOUT_S = 120.0

logger = logging.getLogger(__name__)

WRITE_CHUNK = 64 << 20
"""Bytes per write() call."""

OVERLAP_HASH_WITH_WRITES = (os.cpu_count() or 1) >= 8
"""Hash the staged bytes while they are written (hosts with cores to spare), rather than only
during the fsync. Measured on the 2-core dev VM: hashing beside write() made 256 MiB persists
0.3-1.5 s instead of 0.15-0.2 s, i.e. the page-cache copy and the hash fought for the cores."""


def write_all(fd: int, data: memoryview) -> None:
    """Write all of `data` to `fd` (tests replace this to inject ENOSPC)."""
    view = data
    while len(view):
        written = os.write(fd, view[:WRITE_CHUNK])
        view = view[written:]


def drop_cached(fd: int) -> None:
    """Let the kernel drop a written checkpoint file's pages (clean once fsynced) from the page cache. A checkpoint
    is read again only after a failure, where tier 0 serves a restarted worker and a lost node's cache is gone with
    it; cached, each persist (1.2 GB every 10 steps in issue J's benchmark) evicts pages the job does read, and the
    kernel has to find fresh memory for the next one. Best effort: a file system without the advice keeps them."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):  # no posix_fadvise on this platform, or a file system that refuses it
        pass


def _close_quietly(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view outlived the digest: the mapping goes with it
        logger.debug("mapping of a written checkpoint file still viewed")


@dataclass(frozen=True)
class WrittenRank:
    """A published rank directory."""

    path: Path
    nbytes: int
    manifest_sha256: str


def uncommit(layout: Layout, step: int, identity: RunIdentity | None = None, *,
             check_only: bool = False) -> None:
    """Remove the COMMIT of `step` (if any) so that a re-save is invisible until committed again (with
    `check_only`, only the check below: a re-save checks first and uncommits once its files are whole, so that a
    write that fails, on a full disk say, leaves the committed step as it was).

    Raises CheckpointConflictError, touching nothing, when that COMMIT names another run than
    `identity`: a run never replaces another run's step (a damaged COMMIT is replaced)."""
    commit_path = layout.commit_path(step)
    if commit_path.exists():
        if identity is not None:
            try:
                marker = parse_commit(
                    read_regular(commit_path, timeout=_RECORD_TIMEOUT_S), path=commit_path, step=step
                )
            except (OSError, CheckpointError):
                marker = None
            other = None if marker is None else foreign(marker, identity, name=identity.name)
            if other is not None:
                raise CheckpointConflictError(
                    f"step {step} in {commit_path.parent} is committed by {other}, not by this run "
                    f"{identity.describe()}; not replacing it. Move that step directory away (it "
                    f"was copied in from another run) or use another checkpoint directory",
                    path=commit_path,
                )
        if check_only:
            return
        logger.warning("step %d is committed in %s; replacing it", step, commit_path.parent)
        commit_path.unlink(missing_ok=True)
        fsync_dir(commit_path.parent)


def persist_rank(
    layout: Layout,
    *,
    step: int,
    rank: int,
    world_size: int,
    generation: str,
    parts: Sequence[memoryview],
    tensors: dict[str, TensorEntry],
    skeleton: Any,
    checksum: str,
    pool: Executor | None,
    chunk_bytes: int = CHUNK_BYTES,
    before_publish: Callable[[], None] | None = None,
    identity: RunIdentity | None = None,
    shards: dict[str, ShardInfo] | None = None,
    release: Callable[[], None] | None = None,
) -> WrittenRank:
    """Write the file bytes `parts` and a manifest as rank `rank` of `step`, durably, then publish.

    `release`, when given, is called as soon as `parts` are no longer read (they are a tier-0 slot,
    which the next snapshots want back): after the write() calls, before the fsync. The checksum is
    then taken from the written file (in the page cache) while fsync runs, not from `parts`, unless it
    was taken from `parts` already: beside the writes, or where blocks went direct (ckpt/direct_io.py).

    With `shards` (a state with DTensor leaves, ckpt/sharding.py) the manifest also keeps every
    chunk digest, so that resharding can verify the byte ranges it reads.

    `before_publish` runs once the files are fsynced, before the rename (fault injection).
    Raises CheckpointWriteError (after removing the partial directory) when the disk refuses.
    """
    step_dir = layout.step_dir(step)
    final = layout.rank_dir(step, rank)
    tmp: Path | None = None
    digest: PendingDigest | None = None
    result: Checksum | None = None
    try:
        uncommit(layout, step, identity, check_only=True)
        if not step_dir.is_dir():
            step_dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(step_dir.parent)
        tmp = layout.temp_rank_dir(step, rank)
        tmp.mkdir()
        # Where blocks go around the page cache (ckpt/direct_io.py), writing costs no CPU: hash beside it.
        blocks = direct_plan(parts, tmp)
        if pool is not None and (OVERLAP_HASH_WITH_WRITES or any(blocks)):
            digest = PendingDigest(parts, algorithm=checksum, chunk_bytes=chunk_bytes, pool=pool)
        nbytes = sum(len(part) for part in parts)
        fd = os.open(tmp / STATE_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        written: mmap.mmap | None = None
        source: Sequence[memoryview] = parts
        try:
            direct = write_parts(fd, tmp / STATE_FILE, parts, write_all, blocks)
            if release is not None:
                if digest is not None:  # hashed beside the writes: `parts` are read once it is done
                    result = digest.result()
                    digest = None
                elif direct:  # the page cache does not hold what went direct: hash `parts` before they go
                    result = digest_parts(parts, algorithm=checksum, chunk_bytes=chunk_bytes)
                release()
                if result is None and nbytes:
                    written = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
                    source = [memoryview(written)]
            if pool is not None and digest is None and result is None:
                # Hash while fsync waits for the disk: write() is a CPU-bound copy into the
                # page cache, and hashing beside it slows it down on hosts with few cores.
                digest = PendingDigest(source, algorithm=checksum, chunk_bytes=chunk_bytes, pool=pool)
            os.fsync(fd)
            if digest is not None:
                result = digest.result()
                digest = None
            elif result is None:
                result = digest_parts(source, algorithm=checksum, chunk_bytes=chunk_bytes)
        finally:
            if digest is not None:
                digest.cancel()  # before the hashed memory goes
                digest = None
            source = parts
            if written is not None:
                _close_quietly(written)
            drop_cached(fd)
            os.close(fd)
        manifest = Manifest(
            step=step,
            rank=rank,
            world_size=world_size,
            generation=generation,
            run=identity.name if identity else "",
            run_uid=identity.uid if identity else "",
            files={STATE_FILE: FileEntry.of(result, nbytes, result.chunks if shards else b"")},
            tensors=tensors,
            shards=shards or {},
            state=skeleton,
        ).to_bytes()
        write_new_file(tmp / MANIFEST_FILE, manifest)
        fsync_dir(tmp)
        if before_publish is not None:
            before_publish()
        uncommit(layout, step, identity)  # this copy is whole: its rank directory replaces the committed one
        publish_dir(tmp, final)
        tmp = None
    except OSError as exc:
        raise CheckpointWriteError(
            f"could not write rank {rank} of step {step} under {step_dir}: "
            f"{describe(exc, layout.root)}; nothing of this attempt is visible",
            path=step_dir,
        ) from exc
    finally:
        if digest is not None:
            digest.cancel()  # the hashed memory is about to be reused
        if tmp is not None:
            remove_quietly(tmp)
    return WrittenRank(final, nbytes, hashlib.sha256(manifest).hexdigest())


def _committed_as(commit_path: Path, step: int, marker: CommitMarker) -> bool:
    """Whether the step's COMMIT is there and is `marker`."""
    try:
        return parse_commit(read_regular(commit_path, timeout=_RECORD_TIMEOUT_S), path=commit_path,
                            step=step) == marker
    except (OSError, CheckpointError):
        return False


def commit_if_complete(
    layout: Layout,
    *,
    step: int,
    world_size: int,
    local_world_size: int,
    generation: str,
    identity: RunIdentity | None = None,
) -> CommitMarker | None:
    """Write the step's COMMIT if `local_world_size` ranks of this generation published it here.

    Every rank calls this after publishing its own directory; since each rename precedes the
    listing of the same rank, the last rank to publish sees them all. Two ranks that both see
    the step complete write the same marker (atomically), which is harmless. Rank directories of
    ranks beyond `world_size` (an earlier save of this step by a larger world) are removed first.
    """
    manifests: dict[int, str] = {}
    for rank, path in layout.rank_dirs(step).items():
        if rank >= world_size:
            continue
        try:
            data = read_regular(path / MANIFEST_FILE, timeout=_RECORD_TIMEOUT_S)
            manifest = parse_manifest(data, path=path / MANIFEST_FILE)
        except (OSError, CheckpointError):
            continue  # being replaced, or damaged: not part of this commit
        if identity is not None and manifest.run and manifest.run != identity.name:
            continue  # another run's (copied in): never part of our commit
        if manifest.generation == generation and manifest.world_size == world_size:
            manifests[rank] = hashlib.sha256(data).hexdigest()
    if len(manifests) < local_world_size:
        return None
    marker = CommitMarker(
        step=step,
        world_size=world_size,
        generation=generation,
        manifests=manifests,
        run=identity.name if identity else "",
        run_uid=identity.uid if identity else "",
    )
    for rank, path in layout.rank_dirs(step).items():
        if rank >= world_size:  # left by an earlier save of this step with a larger world
            try:
                discard_tree(path)
            except OSError as exc:
                logger.warning("could not remove %s: %s", path, exc)
    commit_path = layout.commit_path(step)
    if _committed_as(commit_path, step, marker):
        return marker
    try:
        write_atomic(commit_path, marker.to_bytes())
    except OSError as exc:
        # Another rank of this directory that saw the step complete too may have written the same marker and,
        # in its retention's sweep of the committed step, removed our scratch file before our rename (ENOENT).
        if _committed_as(commit_path, step, marker):
            return marker
        raise CheckpointWriteError(
            f"could not write {commit_path}: {describe(exc, layout.root)}; step {step} stays "
            f"uncommitted here",
            path=commit_path,
        ) from exc
    return marker
