"""What `Resumable` checks and derives from its arguments when it is made: the layout of the model,
the sampler's fit to it, the caller's extras, a hint about DDPs that rebuild their buckets."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from trainer import sharding
from trainer.config import ResumeConfig
from trainer.data import ElasticSampler
from trainer.ddp import layout_is_stable
from trainer.errors import ExtrasError
from trainer.sharding import Layout
from trainer.topology import Topology

log = logging.getLogger(__name__)


def check_arguments(config: object, model: object, optimizer: object, sampler: object,
                    stateful: dict[str, object]) -> None:
    """TypeError naming the argument and what to pass, before anything is made (a checkpointer, its directory's
    lock): a CheckpointConfig for the config, a state_dict for the model and a scheduler without state_dict had
    each failed later as a bare AttributeError, the scheduler's after the model and optimizer were loaded."""
    def refuse(what: str, value: object, expected: str) -> TypeError:
        return TypeError(f"Resumable({what}=...) must be {expected}, got a {type(value).__name__}")

    if not isinstance(config, ResumeConfig):
        raise refuse("config", config, "a ResumeConfig: ResumeConfig.at(ckpt_dir, ...), or ResumeConfig(ckpt="
                     "CheckpointConfig(...)) for a CheckpointConfig")
    if not isinstance(model, torch.nn.Module):
        raise refuse("model", model, "a torch.nn.Module (the model itself, not its state_dict())")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise refuse("optimizer", optimizer, "a torch.optim.Optimizer or None")
    if sampler is not None and not isinstance(sampler, ElasticSampler):
        raise refuse("sampler", sampler, "an ElasticSampler (ElasticSampler(DataConfig(...))) or None")
    for name, obj in stateful.items():
        if obj is not None and not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise refuse(name, obj, "an object with state_dict() and load_state_dict() (an LR scheduler, a "
                         "GradScaler) or None")


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
        entry = _first_bad(extras, _json_able, set()) or ""
        raise ExtrasError(f"extras{entry} is not JSON-able ({exc}): a checkpoint keeps extras "
                          "as JSON (dicts with str keys, lists, str, int, float, bool, None)") from exc
    key = _first_bad(extras, lambda _: True, set())
    if key is not None:
        raise ExtrasError(f"extras{key} is not a str key: a checkpoint keeps extras as JSON, whose keys are "
                          "strings (a restart would find a different key); use str keys")


def _first_bad(value: Any, leaf_ok: Callable[[Any], bool], inside: set[int]) -> str | None:
    """The path (`['a'][0]`) of the first dict key in `value` that is not a str or leaf that `leaf_ok` refuses (or
    container inside itself: a cycle), else None. `inside`: the containers above `value`. The path is built only
    for what is found."""
    if not isinstance(value, (dict, list, tuple)):
        return None if leaf_ok(value) else ""
    if id(value) in inside:
        return ""
    inside.add(id(value))
    try:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, str):
                return f"[{key!r}]"
            found = _first_bad(item, leaf_ok, inside)
            if found is not None:
                return f"[{key!r}]{found}"
        return None
    finally:
        inside.discard(id(value))


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
