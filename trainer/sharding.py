"""Sharded models (FSDP2 `fully_shard`, tensor parallel `parallelize_module`, 2-D meshes of both):
where a rank sits in the data-parallel dimension, and the state tree of a sharded model.

The data-parallel rule. The ranks of one data-parallel rank's model-parallel group (its TP peers)
hold pieces of one model replica and must read the same samples. So the data position, the split of
the global batch and the sample log are per data-parallel rank: a `Layout` gives this rank's
coordinate on the mesh's data-parallel dims ("dp", or names starting with "dp_", e.g. HSDP's
"dp_replicate" x "dp_shard"), row-major over those dims, and their size. A 1-D mesh without dim names
is data-parallel (FSDP); a mesh without a data-parallel dim (e.g. ("tp",)) has one data-parallel rank.

The state tree. `model_state` / `optimizer_state` come from `torch.distributed.checkpoint.state_dict`
(canonical parameter names; the optimizer's state is keyed by name and holds DTensors too), and go
back with `set_state_dict`. ckpt restores each DTensor leaf into the template's layout, or as the
full tensor where the template has a plain tensor; `fit_to_template` also turns a full tensor into
the template's DTensor (a leaf saved plain, e.g. replicated by TP alone, restored into FSDP).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2, tensor parallel, or both)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _is_data_parallel(name: str) -> bool:
    return name == "dp" or name.startswith("dp_")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where this rank sits on the mesh: its data-parallel coordinate and the parallel degrees."""

    dp_rank: int
    """This rank's index over the data-parallel dims (row-major); its TP peers share it."""
    dp: int
    """The data-parallel degree: how many model replicas read different samples."""
    tp: int
    """The model-parallel degree: ranks per data-parallel rank (the product of the other dims)."""
    tp_rank: int
    """This rank's index over the other dims (0: the rank that writes its group's sample log)."""

    @staticmethod
    def data_parallel(rank: int, world_size: int) -> Layout:
        """Plain data parallelism (DDP, 1-D FSDP): every rank is its own data-parallel rank."""
        return Layout(dp_rank=rank, dp=world_size, tp=1, tp_rank=0)

    @staticmethod
    def of(mesh: DeviceMesh) -> Layout:
        """This rank's place on `mesh`; raises ValueError for a mesh it cannot read."""
        names = mesh.mesh_dim_names
        if names is None:
            if mesh.ndim != 1:
                raise ValueError(f"a {mesh.ndim}-D mesh needs dim names to tell the data-parallel dims ('dp', or "
                                 "'dp_*') from the model-parallel ones ('tp', ...): init_device_mesh(..., "
                                 "mesh_dim_names=('dp', 'tp'))")
            names = ("dp",)
        coords = mesh.get_coordinate()
        if coords is None:
            raise ValueError(f"this rank is not on the mesh {mesh}; pass Resumable the mesh this rank trains on")
        dp_rank, dp, tp_rank, tp = 0, 1, 0, 1
        for name, size, coord in zip(names, mesh.shape, coords, strict=True):
            if _is_data_parallel(name):
                dp_rank, dp = dp_rank * size + coord, dp * size
            else:
                tp_rank, tp = tp_rank * size + coord, tp * size
        return Layout(dp_rank=dp_rank, dp=dp, tp=tp, tp_rank=tp_rank)

    def record(self) -> dict[str, int]:
        """The layout as a checkpoint records it."""
        return {"dp": self.dp, "tp": self.tp}


def layout_of_model(model: torch.nn.Module, *, rank: int, world_size: int) -> Layout:
    """The layout of a sharded `model` given no mesh: 1-D FSDP (every DTensor parameter on one 1-D
    mesh that is data-parallel by name or has no names) spans the world; anything else needs `mesh=`."""
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if len(meshes) == 1:
        (mesh,) = meshes
        if mesh.ndim == 1 and (mesh.mesh_dim_names is None or _is_data_parallel(mesh.mesh_dim_names[0])) \
                and mesh.size() == world_size:
            return Layout.data_parallel(rank, world_size)
    shown = ", ".join(sorted(str(m) for m in meshes))
    raise ValueError(f"the model's parameters are DTensors on {shown}: pass Resumable(mesh=...) the device mesh "
                     "(its 'dp' dim is the data-parallel one) so that the ranks of one tensor-parallel group read "
                     "the same samples")


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """(model state, optimizer state or None) by canonical names, DTensor leaves as they are."""
    if optimizer is None:
        return get_state_dict(model, [])[0], None
    return get_state_dict(model, optimizer)


