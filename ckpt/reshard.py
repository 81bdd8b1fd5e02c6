"""Restore a sharded (DTensor) state into any layout, reading only the bytes this rank needs.

A sharded step (manifests with a "shards" record, ckpt/sharding.py) is read like this, for the
rank part chosen by ckpt/restore.py (the non-sharded leaves: RNG, data position, ...):

1. The manifests of every rank of the step are read (small JSON, each checked against the
   sha256 its tier's COMMIT recorded), from this node's tier 1 where the rank directory is there,
   else from tier 2. Together they say which global box of each tensor every rank wrote; the
   boxes must not overlap, and must cover the tensor once every rank's manifest was read.
2. For each sharded leaf, the box to load is this rank's box of the template's DTensor at the same
   key path (another mesh, other placements, another world size), or the whole tensor when the
   template has none there (a plain, unsharded model). A different global shape raises
   ShardMismatchError.
3. For each saved piece that meets that box, the intersection is cut into runs of contiguous
   bytes of the piece's file, runs are packed into reads of at most READ_BYTES (chunk-aligned,
   verified chunk by chunk, ckpt/ranges.py) and copied into a new tensor on the template's device.
   A piece is read from tier 1 first, then tier 2; a piece no tier can give raises
   ShardMissingError (a CheckpointError: restore moves on to an older step), naming the tensor,
   the box and the tiers searched.

Peak extra host memory is the new local tensors (on the template's device) plus one read.
"""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CheckpointConflictError, CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ckpt.format import corrupt
from ckpt.manifest import Manifest
from ckpt.ranges import VerifiedFile, tensor_bytes
from ckpt.safetensors_io import DTYPES
from ckpt.sharding import Box, ShardMismatchError, dtensor_type, full_box, local_box
from ckpt.tiers import Copy
from ckpt.tree import flatten, unflatten

logger = logging.getLogger(__name__)

READ_BYTES = 16 << 20
"""Most bytes one range read asks for (the read buffer is the only extra host memory)."""


class ShardMissingError(CheckpointNotFoundError):
    """A part of a sharded tensor is in no tier (its node is lost and it was never uploaded)."""


class StepFiles:
    """The manifests and verified data files of every rank of one step, over the tiers holding it."""

    def __init__(self, step: int, copies: Sequence[Copy], *, run: str | None, pool: Executor | None = None) -> None:
        self.step = step
        self.pool = pool
        self.copies = list(copies)
        self.run = run
        self._manifests: dict[int, Manifest] = {}
        self.unreadable: dict[int, list[str]] = {}
        """Ranks whose manifest no tier gave, with each tier's reason."""
        self.bytes_read = 0

    def ranks(self) -> list[int]:
        """The ranks of the step: those the COMMITs list (bounded by the COMMITs, not by world_size)."""
        found: set[int] = set()
        for c in self.copies:
            if c.marker.manifests is not None:
                found |= set(c.marker.manifests)
        return sorted(found)

    def world_size(self) -> int:
        return max(c.marker.world_size for c in self.copies)

    def holders(self, rank: int) -> list[Copy]:
        return [c for c in self.copies if c.tier.has_rank(self.step, rank, c.marker)]

    def manifest(self, rank: int) -> Manifest | None:
        """Rank `rank`'s manifest from the first tier that holds it intact, None if none does."""
        if rank in self._manifests:
            return self._manifests[rank]
        if rank in self.unreadable:
            return None
        errors = []
        for c in self.holders(rank):
            expected = None if c.marker.manifests is None else c.marker.manifests.get(rank)
            try:
                manifest = c.tier.read_manifest(self.step, rank, expected_sha256=expected)
                _check_manifest(manifest, step=self.step, rank=rank, run=self.run, where=c.tier.describe_rank(
                    self.step, rank))
            except CheckpointConflictError:
                raise
            except CheckpointError as exc:
                errors.append(f"{c.tier.name}: {exc}")
                continue
            self._manifests[rank] = manifest
            return manifest
        self.unreadable[rank] = errors or [f"{c.tier.name}: not there" for c in self.copies]
        return None

    def is_sharded(self, rank: int) -> bool:
        """Whether rank `rank`'s part (readable in some tier) holds sharded leaves."""
        manifest = self.manifest(rank)
        return manifest is not None and bool(manifest.shards)

    def searched(self) -> str:
        return ", ".join(f"{c.tier.name} ({c.tier.describe_rank(self.step, 0).rsplit('/', 1)[0]})" for c in self.copies)

    def files(self, rank: int, name: str) -> Iterator[VerifiedFile]:
        """Verified readers of rank `rank`'s data file `name`, one per tier that holds it, in order."""
        for c in self.holders(rank):
            manifest = self._manifests.get(rank)
            if manifest is None or name not in manifest.files:
                return
            yield VerifiedFile(manifest.files[name], c.tier.range_source(self.step, rank, name), pool=self.pool)


