"""`Resumable`: the small object a user's own training loop calls to restore at start and save at
step boundaries.

    run = Resumable(ResumeConfig(ckpt_dir=..., save_every=50), model=ddp, optimizer=opt,
                    scheduler=sched, scaler=scaler, sampler=sampler, extras={"tokens": 0})
    step = run.restore()                 # 0 on a fresh start
    batches = iter(sampler.loader(dataset, num_workers=2))   # after restore: starts at the position
    while step < total_steps:
        for i in range(sampler.accum_steps):
            batch = next(batches)        # this rank's micro-batch of the step's global batch
            ...loss = loss_fn(batch) * sampler.loss_weight(len(batch)); loss.backward()...
        optimizer.step(); scheduler.step()
        step += 1
        run.step_done(step)              # advances the data position; saves every `save_every` steps
    run.close()

What a checkpoint holds: model, optimizer, LR scheduler, GradScaler, the RNG states (python,
numpy, torch CPU, every CUDA device), the data position and JSON-able user extras.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
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
    """Restores the newest good checkpoint at start and saves every `save_every` steps.

    `scheduler` and `scaler` are anything with state_dict/load_state_dict (an LR scheduler, a
    `torch.amp.GradScaler`). `extras` is a dict of JSON-able values saved with every checkpoint and
    updated in place by `restore()`. `on_rank_saved(step)` is a fault-injection point for tests: it
    runs right after this rank's files of `step` are written and before the group commits it.
    """

    def __init__(
        self,
        config: ResumeConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: _Stateful | None = None,
        scaler: _Stateful | None = None,
        sampler: ElasticSampler | None = None,
        extras: dict[str, Any] | None = None,
        topology: Topology | None = None,
        on_rank_saved: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        # Save the unwrapped module so a checkpoint does not depend on DDP's "module." prefix.
        self.model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.extras: dict[str, Any] = dict(extras or {})
        _check_json_able(self.extras)
        self.on_rank_saved = on_rank_saved
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
        """Load the newest checkpoint that every rank can read; return the step to continue from.

        Raises StateMismatchError when the checkpoint does not fit the model, optimizer or data
        settings (the message lists what differs), and ckpt's CheckpointVersionError when the
        newest checkpoint was written by a newer elastic-train.
        """
        step, state = self._agree_on_checkpoint()
        if state is None:
            log.info("no checkpoint in %s; starting from step 0", self.config.ckpt_dir)
            return 0
        self._apply(state, own_rank=self.checkpointer.has_rank(step, self.topology.rank))
        self.step = self.resumed_from = step
        saved_world = state.get("world_size")
        if saved_world != self.topology.world_size and self.sampler is not None:
            s = self.sampler
            log.info("world size %s -> %d: rank %d takes %d of the global batch %d in %d micro-batch(es)",
                     saved_world, self.topology.world_size, self.topology.rank, s.local_batch,
                     s.config.global_batch, s.accum_steps)
        log.info("resumed from step %d (%s)", step, self.config.ckpt_dir)
        return step

    def _agree_on_checkpoint(self) -> tuple[int, dict[str, Any] | None]:
        # Every rank must resume from the same step. Each proposes its newest readable checkpoint;
        # the group takes the minimum and checks that everyone can read it, else tries older ones.
        # A checkpoint of a newer format stops the whole group (every rank raises), not one rank.
        candidates = self.checkpointer.committed_steps()
        cap: int | None = None
        while True:
            mine, state, newer = -1, None, None
            for step in candidates:
                if cap is not None and step > cap:
                    continue
                try:
                    state = self._try_load(step)
                except CheckpointVersionError as exc:
                    newer = exc
                    break
                if state is not None:
                    mine = step
                    break
            agreed = self.topology.all_min(_NEWER_FORMAT if newer else mine)
            if agreed == _NEWER_FORMAT:
                self._raise_newer(newer)
            if agreed < 0:
                return -1, None
            if agreed != mine:
                try:
                    state = self._try_load(agreed)
                except CheckpointVersionError as exc:
                    newer, state = exc, None
            readable = _NEWER_FORMAT if newer else (0 if state is None else 1)
            verdict = self.topology.all_min(readable)
            if verdict == _NEWER_FORMAT:
                self._raise_newer(newer)
            if verdict == 1:
                assert state is not None
                return agreed, state
            cap = agreed - 1

    def _raise_newer(self, exc: CheckpointVersionError | None) -> None:
        # Falling back to an older step would silently throw away the newer run's progress.
        what = str(exc) if exc else "another rank found a checkpoint written by a newer elastic-train"
        raise CheckpointVersionError(
            f"cannot resume from {self.config.ckpt_dir}: {what}. Older checkpoints are not used in its place: "
            "run a newer elastic-train, or start from a fresh checkpoint directory",
            path=exc.path if exc else self.config.ckpt_dir) from exc

    def _try_load(self, step: int) -> dict[str, Any] | None:
        rank = self.topology.rank
        source = rank if self.checkpointer.has_rank(step, rank) else 0
        try:
            return self.checkpointer.load(step, rank=source)
        except CheckpointVersionError:
            raise
        except CheckpointError as exc:
            log.warning("skipping checkpoint step %d: %s", step, exc)
            return None

    def _apply(self, state: Mapping[str, Any], *, own_rank: bool) -> None:
        # Check everything before changing anything, so a mismatch leaves the live objects untouched.
        _check_shapes(self.model.state_dict(), state["model"])
        if self.optimizer is not None:
            _check_optimizer(self.optimizer, state.get("optimizer"))
        if self.sampler is not None:
            if state.get("data") is None:
                raise StateMismatchError("the checkpoint has no data position but this run has a sampler; "
                                         "resume without one, or start from a fresh --ckpt-dir")
            self.sampler.load_state_dict(state["data"])
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            saved = state.get(name)
            if obj is None:
                continue
            if not saved:  # absent, or a disabled GradScaler's empty state
                if obj.state_dict():
                    log.warning("the checkpoint has no %s state; this run's %s starts fresh", name, name)
                continue
            obj.load_state_dict(saved)
        self.extras.update(state.get("extras") or {})
        if own_rank:
            rng.restore(state["rng"])
        else:
            rng.derive(state["rng"], self.topology.rank)
            log.info("rank %d has no checkpoint file of its own in %s (the world size grew, or it moved to "
                     "another node); its RNG streams are derived from rank 0's and its rank",
                     self.topology.rank, self.config.ckpt_dir)

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
        """The tree a checkpoint holds (this rank's part)."""
        _check_json_able(self.extras)
        return {
            "step": self.step,
            "world_size": self.topology.world_size,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng.capture(),
            "extras": self.extras,
        }

    def save(self, step: int) -> None:
        """Write every rank's part of `step`, then commit it once all ranks have written."""
        try:
            self.checkpointer.save(step, self.state())
            ok = 1
            if self.on_rank_saved is not None:
                self.on_rank_saved(step)
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


_NEWER_FORMAT = -2  # all_min vote: "a checkpoint here was written by a newer elastic-train"


def _check_json_able(extras: dict[str, Any]) -> None:
    try:
        json.dumps(extras)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extras must be JSON-able (dicts with str keys, lists, str, int, float, bool, None): "
                         f"{exc}") from exc


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Any) -> None:
    if saved is None:
        raise StateMismatchError("the checkpoint has no optimizer state but this run has an optimizer; "
                                 "start from a fresh --ckpt-dir")
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    problems = []
    if len(groups) != len(saved_groups):
        problems.append(f"{len(saved_groups)} parameter group(s) in the checkpoint, {len(groups)} now")
    for i, (g, sg) in enumerate(zip(groups, saved_groups, strict=False)):
        if len(g["params"]) != len(sg["params"]):
            problems.append(f"group {i} has {len(sg['params'])} parameters in the checkpoint, {len(g['params'])} now")
        keys, saved_keys = set(g) - {"params"}, set(sg) - {"params"}
        # One-sided differences are how torch versions add options; both sides differing is another class.
        if keys - saved_keys and saved_keys - keys:
            problems.append(f"group {i} hyperparameters differ (another optimizer class?): only in the checkpoint "
                            f"{sorted(saved_keys - keys)}, only now {sorted(keys - saved_keys)}")
    if problems:
        raise StateMismatchError(f"the checkpoint's optimizer state does not fit this {type(optimizer).__name__}: "
                                 + "; ".join(problems) + ". Resume with the same optimizer, or start from a fresh --ckpt-dir.")


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
