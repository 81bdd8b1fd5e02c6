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
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from ckpt import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    Restored,
    SharedConfig,
    check_compatible,
)
from elastic import orphan, progress
from trainer import rng
from trainer.data import ElasticSampler
from trainer.ddp import layout_is_stable
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
    shared_url: str | None = None
    """Tier 2: fsspec URL of shared storage (a mounted path, s3://bucket/prefix, ...), or None."""
    run_name: str = "default"
    """Run-scoped prefix under shared_url; the same on every rank and every restart of one run."""
    shared_storage_options: dict[str, Any] | None = None
    """fsspec options of shared_url, e.g. {"endpoint_url": ...}."""
    keep_last_shared: int = 3
    """Committed checkpoints kept under shared_url."""
    keep_every: int | None = None
    """Steps that are multiples of this are kept under shared_url forever."""

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
        self.topology = topology or Topology.from_env()
        if orphan.under_agent():
            orphan.exit_with_parent()  # a worker whose agent was SIGKILLed must not linger
        if self.topology.world_size >= 3 and not layout_is_stable(model):
            log.info("this DDP rebuilds its gradient buckets after its first iteration, so with %d ranks the first "
                     "step after a resume rounds differently from an uninterrupted run (resume stays correct, "
                     "not bitwise); wrap the model with trainer.wrap_ddp for bitwise resume", self.topology.world_size)
        # Save the unwrapped module so a checkpoint does not depend on DDP's "module." prefix.
        self.model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.extras: dict[str, Any] = dict(extras or {})
        _check_json_able(self.extras)
        self.on_rank_saved = on_rank_saved
        shared = None
        if config.shared_url:
            shared = SharedConfig(url=config.shared_url, run_name=config.run_name,
                                  storage_options=config.shared_storage_options or {},
                                  keep_last=config.keep_last_shared, keep_every=config.keep_every)
        self.checkpointer = Checkpointer(
            CheckpointConfig(local_dir=config.ckpt_dir, keep_last=config.keep_last, shared=shared),
            rank=self.topology.rank,
            world_size=self.topology.world_size,
            # fault injection: once this rank's files are fsynced, before publish and commit
            on_written=on_rank_saved,
        )
        self.step = 0
        self.resumed_from: int | None = None
        self.restored: Restored | None = None
        """What `restore` loaded: the step, whose part (rank), from which tier and path."""

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest checkpoint that every rank can read; return the step to continue from.

        Raises StateMismatchError when the checkpoint does not fit the model, optimizer or data
        settings (the message lists what differs), and ckpt's CheckpointVersionError when the
        newest checkpoint was written by a newer elastic-train.
        """
        # One token per incarnation: commits never count a rank directory a crashed earlier
        # incarnation left behind (all_min of random numbers is a random number all ranks share).
        self.checkpointer.set_generation(f"{self.topology.all_min(secrets.randbits(62)):x}")
        step, restored = self._agree_on_checkpoint()
        if restored is None:
            log.info("no checkpoint in %s; starting from step 0", self.config.ckpt_dir)
            self.checkpointer.prepare(self.state())  # staging buffer allocated before the loop
            return 0
        state = restored.state
        self._apply(state, own_rank=restored.own)
        self.restored = restored
        self.checkpointer.prepare(self.state())
        self.step = self.resumed_from = step
        saved_world = state.get("world_size")
        if saved_world != self.topology.world_size and self.sampler is not None:
            s = self.sampler
            log.info("world size %s -> %d: rank %d takes %d of the global batch %d in %d micro-batch(es)",
                     saved_world, self.topology.world_size, self.topology.rank, s.local_batch,
                     s.config.global_batch, s.accum_steps)
        log.info("resumed from step %d (%s)", step, self.config.ckpt_dir)
        return step

    def _agree_on_checkpoint(self) -> tuple[int, Restored | None]:
        # Every rank must resume from the same step. Each proposes its newest readable checkpoint
        # (local tier, else shared tier); the group takes the minimum and checks that everyone can
        # read it, else tries older ones. A checkpoint of a newer format stops the whole group.
        cap: int | None = None
        while True:
            newer: CheckpointVersionError | None = None
            try:
                found = self.checkpointer.restore(max_step=cap)
            except CheckpointVersionError as exc:
                found, newer = None, exc
            mine = found.step if found is not None else -1
            agreed = self.topology.all_min(_NEWER_FORMAT if newer else mine)
            if agreed == _NEWER_FORMAT:
                self._raise_newer(newer)
            if agreed < 0:
                return -1, None
            if agreed != mine:
                try:
                    found = self.checkpointer.restore(step=agreed)
                except CheckpointVersionError as exc:
                    newer, found = exc, None
            readable = _NEWER_FORMAT if newer else (0 if found is None else 1)
            verdict = self.topology.all_min(readable)
            if verdict == _NEWER_FORMAT:
                self._raise_newer(newer)
            if verdict == 1:
                assert found is not None
                return agreed, found
            cap = agreed - 1

    def _raise_newer(self, exc: CheckpointVersionError | None) -> None:
        # Falling back to an older step would silently throw away the newer run's progress.
        what = str(exc) if exc else "another rank found a checkpoint written by a newer elastic-train"
        raise CheckpointVersionError(
            f"cannot resume from {self.config.ckpt_dir}: {what}. Older checkpoints are not used in its place: "
            "run a newer elastic-train, or start from a fresh checkpoint directory",
            path=exc.path if exc else self.config.ckpt_dir) from exc

    def _apply(self, state: Mapping[str, Any], *, own_rank: bool) -> None:
        # Check everything before changing anything, so a mismatch leaves the live objects untouched.
        try:
            check_compatible(state["model"], self.model.state_dict())
        except CheckpointMismatchError as exc:
            raise StateMismatchError(str(exc)) from exc
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
        """Snapshot this rank's state for `step`; writing, committing and uploading run in the
        background (no collective here: the last local rank commits tier 1, rank 0 tier 2)."""
        try:
            self.checkpointer.save_async(step, self.state())
        except CheckpointError as exc:
            log.error("checkpoint of step %d failed on rank %d: %s", step, self.topology.rank, exc)

    def close(self) -> None:
        """Flush the save in flight and pending uploads (bounded), then stop the checkpointer's threads."""
        progress.finish()  # flushing may outlast elastic-run's --hang-timeout; nothing is stuck
        if not self.checkpointer.close(timedelta(minutes=5)):
            log.warning("rank %d: checkpoint work left unfinished at close: %s", self.topology.rank,
                        self.checkpointer.last_error)


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
