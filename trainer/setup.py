"""What `Resumable` checks and derives from its arguments when it is made: the layout of the model,
the sampler's fit to it, the caller's extras, a hint about DDPs that rebuild their buckets."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from trainer import sharding
from trainer.data import ElasticSampler
from trainer.ddp import layout_is_stable
from trainer.sharding import Layout
from trainer.topology import Topology

log = logging.getLogger(__name__)


def layout(model: torch.nn.Module, mesh: DeviceMesh | None, topology: Topology, *, sharded: bool) -> Layout:
    if mesh is not None:
        layout = Layout.of(mesh)
        if layout.dp * layout.tp != topology.world_size:
            raise ValueError(f"the mesh {mesh} spans {layout.dp * layout.tp} ranks, the job {topology.world_size}; "
                             "pass Resumable the mesh over every rank of the job")
        return layout
    if sharded:
        return sharding.layout_of_model(model, rank=topology.rank, world_size=topology.world_size)
    return Layout.data_parallel(topology.rank, topology.world_size)


def checked_sampler(sampler: ElasticSampler | None, topology: Topology, layout: Layout) -> ElasticSampler | None:
    if sampler is None or (sampler.rank, sampler.world_size) == (layout.dp_rank, layout.dp):
        if sampler is not None and layout.tp_rank != 0:
            sampler.sample_log = None  # the first rank of its tensor-parallel group logs the samples they all read
        return sampler
    if layout.tp == 1:
        raise ValueError(f"the sampler is for rank {sampler.rank} of {sampler.world_size}, but this process is rank "
                         f"{topology.rank} of {topology.world_size}; build ElasticSampler without rank and "
                         "world_size (they default to this process's) or pass Resumable the same topology")
    raise ValueError(f"the sampler is for rank {sampler.rank} of {sampler.world_size}, but this process is "
                     f"data-parallel rank {layout.dp_rank} of {layout.dp} (tensor-parallel degree {layout.tp}); "
                     "build it with ElasticSampler(config, mesh=mesh) so that the ranks of one tensor-parallel "
                     "group read the same samples")


def own_extras(extras: dict[str, Any] | None) -> dict[str, Any]:
    if extras is not None and not isinstance(extras, dict):
        raise ValueError(f"extras must be a dict (it is kept and updated in place), got {type(extras).__name__}")
    extras = extras if extras is not None else {}
    check_json_able(extras)
    return extras


def hint_unstable_layout(model: torch.nn.Module, world_size: int) -> None:
    if world_size >= 3 and not layout_is_stable(model):
        log.info("this DDP rebuilds its gradient buckets after its first iteration, so with %d ranks the first "
                 "step after a resume rounds differently from an uninterrupted run (resume stays correct, "
                 "not bitwise); wrap the model with trainer.wrap_ddp for bitwise resume", world_size)


def check_json_able(extras: dict[str, Any]) -> None:
    try:
        json.dumps(extras)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extras must be JSON-able (dicts with str keys, lists, str, int, float, bool, None): "
                         f"{exc}") from exc