def _check_manifest(manifest: Manifest, *, step: int, rank: int, run: str | None, where: str) -> None:
    if (manifest.step, manifest.rank) != (step, rank):
        raise corrupt(Path(where), f"manifest describes step {manifest.step} rank {manifest.rank}, expected step "
                                   f"{step} rank {rank}")
    if run is not None and manifest.run and manifest.run != run:
        raise CheckpointConflictError(
            f"{where} was written by run {manifest.run!r}, this is run {run!r}; not loading it (start from it "
            f"with init_from)",
            path=where,
        )


@dataclass(frozen=True)
class Piece:
    """One saved box of a tensor, and where its bytes are."""

    rank: int
    box: Box
    file: str
    offset: int


def load_sharded(
    files: StepFiles, part: Manifest, *, into: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The state of `part` (the chosen rank part of a sharded step) with every sharded leaf loaded
    into the layout of `into` (see the module docstring). Raises ShardMismatchError, or a
    CheckpointError (damaged, missing) naming the file or tensor."""
    template = flatten(into)[0] if into is not None else {}
    dtensor = dtensor_type()  # None: nothing in the template can be a DTensor
    where = f"step {files.step}"
    pieces = _pieces(files, part, where=where)
    tensors: dict[str, torch.Tensor] = {}
    copies: list[Copying] = []
    for name, entry in part.tensors.items():
        if name in part.shards:
            continue
        offset = _stored_at(part, name, where)
        dest = _empty(entry.shape, _dtype(entry.dtype, name, where), torch.device("cpu"), name, where)
        box = full_box(entry.shape)
        copies.append(Copying(name, Piece(part.rank, box, entry.file, offset), box, dest, box))
        tensors[name] = dest
    for name, info in part.shards.items():
        target = template.get(name)
        if dtensor is not None and isinstance(target, dtensor):
            if tuple(target.shape) != info.global_shape:
                raise ShardMismatchError(
                    f"tensor {name!r}: the checkpoint ({where}) holds global shape {list(info.global_shape)}, the "
                    f"state restored into has {list(target.shape)}; restore into a model of the same shape"
                )
            box = local_box(target)
            device = target.to_local().device
        else:
            box = full_box(info.global_shape)
            device = torch.device("cpu")
        covering = _covering(files, name, pieces[name], box)  # before the allocation: a gap is named, not allocated
        dest = _empty(box.sizes, _dtype(info.dtype, name, where), device, name, where)
        copies.extend(Copying(name, piece, common, dest, box) for piece, common in covering)
        if dtensor is not None and isinstance(target, dtensor):
            tensors[name] = dtensor.from_local(
                dest, target.device_mesh, target.placements, run_check=False, shape=target.shape,
                stride=target.stride(),
            )
        else:
            tensors[name] = dest
    by_file: dict[tuple[int, str], list[Copying]] = {}
    for c in copies:
        by_file.setdefault((c.piece.rank, c.piece.file), []).append(c)
    for (rank, file), todo in sorted(by_file.items()):
        _read_file(files, rank, file, todo)
    try:
        state = unflatten(part.state, tensors)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"rank {part.rank} of {where}: its 'state' cannot be rebuilt: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"rank {part.rank} of {where}: its 'state' is a {type(state).__name__}")
    return state


@dataclass(frozen=True)
class Copying:
    """`common` (inside `piece` and `dest_box`) goes from the piece's file into `dest`."""

    name: str
    piece: Piece
    common: Box
    dest: torch.Tensor
    dest_box: Box


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device, name: str, where: str) -> torch.Tensor:
    """The tensor a saved one is read into; one too large to allocate is an error naming it (its shape comes from
    a manifest, which a damaged or crafted step may make anything), not a bare RuntimeError."""
    try:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    except torch.OutOfMemoryError:
        raise  # the device's memory, now (a predecessor's context still freeing it): not the checkpoint's fault
    except (RuntimeError, MemoryError) as exc:
        raise CheckpointError(f"{where}: tensor {name!r} of shape {list(shape)} ({dtype}) cannot be allocated on "
                              f"{device}: {exc}") from exc


