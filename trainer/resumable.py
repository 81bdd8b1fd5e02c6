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

What a checkpoint holds: model, optimizer (and the model's name of each of its parameters), LR
scheduler, GradScaler, the RNG states (python, numpy, torch CPU, every CUDA device), the data
position and JSON-able user extras (the caller's own dict, read at each save).

A restore checks the whole tree before it changes anything (trainer/validate.py): a malformed
tree is skipped like a damaged file, in favour of an older step; one that does not fit this run
raises StateMismatchError.
"""

from __future__ import annotations

import json
import logging
import os
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
    CheckpointSaveError,
    CheckpointVersionError,
    Restored,
    SharedConfig,
)
from core import faults
from core.events import emit
from elastic import worker
from trainer import rng
from trainer.data import ElasticSampler
from trainer.ddp import layout_is_stable
from trainer.digest import training_digest
from trainer.errors import InvalidStateError, StateMismatchError
from trainer.topology import Topology
from trainer.validate import check_state, param_names

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
    """The run's identity (recorded in every checkpoint, its prefix under shared_url); the same on every rank and restart."""
    shared_storage_options: dict[str, Any] | None = None
    """fsspec options of shared_url, e.g. {"endpoint_url": ...}."""
    keep_last_shared: int = 3
    """Committed checkpoints kept under shared_url."""
    keep_every: int | None = None
    """Steps that are multiples of this are kept under shared_url forever."""
    init_from: str | None = None
    """Path or fsspec URL of another run's checkpoints to start from when this run has none (fine-tuning)."""
    max_failed_saves: int | None = 3
    """Saves failing in a row before the job stops with CheckpointSaveError (None: never; only logged)."""

    def __post_init__(self) -> None:
        if self.save_every <= 0:
            raise ValueError(f"save_every must be positive, got {self.save_every}")
        if not self.ckpt_dir:
            raise ValueError("ckpt_dir must be a directory path")


class Resumable:
    """Restores the newest good checkpoint at start and saves every `save_every` steps.

    `scheduler` and `scaler` are anything with state_dict/load_state_dict (an LR scheduler, a
    `torch.amp.GradScaler`). `extras` is the caller's own dict of JSON-able values, kept, not
    copied (`run.extras` is the same object): every save stores its contents at that moment, and
    `restore()` updates it in place with the checkpoint's (keys the checkpoint lacks are kept).
    `on_rank_saved(step)` is a fault-injection point for tests: it
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
        worker.bootstrap()  # parent watch and peer-loss hook under an elastic agent
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
        if extras is not None and not isinstance(extras, dict):
            raise ValueError(f"extras must be a dict (it is kept and updated in place), got {type(extras).__name__}")
        self.extras: dict[str, Any] = extras if extras is not None else {}  # the caller's dict itself
        _check_json_able(self.extras)
        self.on_rank_saved = on_rank_saved
        shared = None
        if config.shared_url:
            shared = SharedConfig(url=config.shared_url, storage_options=config.shared_storage_options or {},
                                  keep_last=config.keep_last_shared, keep_every=config.keep_every)
        self.checkpointer = Checkpointer(
            CheckpointConfig(local_dir=config.ckpt_dir, keep_last=config.keep_last, shared=shared,
                             run_name=config.run_name, init_from=config.init_from,
                             max_failed_saves=config.max_failed_saves),
            rank=self.topology.rank,
            world_size=self.topology.world_size,
            # fault injection: once this rank's files are fsynced, before publish and commit
            on_written=self._rank_saved,
        )
        self.step = 0
        self.resumed_from: int | None = None
        self.restored: Restored | None = None
        """What `restore` loaded: the step, whose part (rank), from which tier and path."""
        t = self.topology
        emit("worker_started", rank=t.rank, world=t.world_size, local_rank=t.local_rank,
             restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def _rank_saved(self, step: int) -> None:
        # On the writer thread, once this rank's files of `step` are written, before the commit.
        faults.fire("save", step)
        if self.on_rank_saved is not None:
            self.on_rank_saved(step)

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
            self._started(0)
            return 0
        state = restored.state
        self._apply(state, own_rank=restored.own)
        self.restored = restored
        emit("restored", step=restored.step, tier=restored.tier, source_rank=restored.rank, path=restored.path)
        self.checkpointer.prepare(self.state())
        self.step = self.resumed_from = step
        saved_world = state.get("world_size")
        if saved_world != self.topology.world_size and self.sampler is not None:
            s = self.sampler
            log.info("world size %s -> %d: rank %d takes %d of the global batch %d in %d micro-batch(es)",
                     saved_world, self.topology.world_size, self.topology.rank, s.local_batch,
                     s.config.global_batch, s.accum_steps)
        log.info("resumed from step %d (%s)", step, self.config.ckpt_dir)
        self._started(step)
        return step

    def _started(self, step: int) -> None:
        emit("resumed", step=step)
        faults.fire("step", step)  # the fault point before the first step this incarnation runs

    def _agree_on_checkpoint(self) -> tuple[int, Restored | None]:
        # Every rank must resume from the same step. Each proposes its newest readable checkpoint
        # (local tier, else shared tier); the group takes the minimum, every rank loads that step
        # and checks its whole state tree, and the group votes: all usable, done; any rank that
        # cannot read it or finds it malformed, everyone tries older steps; a checkpoint of a newer
        # format or one that does not fit this run stops the whole group.
        cap: int | None = None
        while True:
            problem: Exception | None = None
            try:
                found = self.checkpointer.restore(max_step=cap)
            except CheckpointVersionError as exc:
                found, problem = None, exc
            mine = found.step if found is not None else -1
            agreed = self.topology.all_min(_NEWER_FORMAT if problem else mine)
            if agreed == _NEWER_FORMAT:
                self._raise_newer(problem)
            if agreed < 0:
                return -1, None
            if agreed != mine:
                try:
                    found = self.checkpointer.restore(step=agreed)
                except CheckpointVersionError as exc:
                    found, problem = None, exc
            vote, problem = self._judge(found, problem)
            verdict = self.topology.all_min(vote)
            if verdict == _NEWER_FORMAT:
                self._raise_newer(problem)
            if verdict == _MISMATCH:
                if isinstance(problem, StateMismatchError):
                    raise problem
                raise StateMismatchError(f"another rank found that step {agreed} in {self.config.ckpt_dir} does not "
                                         "fit its model, optimizer or data settings; its log says what differs")
            if verdict == _USABLE:
                assert found is not None
                return agreed, found
            cap = agreed - 1

    def _judge(self, found: Restored | None, problem: Exception | None) -> tuple[int, Exception | None]:
        """This rank's vote on the loaded checkpoint `found`, and the error behind it."""
        if isinstance(problem, CheckpointVersionError):
            return _NEWER_FORMAT, problem
        if found is None:
            return _UNREADABLE, None
        try:
            check_state(found.state, model=self.model, optimizer=self.optimizer, sampler=self.sampler)
        except InvalidStateError as exc:
            log.warning("skipping checkpoint step %d: the %s copy %s holds a malformed state (damaged or not "
                        "written by elastic-train): %s; trying an older step", found.step, found.tier, found.path, exc)
            emit("ckpt_skipped", step=found.step, reason=f"malformed state in the {found.tier} copy {found.path}: {exc}")
            return _UNREADABLE, exc
        except StateMismatchError as exc:
            return _MISMATCH, exc
        return _USABLE, None

    def _raise_newer(self, exc: CheckpointVersionError | None) -> None:
        # Falling back to an older step would silently throw away the newer run's progress.
        what = str(exc) if exc else "another rank found a checkpoint written by a newer elastic-train"
        raise CheckpointVersionError(
            f"cannot resume from {self.config.ckpt_dir}: {what}. Older checkpoints are not used in its place: "
            "run a newer elastic-train, or start from a fresh checkpoint directory",
            path=exc.path if exc else self.config.ckpt_dir) from exc

    def _apply(self, state: Mapping[str, Any], *, own_rank: bool) -> None:
        # `state` passed check_state (in _judge): nothing below is expected to fail half-way.
        if self.sampler is not None:
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
        self.extras.update(state.get("extras") or {})  # in place: the caller's dict
        if own_rank:
            rng.restore(state["rng"])
        else:
            rng.derive(state["rng"], self.topology.rank)
            log.info("rank %d has no checkpoint file of its own in %s (the world size grew, or it moved to "
                     "another node); its RNG streams are derived from rank 0's and its rank",
                     self.topology.rank, self.config.ckpt_dir)

    # -- save ------------------------------------------------------------------------------------

    def step_done(self, step: int, *, loss: float | torch.Tensor | None = None) -> bool:
        """Call after each completed optimizer step with the number of completed steps.

        Advances the data position; saves when `step` is a multiple of `save_every`. Returns True if it saved.
        `loss` (optional) goes into the `step` event; a tensor is read with .item() (a device sync).
        """
        self.step = step
        worker.beat(step)  # lets elastic-run's agent tell a hung worker from a slow one
        if self.sampler is not None:
            self.sampler.advance(step)
        fields: dict[str, Any] = {"step": step}
        if loss is not None:
            fields["loss"] = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
        emit("step", **fields)
        saved = step % self.config.save_every == 0
        if saved:
            self.save(step)
        faults.fire("step", step)  # before the loop runs step `step + 1`
        return saved

    def state(self) -> dict[str, Any]:
        """The tree a checkpoint holds (this rank's part)."""
        _check_json_able(self.extras)
        return {
            "step": self.step,
            "world_size": self.topology.world_size,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "param_names": param_names(self.model, self.optimizer) if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng.capture(),
            "extras": self.extras,
        }

    def save(self, step: int) -> None:
        """Snapshot this rank's state for `step`; writing, committing and uploading run in the
        background (no collective here: the last local rank commits tier 1, rank 0 tier 2).

        A failed save is logged and training goes on, until `max_failed_saves` fail in a row:
        then CheckpointSaveError (naming the directory and the cause) stops the job."""
        try:
            self.checkpointer.save_async(step, self.state())
        except CheckpointSaveError:
            raise
        except CheckpointError as exc:
            log.error("checkpoint of step %d failed on rank %d: %s", step, self.topology.rank, exc)
            emit("ckpt_failed", step=step, tier="local", error=str(exc))

    def close(self) -> None:
        """Flush the save in flight and pending uploads (bounded), then stop the checkpointer's threads.

        Raises CheckpointSaveError when the last `max_failed_saves` saves failed (no later save
        would have noticed)."""
        worker.finish()  # flushing may outlast elastic-run's --hang-timeout; nothing is stuck
        if not self.checkpointer.close(timedelta(minutes=5)):
            log.warning("rank %d: checkpoint work left unfinished at close: %s", self.topology.rank,
                        self.checkpointer.last_error)
        self.checkpointer.check()
        if self.sampler is not None and self.sampler.sample_log is not None:
            self.sampler.sample_log.close()

    def final_digest(self) -> str:
        """The digest of the model's and optimizer's state (trainer.training_digest), also emitted as
        the `final_digest` event: call it once training is over, on every rank."""
        digest = training_digest(self.model, self.optimizer)
        emit("final_digest", step=self.step, digest=digest)
        return digest


# all_min votes on a checkpoint; the smallest wins.
_USABLE = 1
_UNREADABLE = 0  # this rank cannot read it, or its state is malformed: try an older step
_NEWER_FORMAT = -2  # written by a newer elastic-train: stop
_MISMATCH = -3  # does not fit this run's model, optimizer or data settings: stop


def _check_json_able(extras: dict[str, Any]) -> None:
    try:
        json.dumps(extras)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extras must be JSON-able (dicts with str keys, lists, str, int, float, bool, None): "
                         f"{exc}") from exc
