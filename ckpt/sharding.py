"""Sharded (DTensor) leaves of a state: what each rank writes of them and how it is described.

A DTensor (FSDP2 `fully_shard`, tensor parallel, or both on a 2-D mesh) is a global tensor of which
each rank holds one box: `compute_local_shape_and_global_offset` gives the box's global offsets
and sizes, also for FSDP over TP (`_StridedShard`). A rank writes its box as a plain tensor under
the leaf's name and records a `ShardInfo` in its manifest: the global shape, dtype, placements and
mesh, and the box (`piece`). A box of a replicated mesh dim is held by several ranks; only the one
whose coordinate is 0 on every Replicate dim writes it (`piece` None on the others), so replicated
tensors are written once. Partial placements (pending reductions) cannot be saved.

Restore (ckpt/reshard.py) rebuilds any other layout from the pieces of every rank.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckpt.format import corrupt
from ckpt.safetensors_io import dtype_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement


def dtensor_type() -> type[DTensor] | None:
    """The DTensor class if the process has imported it, else None: no tensor can then be a DTensor.

    torch.distributed.tensor takes ~2 s to import (sympy, its op registry); every process that
    imports ckpt would pay that, though only sharded jobs need it, and those have imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


class ShardMismatchError(ValueError):
    """A sharded tensor of the checkpoint does not fit the state it is restored into (another
    global shape): not a damaged checkpoint, so restore raises it instead of trying older steps."""


@dataclass(frozen=True)
class Box:
    """A box of a tensor in global coordinates."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common box, None when empty."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(
            min(a + s, b + t)
            for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and lo:
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def describe(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


@dataclass(frozen=True)
class ShardInfo:
    """How one DTensor leaf was laid out when saved, and the piece this rank wrote (if any)."""

    global_shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    piece: Box | None

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "placements": list(self.placements),
            "mesh_shape": list(self.mesh_shape),
            "mesh_dims": list(self.mesh_dims),
        }
        if self.piece is not None:
            obj["piece"] = self.piece.to_json()
        return obj


def local_box(tensor: DTensor) -> Box:
    """The box of `tensor` this rank holds (empty sizes are possible with uneven sharding)."""
    return _box(tuple(int(s) for s in tensor.shape), tensor.device_mesh, tuple(tensor.placements), _rank())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@functools.lru_cache(maxsize=4096)
def _coordinate(mesh: DeviceMesh, rank: int) -> tuple[int, ...] | None:
    """`rank`'s coordinate in `mesh`, None if it is not in it. Not `mesh.get_coordinate()`: that is fixed when the
    mesh object is made, and torch hands an old mesh object out again (FSDP2's parameters, after an in-process
    re-formation that gave this process another rank at the same world size), whose coordinate is the old rank's.
    Cached by the mesh's layout and the rank, which it is a function of."""
    found = (mesh.mesh == rank).nonzero()
    return tuple(int(i) for i in found[0].tolist()) if len(found) else None


@functools.lru_cache(maxsize=4096)
def _box(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...], rank: int) -> Box:
    # Cached: a save of a few hundred DTensors would otherwise spend milliseconds here every step.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    coordinate = _coordinate(mesh, rank)
    if coordinate is None:  # not part of the mesh: holds nothing
        return Box(tuple(0 for _ in shape), tuple(0 for _ in shape))
    sizes, offsets = _compute_local_shape_and_global_offset(shape, tuple(mesh.shape), list(coordinate), placements)
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def full_box(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))