def _stored_at(manifest: Manifest, name: str, where: str) -> int:
    """Where tensor `name`'s bytes begin in its file, checked to lie inside it (as `manifest` gives its size):
    a rank reads by range, and allocates what it reads into before it reads a byte."""
    entry = manifest.tensors[name]
    problem = None
    if entry.offset is None:
        problem = "has no offset (a sharded step's tensors are read by range)"
    else:
        end = entry.offset + math.prod(entry.shape) * _dtype(entry.dtype, name, where).itemsize
        if end > manifest.files[entry.file].bytes:
            problem = f"ends at byte {end} of {entry.file!r}, which has {manifest.files[entry.file].bytes}"
    if problem is not None:
        raise corrupt(Path(where), f"rank {manifest.rank}'s tensor {name!r} {problem}")
    assert entry.offset is not None
    return entry.offset


def _dtype(name: str, tensor: str, where: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise corrupt(Path(where), f"tensor {tensor!r} has unknown dtype {name!r}")
    return dtype


def _pieces(files: StepFiles, part: Manifest, *, where: str) -> dict[str, list[Piece]]:
    """The saved pieces of every sharded tensor of `part`, from every readable manifest."""
    found: dict[str, list[Piece]] = {name: [] for name in part.shards}
    for rank in files.ranks():
        manifest = files.manifest(rank)
        if manifest is None:
            continue
        for name, info in manifest.shards.items():
            if name not in found or info.piece is None:
                continue
            mine = part.shards[name]
            if (info.global_shape, info.dtype) != (mine.global_shape, mine.dtype):
                raise corrupt(
                    Path(where),
                    f"tensor {name!r} is {info.dtype}{list(info.global_shape)} in rank {rank}'s manifest but "
                    f"{mine.dtype}{list(mine.global_shape)} in rank {part.rank}'s",
                )
            found[name].append(Piece(rank, info.piece, manifest.tensors[name].file, _stored_at(manifest, name, where)))
    for name, saved in found.items():
        for i, a in enumerate(saved):
            for b in saved[i + 1 :]:
                common = a.box.intersect(b.box)
                if common is not None:
                    raise corrupt(
                        Path(where),
                        f"tensor {name!r}: the pieces of rank {a.rank} {a.box.describe()} and rank {b.rank} "
                        f"{b.box.describe()} overlap at {common.describe()}",
                    )
        covered = sum(p.box.numel for p in saved)
        total = math.prod(part.shards[name].global_shape)
        if not files.unreadable and len(files.ranks()) == files.world_size() and covered != total:
            raise corrupt(
                Path(where),
                f"tensor {name!r}: the pieces of all {files.world_size()} ranks cover {covered} of its {total} "
                f"elements (a gap in the manifests)",
            )
    return found


def _covering(files: StepFiles, name: str, saved: Sequence[Piece], box: Box) -> list[tuple[Piece, Box]]:
    """The saved pieces that fill `box` of tensor `name`, each with its part of it; ShardMissingError when they
    leave a gap."""
    copies = []
    for piece in saved:
        common = piece.box.intersect(box)
        if common is not None:
            copies.append((piece, common))
    covered = sum(common.numel for _, common in copies)
    if covered != box.numel:
        details = [f"rank {r}: {'; '.join(why)}" for r, why in sorted(files.unreadable.items())[:4]]
        absent = files.world_size() - len(files.ranks())
        if absent > 0:
            details.append(f"{absent} rank(s) of the saving world are in no tier's COMMIT")
        raise ShardMissingError(
            f"step {files.step}: {box.numel - covered} elements of tensor {name!r} box {box.describe()} are in no "
            f"readable piece; searched tiers {files.searched()}" + (f" ({'; '.join(details)})" if details else "")
        )
    return copies


def _read_file(files: StepFiles, rank: int, file: str, todo: Sequence[Copying]) -> None:
    """Do every copy out of rank `rank`'s data file `file`, reading each chunk once, from the first
    tier that reads it intact."""
    errors = []
    for reader in files.files(rank, file):
        runs = sorted((run for c in todo for run in _runs(c, reader.window)), key=lambda r: r[0])
        targets = [dest[index] for _, _, dest, index, _ in runs]
        if reader.direct and all(t.device.type == "cpu" and t.is_contiguous() for t in targets):
            try:  # straight into the destination tensors: no read buffer, no second copy
                for (start, nbytes, _, _, _), target in zip(runs, targets, strict=True):
                    reader.read_into(start, start + nbytes, tensor_bytes(target))
                return
            except CheckpointError as exc:
                errors.append(str(exc))
                logger.warning("rank %d's %s from %s is unusable: %s", rank, file, reader.path, exc)
                continue
            finally:
                files.bytes_read += reader.bytes_read
                reader.source.close()
        reads = list(_reads(runs, reader.span, reader.window))
        pending = reader.read_ahead(*reads[0][:2]) if reads else None
        try:
            for i, (start, _end, batch) in enumerate(reads):
                assert pending is not None
                data = reader.wait(pending)
                # the next read (into the other buffer) overlaps the copies out of this one
                pending = reader.read_ahead(*reads[i + 1][:2]) if i + 1 < len(reads) else None
                with warnings.catch_warnings():  # a read-only buffer (remote bytes): only read from
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.frombuffer(data, dtype=torch.uint8)
                for begin, nbytes, dest, index, shape in batch:
                    src = raw[begin - start : begin - start + nbytes].view(dest.dtype).view(shape)
                    dest[index].copy_(src)
            return
        except CheckpointError as exc:
            errors.append(str(exc))
            logger.warning("rank %d's %s from %s is unusable: %s", rank, file, reader.path, exc)
        finally:
            if pending is not None:  # never close the file under a read in flight
                wait((pending,), timeout=reader.source.timeout)
            files.bytes_read += reader.bytes_read
            reader.source.close()
    names = sorted({c.name for c in todo})
    shown = ", ".join(f"{n!r}" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ShardMissingError(
        f"step {files.step}: rank {rank}'s {file} (pieces of {shown}) could not be read from any tier; "
        f"searched {files.searched()}" + (f": {'; '.join(errors)}" if errors else "")
    )


Run = tuple[int, int, torch.Tensor, tuple[Any, ...], tuple[int, ...]]
"""(file offset, bytes, destination tensor, index into it, shape of the source bytes)."""


def _runs(copy: Copying, window: int) -> Iterator[Run]:
    """Contiguous runs of the piece's bytes that hold `copy.common`, each with its place in the destination."""
    piece, common, dest_box, itemsize = copy.piece, copy.common, copy.dest_box, copy.dest.element_size()
    ps, s, n = piece.box.sizes, common.sizes, len(common.sizes)
    if n == 0:
        yield piece.offset, itemsize, copy.dest, (), ()
        return
    lo = [c - p for c, p in zip(common.offsets, piece.box.offsets, strict=True)]
    dl = [c - d for c, d in zip(common.offsets, dest_box.offsets, strict=True)]
    k = n - 1  # dims after k span the piece fully, so a run covers rows of dim k
    while k > 0 and s[k] == ps[k]:
        k -= 1
    while k < n - 1 and math.prod(ps[k + 1 :]) * itemsize > window:
        k += 1  # a row of dim k alone is bigger than one read: runs over a later dim
    inner = math.prod(ps[k + 1 :])
    strides = [math.prod(ps[d + 1 :]) for d in range(n)]
    rows_per_run = max(1, window // max(1, inner * itemsize))
    tail = tuple(slice(dl[d], dl[d] + s[d]) for d in range(k + 1, n))
    for outer in itertools.product(*(range(s[d]) for d in range(k))):
        base = sum((lo[d] + outer[d]) * strides[d] for d in range(k))
        head = tuple(dl[d] + outer[d] for d in range(k))
        for r0 in range(0, s[k], rows_per_run):
            rows = min(rows_per_run, s[k] - r0)
            start = piece.offset + (base + (lo[k] + r0) * strides[k]) * itemsize
            index = (*head, slice(dl[k] + r0, dl[k] + r0 + rows), *tail)
            yield start, rows * inner * itemsize, copy.dest, index, (rows, *ps[k + 1 :])


def _reads(runs: Sequence[Run], span: Any, window: int) -> Iterator[tuple[int, int, list[Run]]]:
    """Runs (sorted by offset) packed into reads: runs whose chunk-aligned spans touch share one read
    of at most `window` bytes, so no chunk is read twice by neighbouring runs."""
    batch: list[Run] = []
    start = end = 0
    for run in runs:
        lo, _ = span(run[0], run[0] + run[1])
        if batch and lo <= span(start, end)[1] and run[0] + run[1] - start <= window:
            batch.append(run)
            end = max(end, run[0] + run[1])
            continue
        if batch:
            yield start, end, batch
        batch, start, end = [run], run[0], run[0] + run[1]
    if batch:
        yield start, end, batch
