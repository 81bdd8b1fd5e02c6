"""`Resumable`: the small object a user's own training loop calls to restore at start and save at
step boundaries.

    run = Resumable(ResumeConfig(ckpt_dir=..., save_every=50), model=model, optimizer=opt, sampler=sampler)
    step = run.restore()                 # 0 on a fresh start
    while step < total_steps:
        batch = load(sampler.indices())  # this rank's slice of the step's global batch
        ...forward, backward, optimizer.step()...
        step += 1
        run.step_done(step)              # advances the data position; saves every `save_every` steps

What a checkpoint holds: model, optimizer, LR scheduler, the RNG states (python, numpy, torch CPU,
CUDA), the data position and JSON-able user extras.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckpt import CheckpointConfig, Checkpointer, CheckpointError, CheckpointVersionError
from elastic import progress
from trainer import rng
from trainer.data import ElasticSampler
from trainer.errors import StateMismatchError
from trainer.topology import Topology

log = logging.getLogger(__name__)


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    ckpt_dir: str
    """Tier-1 checkpoint directory (node-local, e.g. NVMe)."""
    save_every: int
    """Save after every N-th completed step."""
    keep_last: int = 3
    """Committed checkpoints kept in ckpt_dir."""

    def __post_init__(self) -> None:
        if self.save_every <= 0:
            raise ValueError(f"save_every must be positive, got {self.save_every}")
        if not self.ckpt_dir:
            raise ValueError("ckpt_dir must be a directory path")


class Resumable:
    """Restores the newest good checkpoint at start and saves every `save_every` steps."""

    def __init__(
        self,
        config: ResumeConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: _Stateful | None = None,
        sampler: ElasticSampler | None = None,
        extras: dict[str, Any] | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.config = config
        # Save the unwrapped module so a checkpoint does not depend on DDP's "module." prefix.
        self.model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.extras: dict[str, Any] = dict(extras or {})
        self.topology = topology or Topology.from_env()
        self.checkpointer = Checkpointer(
            CheckpointConfig(local_dir=config.ckpt_dir, keep_last=config.keep_last),
            rank=self.topology.rank,
            world_size=self.topology.world_size,
        )
        self.step = 0
        self.resumed_from: int | None = None

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest checkpoint that every rank can read; return the step to continue from."""
        step, state = self._agree_on_checkpoint()
        if state is None:
            log.info("no checkpoint in %s; starting from step 0", self.config.ckpt_dir)
            return 0
        self._apply(state, own_rank=self.checkpointer.has_rank(step, self.topology.rank))
        self.step = self.resumed_from = step
        log.info("resumed from step %d (%s)", step, self.config.ckpt_dir)
        return step

    def _agree_on_checkpoint(self) -> tuple[int, dict[str, Any] | None]:
        # Every rank must resume from the same step. Each proposes its newest readable checkpoint;
        # the group takes the minimum and checks that everyone can read it, else tries older ones.
        candidates = self.checkpointer.committed_steps()
        cap: int | None = None
        while True:
            mine, state = -1, None
            for step in candidates:
                if cap is not None and step > cap:
                    continue
                state = self._try_load(step)
                if state is not None:
                    mine = step
                    break
            agreed = self.topology.all_min(mine)
            if agreed < 0:
                return -1, None
            if agreed != mine:
                state = self._try_load(agreed)
            if self.topology.all_min(0 if state is None else 1) == 1:
                assert state is not None
                return agreed, state
            cap = agreed - 1

    def _try_load(self, step: int) -> dict[str, Any] | None:
        rank = self.topology.rank
        source = rank if self.checkpointer.has_rank(step, rank) else 0
        try:
            return self.checkpointer.load(step, rank=source)
        except CheckpointVersionError:
            raise  # written by a newer elastic-train: falling back to an older step would hide that
        except CheckpointError as exc:
            log.warning("skipping checkpoint step %d: %s", step, exc)
            return None

    def _apply(self, state: Mapping[str, Any], *, own_rank: bool) -> None:
        _check_shapes(self.model.state_dict(), state["model"])
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.sampler is not None:
            self.sampler.load_state_dict(state["data"])
        self.extras.update(state.get("extras") or {})
        if own_rank:
            rng.restore(state["rng"])
        else:
            log.warning("rank %d has no checkpoint file of its own (world size changed); RNG streams start fresh",
                        self.topology.rank)

    # -- save ------------------------------------------------------------------------------------

    def step_done(self, step: int) -> bool:
        """Call after each completed optimizer step with the number of completed steps.

        Advances the data position; saves when `step` is a multiple of `save_every`. Returns True if it saved.
        """
        self.step = step
        progress.beat(step)  # lets elastic-run's agent tell a hung worker from a slow one
        if self.sampler is not None:
            self.sampler.advance()
        if step % self.config.save_every == 0:
            self.save(step)
            return True
        return False

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "world_size": self.topology.world_size,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "data": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng.capture(),
            "extras": self.extras,
        }

    def save(self, step: int) -> None:
        """Write every rank's part of `step`, then commit it once all ranks have written."""
        try:
            self.checkpointer.save(step, self.state())
            ok = 1
        except CheckpointError as exc:
            log.error("checkpoint of step %d failed on rank %d: %s", step, self.topology.rank, exc)
            ok = 0
        # Commit only if every rank wrote its part; one process per checkpoint dir writes the marker.
        # A failed checkpoint is logged and training goes on: the previous checkpoint stays valid.
        if self.topology.all_min(ok) == 1 and self.topology.local_rank == 0:
            try:
                self.checkpointer.commit(step)
            except CheckpointError as exc:
                log.error("commit of checkpoint step %d failed: %s", step, exc)
        self.topology.barrier()

    def close(self) -> None:
        """Nothing is in flight with the synchronous checkpointer; kept so loops need not change later."""


def _check_shapes(expected: Mapping[str, torch.Tensor], got: Mapping[str, Any]) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(got[k].shape)} {got[k].dtype}, model {tuple(v.shape)} {v.dtype}"
        for k, v in expected.items()
        if k in got and isinstance(got[k], torch.Tensor) and (got[k].shape != v.shape or got[k].dtype != v.dtype)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing in checkpoint: {missing}")
        if unexpected:
            parts.append(f"not in model: {unexpected}")
        if mismatched:
            parts.append("shape/dtype differ: " + "; ".join(mismatched))
        raise StateMismatchError("the checkpoint does not fit this model: " + " | ".join(parts)
                                 + ". Resume with the same model definition, or start from a fresh --ckpt-dir.")
