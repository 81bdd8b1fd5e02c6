"""Sharded models (FSDP2 `fully_shard`, tensor parallel `parallelize_module`, 2-D meshes of both):
where a rank sits in the data-parallel dimension, and the state tree of a sharded model.

The data-parallel rule. The ranks of one data-parallel rank's model-parallel group (its TP peers)
hold pieces of one model replica and must read the same samples. So the data position, the split of
the global batch and the sample log are per data-parallel rank: a `Layout` gives this rank's
coordinate on the mesh's data-parallel dims ("dp", or names starting with "dp_", e.g. HSDP's
"dp_replicate" x "dp_shard"), row-major over those dims, and their size. A 1-D mesh without dim names
is data-parallel (FSDP); a mesh without a data-parallel dim (e.g. ("tp",)) has one data-parallel rank.

The state tree. `model_state` (the model's and the optimizer's) comes from
`torch.distributed.checkpoint.state_dict` (canonical parameter names; the optimizer's state is keyed
by name and holds DTensors too), and `load` puts it back with `set_state_dict`. ckpt restores each
DTensor leaf into the template's layout, or as the full tensor where the template has a plain tensor;
`fit_to_template` also cuts a full tensor into the template's DTensor piece (a leaf saved plain, e.g.
replicated by TP alone, restored into FSDP).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ckpt.sharding import dtensor_type

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2, tensor parallel, or both)."""
    dtensor = dtensor_type()  # torch.distributed.tensor is slow to import: only sharded jobs have it loaded
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


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
    from torch.distributed.tensor import DTensor

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
        return _checkpoint_state_dict().get_state_dict(model, [])[0], None
    return _checkpoint_state_dict().get_state_dict(model, optimizer)


def forget_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Undo the state `get_state_dict` gives a fresh optimizer (one zero-lr step, so that its tensors
    exist): a fresh run's first step is then a true first step (Adam's bias correction at t = 1)."""
    if optimizer is not None:
        optimizer.state.clear()


def fit_to_template(saved: Any, template: Any) -> Any:
    """`saved` with every full (plain) tensor whose template leaf is a DTensor cut into that DTensor's
    local piece; the rest as it is."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(template, dtensor) and isinstance(saved, torch.Tensor) \
            and not isinstance(saved, dtensor) and tuple(saved.shape) == tuple(template.shape):
        return _local_piece(saved, template)
    if isinstance(saved, Mapping) and isinstance(template, Mapping):
        return {k: fit_to_template(v, template.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(template, (list, tuple)) and len(saved) == len(template):
        return type(saved)(fit_to_template(v, t) for v, t in zip(saved, template, strict=True))
    return saved


def _local_piece(full: torch.Tensor, like: DTensor) -> DTensor:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    local = piece.to(device=like.to_local().device, dtype=like.dtype).contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: Mapping[str, Any]) -> None:
    """Copy a restored tree's model and optimizer state into `model` and `optimizer` (set_state_dict)."""
    model_now, optim_now = model_state(model, optimizer)  # the layout to load into
    model_sd = fit_to_template(state["model"], model_now)
    if optimizer is None:
        _checkpoint_state_dict().set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        return
    optim_sd = fit_to_template(state["optimizer"], optim_now)
    sd = _checkpoint_state_dict()
    sd.set_model_state_dict(model, model_sd)  # strict: every parameter and buffer
    # Not strict: a trainable parameter that never had a gradient (a branch not taken yet) has no optimizer state in
    # the checkpoint, and gets none, as in the run that saved it. The tree was checked against the template before.
    sd.set_optimizer_state_dict(model, optimizer, optim_sd, options=sd.StateDictOptions(strict=False))


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



def _checkpoint_state_dict() -> Any:
    """torch.distributed.checkpoint.state_dict, imported on first use (~1 s; DDP jobs never need it)."""
    import torch.distributed.checkpoint.state_dict as state_dict

    return state_dict
