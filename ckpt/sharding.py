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
    return _box(tuple(int(s) for s in tensor.shape), tensor.device_mesh, tuple(tensor.placements))


@functools.lru_cache(maxsize=4096)
def _box(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Box:
    # Cached: a save of a few hundred DTensors would otherwise spend milliseconds here every step.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def full_box(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))


def _writes(mesh: DeviceMesh, placements: tuple[Placement, ...], name: str) -> bool:
    """Whether this rank is the one that writes its box: coordinate 0 on every Replicate dim of the
    tensor's mesh, and on every dim of the root mesh the tensor's (sub-)mesh does not span."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coordinate = mesh.get_coordinate()
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
    return _first_across_root(mesh)


def _first_across_root(mesh: DeviceMesh) -> bool:
    """For a sub-mesh (e.g. mesh["dp"] of a (dp, tp) mesh, where FSDP puts embeddings and norms),
    the ranks that differ only on the root dims it lacks hold the same box: coordinate 0 there writes.
    A flattened dim ("dp_cp") spans the root dims its name joins."""
    root = mesh._get_root_mesh()
    if root is mesh or not root.mesh_dim_names or not mesh.mesh_dim_names:
        return True
    spanned = {part for dim in mesh.mesh_dim_names for part in (dim, *dim.split("_"))}
    where = root.get_coordinate()
    if where is None:
        return False
    return all(where[i] == 0 for i, dim in enumerate(root.mesh_dim_names) if dim not in spanned)


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
                                    name)
        if info.piece is not None:
            written[name] = tensor._local_tensor  # what to_local() returns, without an autograd call
    return written, shards


@functools.lru_cache(maxsize=4096)
def _info(
    shape: tuple[int, ...], dtype: torch.dtype, mesh: DeviceMesh, placements: tuple[Placement, ...], name: str
) -> ShardInfo:
    # Cached per leaf: every save of the same layout describes it the same way (~1 ms a DTensor).
    box = _box(shape, mesh, placements)
    tensor_writes = box.numel > 0 and _writes(mesh, placements, name)
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