def _writes(mesh: DeviceMesh, placements: tuple[Placement, ...], name: str, rank: int) -> bool:
    """Whether this rank is the one that writes its box: coordinate 0 on every Replicate dim of the
    tensor's mesh, and on every dim of the root mesh the tensor's (sub-)mesh does not span."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coordinate = _coordinate(mesh, rank)
    if coordinate is None:  # not part of the mesh: holds nothing
        return False
    for dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):  # _StridedShard (FSDP over TP) is no Shard
            continue
        if not isinstance(placement, Replicate):
            raise TypeError(
                f"tensor {name!r} has placement {placement} on mesh dim {dim}: a pending reduction "
                f"cannot be checkpointed; reduce it first (e.g. redistribute to Replicate or Shard)"
            )
        if coordinate[dim] != 0:
            return False
    return _first_across_root(mesh, rank)


def _first_across_root(mesh: DeviceMesh, rank: int) -> bool:
    """For a sub-mesh (e.g. mesh["dp"] of a (dp, tp) mesh, where FSDP puts embeddings and norms, or a flattened
    one such as mesh["dp_shard", "cp"]._flatten("dp_shard_cp")), the ranks that differ only on the root dims it
    does not span hold the same box: coordinate 0 there writes. Which root dims it spans is read from its ranks
    (a step along a spanned dim stays among them), not from its dim names."""
    root = mesh._get_root_mesh()
    if root is mesh:
        return True
    where = _coordinate(root, rank)
    if where is None:
        return False
    members = set(mesh.mesh.flatten().tolist())
    ranks = root.mesh

    def spanned(dim: int) -> bool:
        step = list(where)
        for value in range(ranks.shape[dim]):
            step[dim] = value
            if value != where[dim] and int(ranks[tuple(step)]) in members:
                return True
        return False

    return all(where[dim] == 0 for dim in range(ranks.dim()) if not spanned(dim))


def split_sharded(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, ShardInfo]]:
    """(the tensors this rank writes, the ShardInfo of every DTensor leaf).

    Plain tensors pass through; a DTensor contributes its local box when this rank writes it and
    it is not empty. Raises TypeError (naming the tensor) for a Partial placement."""
    dtensor = dtensor_type()
    if dtensor is None or not any(map(isinstance, tensors.values(), repeat(dtensor))):  # a C loop: every snapshot
        return dict(tensors), {}
    written: dict[str, torch.Tensor] = {}
    shards: dict[str, ShardInfo] = {}
    for name, tensor in tensors.items():
        if dtensor is None or not isinstance(tensor, dtensor):
            written[name] = tensor
            continue
        shards[name] = info = _info(tuple(tensor.shape), tensor.dtype, tensor.device_mesh, tuple(tensor.placements),
                                    name, _rank())
        if info.piece is not None:
            written[name] = tensor._local_tensor  # what to_local() returns, without an autograd call
    return written, shards


@functools.lru_cache(maxsize=4096)
def _info(
    shape: tuple[int, ...], dtype: torch.dtype, mesh: DeviceMesh, placements: tuple[Placement, ...], name: str,
    rank: int,
) -> ShardInfo:
    # Cached per leaf and rank: every save of the same layout describes it the same way (~1 ms a DTensor).
    box = _box(shape, mesh, placements, rank)
    tensor_writes = box.numel > 0 and _writes(mesh, placements, name, rank)
    return ShardInfo(
        global_shape=tuple(int(s) for s in shape),
        dtype=dtype_name(dtype),
        placements=tuple(str(p) for p in placements),
        mesh_shape=tuple(int(s) for s in mesh.shape),
        mesh_dims=tuple(mesh.mesh_dim_names or ()),
        piece=box if tensor_writes else None,
    )


# -- the manifest's "shards" record ----------------------------------------------------------------


def _ints(value: object, *, minimum: int, what: str, path: Path) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
    ):
        raise corrupt(path, f"{what} is {value!r}, expected a list of ints >= {minimum}")
    return tuple(value)


def _strs(value: object, *, what: str, path: Path) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise corrupt(path, f"{what} is {value!r}, expected a list of strings")
    return tuple(value)


def parse_shard_info(name: str, entry: object, *, path: Path) -> ShardInfo:
    """One "shards" entry of a manifest; raises CheckpointCorruptError naming `path` and the tensor."""
    if not isinstance(entry, dict):
        raise corrupt(path, f"shards entry {name!r} is not an object")
    shape = _ints(entry.get("global_shape"), minimum=0, what=f"global_shape of {name!r}", path=path)
    dtype = entry.get("dtype")
    if not isinstance(dtype, str):
        raise corrupt(path, f"shards entry {name!r} has dtype {dtype!r}, expected a string")
    piece = None
    if "piece" in entry:
        raw = entry["piece"]
        if not isinstance(raw, dict):
            raise corrupt(path, f"piece of {name!r} is not an object")
        offsets = _ints(raw.get("offsets"), minimum=0, what=f"piece offsets of {name!r}", path=path)
        sizes = _ints(raw.get("sizes"), minimum=1, what=f"piece sizes of {name!r}", path=path)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise corrupt(path, f"piece of {name!r} has {len(offsets)}-d offsets for a {len(shape)}-d tensor")
        if any(o + s > g for o, s, g in zip(offsets, sizes, shape, strict=True)):
            raise corrupt(path, f"piece {Box(offsets, sizes).describe()} of {name!r} lies outside its global shape "
                                f"{list(shape)}")
        piece = Box(offsets, sizes)
    return ShardInfo(
        global_shape=shape,
        dtype=dtype,
        placements=_strs(entry.get("placements", []), what=f"placements of {name!r}", path=path),
        mesh_shape=_ints(entry.get("mesh_shape", []), minimum=1, what=f"mesh_shape of {name!r}", path=path),
        mesh_dims=_strs(entry.get("mesh_dims", []), what=f"mesh_dims of {name!r}", path=path),
        piece=piece,
    )
