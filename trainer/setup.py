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
from trainer.errors import ExtrasError
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
    """Raise ExtrasError, naming the entry, unless `extras` round-trips through a checkpoint's JSON unchanged in
    kind: dicts with str keys (json.dumps would turn an int key into a str, and restore refuses the checkpoint),
    lists, str, int, float, bool, None. Runs every save: a dump, and a walk of the keys."""
    try:
        json.dumps(extras)
    except (TypeError, ValueError) as exc:
        entry = _bad_entry(extras, "", set()) or _bad_key(extras) or ""
        raise ExtrasError(f"extras{entry} is not JSON-able ({exc}): a checkpoint keeps extras "
                          "as JSON (dicts with str keys, lists, str, int, float, bool, None)") from exc
    key = _bad_key(extras)
    if key is not None:
        raise ExtrasError(f"extras{key} is not a str key: a checkpoint keeps extras as JSON, whose keys are "
                          "strings (a restart would find a different key); use str keys")


def _bad_key(value: Any, path: str = "") -> str | None:
    """The path of the first dict key in `value` that is not a str, else None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path}[{key!r}]"
            found = _bad_key(item, f"{path}[{key!r}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _bad_key(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _bad_entry(value: Any, path: str, seen: set[int]) -> str | None:
    """The path of the first value in `value` that json.dumps cannot write (a container met again: a cycle),
    else None."""
    if isinstance(value, (dict, list, tuple)):
        if id(value) in seen:
            return path
        seen.add(id(value))
    if isinstance(value, dict):
        items: Any = ((f"{path}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return path
        return None
    for where, item in items:
        found = _bad_entry(item, where, seen)
        if found is not None:
            return found
    return None
