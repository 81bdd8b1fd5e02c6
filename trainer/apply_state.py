"""A checkpoint's state applied to a Resumable's training objects (its model, optimizer, schedules, sampler,
extras and RNG streams): a whole (replicated) state, or a sharded one restored into the layout's DTensors."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ckpt import Restored
from trainer import rng, sharding
from trainer.config import ResumeConfig
from trainer.data import ElasticSampler
from trainer.sharding import Layout
from trainer.topology import Topology

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """An LR scheduler, a GradScaler, or anything else with these two methods."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Parts(Protocol):
    """What of a Resumable a state is applied to."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Stateful | None
    scaler: Stateful | None
    sampler: ElasticSampler | None
    extras: dict[str, Any]
    topology: Topology
    layout: Layout
    config: ResumeConfig


def whole(run: Parts, state: Mapping[str, Any], *, own_rank: bool) -> None:
    """A replicated state: this rank's own (its RNG streams restored) or another rank's (derived from them)."""
    # `state` passed check_state (in the agreement): nothing below is expected to fail half-way.
    run.model.load_state_dict(state["model"])
    if run.optimizer is not None:
        run.optimizer.load_state_dict(state["optimizer"])
        _own_cpu_tensors(run.optimizer)
    _rest(run, state)
    if own_rank:
        rng.restore(state["rng"])
    else:
        rng.derive(state["rng"], run.topology.rank)
        log.info("rank %d has no checkpoint file of its own in %s (the world size grew, or it moved to "
                 "another node); its RNG streams are derived from rank 0's and its rank",
                 run.topology.rank, run.config.ckpt_dir)


def sharded(run: Parts, restored: Restored) -> None:
    """A sharded state restored into the run's layout (resharded where the layout changed)."""
    state = restored.state
    sharding.load(run.model, run.optimizer, state)
    if run.optimizer is not None:
        _own_cpu_tensors(run.optimizer)
    _rest(run, state)
    saved = state.get("layout")
    # The TP peers of one data-parallel rank must keep drawing alike: all ranks decide together.
    if run.topology.all_min(int(restored.own and saved == run.layout.record())):
        rng.restore(state["rng"])
        return
    t = run.topology
    shared = t.all_min(rng.fingerprint(state["rng"]) if t.rank == 0 else 2**63 - 1)  # rank 0's, to all
    rng.derive_from(shared, run.layout.dp_rank)
    if t.rank == 0:
        log.info("layout %s -> %s: RNG streams derived per data-parallel rank from rank 0's saved state",
                 saved, run.layout.record())


def _rest(run: Parts, state: Mapping[str, Any]) -> None:
    if run.sampler is not None:
        run.sampler.load_state_dict(state["data"])
    for name, obj in (("scheduler", run.scheduler), ("scaler", run.scaler)):
        saved = state.get(name)
        if obj is None:
            continue
        if not saved:  # absent, or a disabled GradScaler's empty state
            if obj.state_dict():
                log.warning("the checkpoint has no %s state; this run's %s starts fresh", name, name)
            continue
        obj.load_state_dict(saved)
    run.extras.update(state.get("extras") or {})  # in place: the caller's dict


def _own_cpu_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer's CPU state tensors memory of their own. A restore hands the state over without
    copying it out of tier 0 (`detach=False`: the slot's read-only mapping, rewritten by this rank's second
    save after it); the model's load copies, and so does the optimizer's for a GPU parameter, but it keeps
    a CPU tensor as loaded (a CPU model's moments; AdamW's step counts)."""
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                per_param[key] = value.clone()