def forget_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Undo the state `get_state_dict` gives a fresh optimizer (one zero-lr step, so that its tensors
    exist): a fresh run's first step is then a true first step (Adam's bias correction at t = 1)."""
    if optimizer is not None:
        optimizer.state.clear()


def savable(state: Any) -> Any:
    """`state` with its DTensors relabelled for ckpt, each with the same local piece (`load` relabels
    them back, `fit_to_template`):

    - A DTensor on a sub-mesh (FSDP's "dp" of a 2-D mesh: embeddings, norms) is implicitly replicated
      over the other dims; on the root mesh with Replicate there, one rank of each TP group writes
      its piece (ckpt writes a box once per Replicate dim, but sees only the tensor's own mesh).
    - FSDP over TP shards a dim that TP has sharded already: (_StridedShard(d, sf=tp), Shard(d)) on
      (dp, tp), the same boxes as (Shard(d), Shard(d)) on the mesh with its dims swapped, (tp, dp),
      which ckpt saves as plain Shard placements (_StridedShard is not a Shard in torch 2.13)."""
    if isinstance(state, DTensor):
        return _without_strided(_on_root(state))
    if isinstance(state, Mapping):
        return {k: savable(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(savable(v) for v in state)
    return state


def _on_root(t: DTensor) -> DTensor:
    mesh = t.device_mesh
    root = _root_of(mesh)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or root.ndim == mesh.ndim or not names or not root_names or not set(names) <= set(root_names):
        return t
    placements: list[Placement] = [Replicate()] * root.ndim
    for name, placement in zip(names, t.placements, strict=True):
        placements[root_names.index(name)] = placement
    with torch.no_grad():
        return DTensor.from_local(t.to_local(), root, placements, shape=t.shape, stride=t.stride())


def _root_of(mesh: DeviceMesh) -> DeviceMesh:
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root()
    from torch.distributed.device_mesh import _mesh_resources  # torch before 2.12

    return _mesh_resources.get_root_mesh(mesh)


def _without_strided(t: DTensor) -> DTensor:
    mesh, (outer, *inner) = t.device_mesh, t.placements
    if mesh.ndim != 2 or not isinstance(outer, _StridedShard) or inner != [Shard(outer.dim)] \
            or outer.split_factor != mesh.size(1):
        return t
    with torch.no_grad():
        return DTensor.from_local(t.to_local(), _swapped(mesh), (Shard(outer.dim), Shard(outer.dim)), shape=t.shape,
                                  stride=t.stride())


@functools.lru_cache(maxsize=8)
def _swapped(mesh: DeviceMesh) -> DeviceMesh:
    # Only a label for boxes (no process groups): nothing runs a collective on it.
    names = tuple(reversed(mesh.mesh_dim_names)) if mesh.mesh_dim_names else None
    return DeviceMesh(mesh.device_type, mesh.mesh.transpose(0, 1), mesh_dim_names=names, _init_backend=False)


def fit_to_template(saved: Any, template: Any) -> Any:
    """`saved` with every full (plain) tensor whose template leaf is a DTensor cut into that DTensor's
    local piece, and every DTensor relabelled to its template's mesh and placements (the same local
    piece: see `savable`); the rest as it is."""
    if isinstance(template, DTensor) and isinstance(saved, DTensor):
        if (saved.device_mesh, saved.placements) == (template.device_mesh, template.placements):
            return saved
        assert saved.to_local().shape == template.to_local().shape, "savable() keeps each local piece"
        return DTensor.from_local(saved.to_local(), template.device_mesh, template.placements, shape=template.shape,
                                  stride=template.stride())
    if isinstance(template, DTensor) and isinstance(saved, torch.Tensor) \
            and tuple(saved.shape) == tuple(template.shape):
        return _local_piece(saved, template)
    if isinstance(saved, Mapping) and isinstance(template, Mapping):
        return {k: fit_to_template(v, template.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(template, (list, tuple)) and len(saved) == len(template):
        return type(saved)(fit_to_template(v, t) for v, t in zip(saved, template, strict=True))
    return saved


def _local_piece(full: torch.Tensor, like: DTensor) -> DTensor:
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    local = piece.to(device=like.to_local().device, dtype=like.dtype).contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: Mapping[str, Any]) -> None:
    """Copy a restored tree's model and optimizer state into `model` and `optimizer` (set_state_dict)."""
    model_now, optim_now = model_state(model, optimizer)  # the layout to load into
    model_sd = fit_to_template(state["model"], model_now)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        return
    optim_sd = fit_to_template(state["optimizer"], optim_now)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


@contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's no_sync: gradients of this micro-batch stay local (reduced with the step's last one)."""
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is None:  # tensor parallel alone: nothing is reduced between micro-batches
        yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)

