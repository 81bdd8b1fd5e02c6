"""`Resumable`: the small object a user's own training loop calls to restore at start and save at
step boundaries.

    sampler = ElasticSampler(DataConfig(dataset_size=len(ds), global_batch=256, max_micro_batch=32))
    with Resumable(ResumeConfig.at("/nvme/ckpt", save_every=100), model=ddp, optimizer=opt,
                   scheduler=sched, sampler=sampler) as run:
        step = run.restore()                              # 0 on a fresh start
        batches = iter(sampler.loader(ds, num_workers=2))  # after restore: starts at the position
        while step < total_steps:
            opt.zero_grad(set_to_none=True)
            for (x, y), weight, sync in run.accumulate(batches):  # no_sync but on the last one
                with sync:
                    loss = loss_fn(ddp(x), y) * weight
                    loss.backward()
            opt.step(); sched.step()
            step += 1
            run.step_done(step)        # advances the data position; saves every `save_every` steps
        run.teardown(batches)          # saves the last step, closes, digest, frees the process group

What a checkpoint holds: model, optimizer (and the model's name of each of its parameters), LR
scheduler, GradScaler, the RNG states (python, numpy, torch CPU, every CUDA device), the data
position and JSON-able user extras (the caller's own dict, read at each save).

A sharded model (FSDP2 `fully_shard`, tensor parallel `parallelize_module`, a 2-D mesh of both: any
DTensor parameter) is saved by parameter name from `get_state_dict`, each rank its shards, with the
layout ({"dp": D, "tp": T}); a restore reshards into this run's layout (`Checkpointer.restore(into=)`)
and applies it with `set_state_dict`. The data position and the sample log are per data-parallel
rank (trainer/sharding.py); the RNG streams are restored exactly when the layout is the saved one,
else derived per data-parallel rank (the same for the TP peers of one). See `Resumable`'s `mesh`.

A restore checks the whole tree before it changes anything (trainer/validate.py): a malformed
tree is skipped like a damaged file, in favour of an older step (trainer/agree.py); one that does
not fit this run raises StateMismatchError.

Events (core/events.py): `worker_started`, `restored`, `resumed`, `step`, `ckpt_failed`,
`final_digest` (and `ckpt_skipped` from the agreement). Fault points (core/faults.py): `step`
after each completed step (and after the restore), `save` once this rank's files are written,
`join` before a kept worker joins the agent's new round (trainer/regroup.py).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import partial
from types import TracebackType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ckpt import Checkpointer, CheckpointError, CheckpointSaveError, Restored, SharedStorageError
from ckpt.snapshot import StateMark
from ckpt.tree import Flat
from core import faults
from core.events import emit
from elastic import worker
from elastic.errors import EXIT_BELOW_MIN
from elastic.reform import Round
from trainer import apply_state, in_place, part_transfer, regroup, rng, setup, sharding
from trainer.accumulate import accumulate
from trainer.agree import agree_on_checkpoint, all_rejected
from trainer.apply_state import Stateful
from trainer.cadence import Cadence
from trainer.config import ResumeConfig
from trainer.data import RESUME_HINT, ElasticSampler
from trainer.ddp import release_process_group
from trainer.deferred import DeferredSaves, NextForward
from trainer.digest import state_digests_on, training_digest
from trainer.errors import RoundChanged, StateMismatchError, UsageError
from trainer.sharding import Layout
from trainer.state_view import Boundary, ParamKey, StateView, copy_plain, param_key
from trainer.telemetry import Telemetry
from trainer.topology import Topology
from trainer.validate import check_state, optimizer_class, param_names

log = logging.getLogger(__name__)


class Resumable:
    """Restores the newest good checkpoint at start and saves every `save_every` steps.

    `model` may be the DDP wrapper (its module is what is saved; `accumulate` uses its no_sync).
    `scheduler` and `scaler` are anything with state_dict/load_state_dict (an LR scheduler, a
    `torch.amp.GradScaler`). `extras` is the caller's own dict of JSON-able values, kept, not
    copied (`run.extras` is the same object): every save stores its contents at that moment, and
    `restore()` updates it in place with the checkpoint's (keys the checkpoint lacks are kept).
    `topology` defaults to this process's place in the job; a `sampler` must agree with it.

    A sharded `model` (DTensor parameters) needs `mesh`, the DeviceMesh it is laid out on, unless it
    is 1-D FSDP over the whole world: the mesh's "dp" dim (or "dp_*" dims) is data-parallel, the
    others (e.g. "tp") model-parallel, and the sampler must be for this rank's data-parallel
    coordinate (`ElasticSampler(config, mesh=mesh)`). Seed every rank alike at start: the TP peers
    of one data-parallel rank must draw the same random numbers (dropout on replicated activations).

    With `ResumeConfig.ckpt.mode == "overlapped"` a save returns before its copy of the state is
    done; the optimizer's step (and the model's forward, when it has buffers a forward may update)
    waits for it through hooks registered here, so the loop needs nothing extra.

    Use it as a context manager: leaving the block closes it (flushes the save in flight).
    """

    def __init__(
        self,
        config: ResumeConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        sampler: ElasticSampler | None = None,
        extras: dict[str, Any] | None = None,
        topology: Topology | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        setup.check_arguments(config, model, optimizer, sampler, {"scheduler": scheduler, "scaler": scaler})
        self.config = config
        self.topology = topology or Topology.from_env()
        worker.bootstrap()  # parent watch and peer-loss hook, under an elastic agent
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        # Save the unwrapped module so a checkpoint does not depend on DDP's "module." prefix.
        self.model: torch.nn.Module = self.ddp.module if self.ddp is not None else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sharded = sharding.is_sharded(self.model)
        self.layout = setup.layout(self.model, mesh, self.topology, sharded=self.sharded)
        """This rank's data-parallel coordinate and the parallel degrees (trainer/sharding.py)."""
        self.sampler = setup.checked_sampler(sampler, self.topology, self.layout)
        self.extras: dict[str, Any] = setup.own_extras(extras)  # the caller's dict itself
        setup.hint_unstable_layout(model, self.topology.world_size)
        # Peer replicas of tier 0 only for sharded state: a replicated one is whole on every surviving node.
        ckpt_config = config.ckpt if self.sharded else dataclasses.replace(config.ckpt, replicas=0)
        self.checkpointer = Checkpointer(ckpt_config, rank=self.topology.rank, world_size=self.topology.world_size,
                                         on_written=_save_hook())
        self._view = StateView(self.state, self.model, self.optimizer)
        self._later = NextForward(self.model)
        """What step_done leaves until the next forward is queued (trainer/deferred.py)."""
        self._beaten = False  # whether this process reported progress to its agent yet (step_done)
        self._deferred = (DeferredSaves(self._later, self._finish_deferred) if config.defer_snapshots and
                          DeferredSaves.applies(self.model, optimizer, mode=config.ckpt.mode, sharded=self.sharded,
                                                    tier0=self.checkpointer.has_tier0) else None)
        """Snapshots and persists from step_done finished once the next forward is queued (trainer/deferred.py)."""
        self._hooks = self._wait_for_copy_hooks() if config.ckpt.mode == "overlapped" else []
        self.telemetry = Telemetry.for_run(self)  # metrics for elastic-run's agent (trainer/telemetry.py)
        self.step = 0
        self.resumed_from: int | None = None
        self._names_cache: tuple[ParamKey, list[list[str | None]]] | None = None
        self.restored: Restored | None = None
        """What `restore` loaded: the step, whose part (rank), from which tier and path."""
        self._restore_started, self._prepare_s = time.monotonic(), 0.0  # timings of the `resumed` event
        self._saved_step = -1
        self._cadence = Cadence(config)  # which steps persist or snapshot (trainer/cadence.py)
        self._closed = False
        self._restored_once = False  # saves only after restore(): else a run would overwrite its own checkpoints
        # In-process re-formation (trainer/regroup.py): the step held live in memory, whether the optimizer
        # has stepped past it, and the RNG streams at that step boundary.
        self._live_step = -1
        self._stepped = False
        self._boundary_rng: dict[str, Any] | None = None
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_post_hook(self._optimizer_stepped))
        # A sharded model re-forms in place only by running the training function again (trainer/in_place.py).
        self._rounds = (regroup.round_watcher() if (not self.sharded or in_place.active()) and dist.is_available()
                        and dist.is_initialized() else None)
        self.reformed_in_place = False
        """Whether this incarnation began with a re-formation in place (a sharded run re-entered: run_elastic)."""
        t = self.topology
        emit("worker_started", rank=t.rank, world=t.world_size, local_rank=t.local_rank,
             restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def __enter__(self) -> Resumable:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:  # the loop's own error is the one to see; a failure to flush is only logged
            self.close()
        except Exception as close_error:
            log.error("rank %d: closing the checkpointer after the loop failed: %s", self.topology.rank, close_error)

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest checkpoint that every rank can read; return the step to continue from.

        Raises StateMismatchError when the checkpoint does not fit the model, optimizer or data
        settings (the message lists what differs), and ckpt's CheckpointVersionError when the
        newest checkpoint was written by a newer elastic-train.
        """
        self._restore_started, self._prepare_s = time.monotonic(), 0.0
        reentry = in_place.take()
        caught = self._join_group()
        if caught is not None:
            self._declare_ready()
            step = self._started(caught)
        else:
            step = self._restore_from_checkpoints()
            self._declare_ready()
        if reentry is not None and reentry.joined is not None:
            self.reformed_in_place = True
            self._reformed(reentry.joined, step, reentry.started)
        self._restored_once = True
        return step

    def _join_group(self) -> int | None:
        """The first collectives of a restore or a re-formation, the same on every rank of the group:
        take a live state from memory or a peer (trainer/regroup.py), then the incarnation token."""
        loaded: list[Restored] = []  # the own part catch_up loaded, to report its tier

        def load_own(step: int) -> Restored | None:
            found = self.checkpointer.restore(step=step, replicated=False, detach=False, if_unsure="none")
            loaded[:] = [found] if found is not None else []
            return found

        caught = regroup.catch_up(
            self.topology, -1 if self._stepped else self._live_step, load_own=load_own,
            apply_own=lambda r: apply_state.whole(self, r.state, own_rank=True), state=self.state,
            apply_peer=lambda state: apply_state.whole(self, state, own_rank=False), has_own=self._has_own_checkpoint)
        # One token per incarnation: commits never count a rank directory a crashed earlier
        # incarnation left behind (all_min of random numbers is a random number all ranks share).
        self.checkpointer.set_generation(f"{self.topology.all_min(secrets.randbits(62)):x}")
        if caught is None:
            return None
        step, source = caught
        return self._continue_from(step, source, own=next((r for r in loaded if r.step == step), None))

    def _has_own_checkpoint(self) -> bool:
        found = self.checkpointer.restore(replicated=False, detach=False, if_unsure="none")
        return found is not None and found.own

    def _continue_from(self, step: int, source: str, own: Restored | None = None) -> int:
        """The bookkeeping of a state taken from memory, an own checkpoint part (`own`: the one loaded, whose
        tier the `restored` event names) or a peer (trainer/regroup.py)."""
        if source == "own" and own is not None:
            self.restored = own
            emit("restored", step=step, tier=own.tier, source_rank=own.rank, path=own.path)
        elif source != "memory":
            emit("restored", step=step, tier="peer" if source == "peer" else "own", source_rank=None, path=None)
        elif self._boundary_rng is not None:
            rng.restore(self._boundary_rng)  # draws of the interrupted step are void
        self._prepare()
        self.step = step
        if source == "own":  # a part of a checkpoint: saved. Memory or a peer's state is in no tier of this node yet
            self._saved_step = step  # (below the minimum of nodes, a survivor re-formed at step S persisted nothing)
        if source != "memory":
            self._emit_digest(step, "restore")
        if self.resumed_from is None:
            self.resumed_from = step
        self._mark_live(step)
        return step

    def _restore_from_checkpoints(self) -> int:
        # A sharded run's own tree is the layout its DTensors are restored into.
        template = self.state() if self.sharded else None
        by_name: list[dict[str, Any]] = []  # a plain run's tree by parameter name, made for a sharded checkpoint

        def template_for(restored: Restored) -> dict[str, Any] | None:
            # A sharded run's checkpoint (its tree has a layout) comes back whole into a plain model (evaluation,
            # export, fine-tuning on one device): checked and applied by parameter name, as a sharded run's is.
            if template is not None or "layout" not in restored.state:
                return template
            if not by_name:
                by_name.append(self._tree(*sharding.model_state(self.model, self.optimizer), None))
            return by_name[0]

        def check(restored: Restored) -> None:
            try:
                check_state(restored.state, model=self.model, optimizer=self.optimizer, sampler=self.sampler,
                            template=template_for(restored), step=restored.step, stateful=self._stateful())
            except StateMismatchError as exc:
                if not restored.init_from:  # named: which step, which copy (several runs may share a machine)
                    raise StateMismatchError(f"checkpoint step {restored.step}, {restored.tier} copy "
                                             f"{restored.path}: {exc}") from exc
                # Not this run's own checkpoint: "a fresh --ckpt-dir" would not help.
                why = str(exc).replace(RESUME_HINT, "")
                raise StateMismatchError(
                    f"init_from={self.config.ckpt.init_from} (step {restored.step}) does not fit this run: {why} "
                    "A run started with init_from continues that run whole (model, optimizer, step, data position "
                    "and settings); to fine-tune on other data, load only the weights into the model before "
                    "Resumable(...) and leave init_from unset.") from exc

        rejected: dict[int, Exception | None] = {}  # steps judged malformed (trainer/agree.py)

        def agree() -> Restored | None:
            try:
                return agree_on_checkpoint(self.checkpointer, self.topology, where=self.config.ckpt_dir,
                                           into=template, check=check, rejected=rejected)
            except Exception:
                if self.sharded or by_name:  # nothing loaded: not the state get_state_dict gave a fresh optimizer
                    sharding.forget_optimizer_state(self.optimizer)
                raise

        restored = agree()
        if restored is None and not self.sharded:
            # Not every rank can read a checkpoint (a replacement node's empty --ckpt-dir): a peer's, sent
            # over the group, rather than everyone starting over.
            peer = regroup.peer_checkpoint(
                self.topology, self.checkpointer.restore(if_unsure="none"),
                check=lambda r: check_state(r.state, model=self.model, optimizer=self.optimizer,
                                            sampler=self.sampler, step=r.step, stateful=self._stateful()),
                apply_own=lambda r: apply_state.whole(self, r.state, own_rank=True),
                apply_peer=lambda state: apply_state.whole(self, state, own_rank=False))
            if peer is not None:
                return self._started(self._continue_from(*peer))
        if restored is None and self.sharded and part_transfer.send_missing_parts(self.checkpointer, self.topology):
            restored = agree()  # the parts some ranks lacked are in their tier 0 now
        if restored is None and self.sharded:
            part_transfer.refuse_to_start_over(self.checkpointer, self.topology, self.config.ckpt_dir)
        if restored is None and self.topology.all_min(-int(self.checkpointer.restore_blocked is not None)) < 0:
            # Some rank could not tell whether a newer step exists (the shared tier unreachable), and no rank had
            # a state to send: starting over would throw that progress away (its first save removes the newer).
            raise self.checkpointer.restore_blocked or SharedStorageError(
                f"another rank could not read the shared tier of {self.config.ckpt_dir}: not starting over from "
                "step 0. Start the job again once the store answers")
        if restored is None and rejected:
            # Every step the group holds was judged malformed and no peer had a state: starting over would remove
            # them at the first save (the same steps on every rank: each raises).
            if self.sharded or by_name:
                sharding.forget_optimizer_state(self.optimizer)
            raise all_rejected(rejected, self.config.ckpt_dir)
        if restored is None and self.step > 0:
            # A re-formation that found neither a live state (every rank had stepped past it) nor a checkpoint: the
            # model here is past step `self.step`, and going on from step 0 would train it twice. This worker
            # exits and restarts, as without in-process re-formation.
            raise RuntimeError(f"rank {self.topology.rank}: re-formed with no state to go on from (no live step, no "
                               f"checkpoint in {self.config.ckpt_dir}); restarting this worker from step 0")
        if restored is None:
            log.info("no checkpoint in %s; starting from step 0", self.config.ckpt_dir)
            self._prepare()  # staging buffer allocated before the loop
            if self.sharded or by_name:  # after _prepare, which sizes the staging with these state tensors (before
                # it, a sharded run's first checkpoints held other optimizer state: test_sharded_start_over.py)
                sharding.forget_optimizer_state(self.optimizer)  # the template's, made by get_state_dict
            self._mark_live(0)
            return self._started(0)
        if template_for(restored) is not None:
            apply_state.sharded(self, restored)
        else:
            apply_state.whole(self, restored.state, own_rank=restored.own)
        self.restored = restored
        emit("restored", step=restored.step, tier=restored.tier, source_rank=restored.rank, path=restored.path)
        self._prepare()
        self.step = self.resumed_from = self._saved_step = restored.step
        self._emit_digest(restored.step, "restore")
        saved_world = restored.state.get("world_size")
        if saved_world != self.topology.world_size and self.sampler is not None:
            s = self.sampler
            log.info("world size %s -> %d: rank %d takes %d of the global batch %d in %d micro-batch(es)",
                     saved_world, self.topology.world_size, self.topology.rank, s.local_batch,
                     s.config.global_batch, s.accum_steps)
        log.info("resumed from step %d (%s)", restored.step, self.config.ckpt_dir)
        self._mark_live(restored.step)
        return self._started(restored.step)

    def _prepare(self) -> None:
        """The staging buffer or tier-0 slots mapped (and page-locked for CUDA state) before the loop, timed."""
        started = time.monotonic()
        self.checkpointer.prepare(self.state())
        self._prepare_s += time.monotonic() - started

    def _started(self, step: int) -> int:
        # restore_s: the whole restore(); prepare_s: the part spent mapping and page-locking the staging memory
        emit("resumed", step=step, restore_s=round(time.monotonic() - self._restore_started, 4),
             prepare_s=round(self._prepare_s, 4))
        self.telemetry.resumed(step, self.restored)
        faults.fire("step", step)  # the fault point before the first step this incarnation runs
        return step

    # -- in-process re-formation (trainer/regroup.py, elastic/reform.py) ----------------------------

    def reform(self, error: BaseException | None = None) -> int:
        """After a step failed with `error` (or at a step boundary): re-form the process group in place
        if the agent has a new round, and return the step to continue from. Re-raises `error` otherwise.

        Under elastic-run (`--reform in-process`, the default) a membership change does not restart
        this process: the agent publishes the next round, the collective in flight fails, and this
        joins the new group (new rank and world size), rebuilds the DDP wrapper in place, re-partitions
        the sampler and agrees with the group on the step (the interrupted step is discarded). Make a
        new data iterator afterwards: `iter(sampler.loader(...))`."""
        started = time.monotonic()
        self._later.flush()  # a snapshot's rest: the state is still the boundary's (the optimizer has not stepped)
        if self.sharded and self._rounds is not None:  # joined by run_elastic, once the old model is gone
            self._reenter(regroup.next_round(self._rounds, error), error, started)
        if self._rounds is not None and self.ddp is not None and (self._rounds.newest() is not None or error):
            # DDP's reducer holds the old group: without it the group's sockets close when it is destroyed,
            # so a peer still waiting on this rank in a collective of the old group fails at once.
            release_process_group(self.ddp)
        round_ = regroup.join_next_round(self._rounds, error, step=self.step) if self._rounds is not None else None
        saved_step = self._saved_step  # what tier 1 holds: a catch-up cut short must not claim more
        while True:
            if round_ is None:
                if error is not None:
                    raise error
                return self.step
            if round_.stop:
                self._stop_below_minimum(round_.stop)
            self._regroup(round_.rank, round_.world_size)
            self._cadence.persist_owed = False  # as a new worker of the round starts: every rank decides alike
            try:
                caught = self._join_group()
                step = caught if caught is not None else self._restore_from_checkpoints()
                break
            except Exception as exc:
                # Another peer lost while the new group caught up: the agent's next round (or its stop, below the
                # minimum of nodes: persist, then exit) follows, as for the first loss. Raised out of here, this
                # worker withdrew and was stopped without persisting the step it held.
                if self._rounds is None or not regroup.may_be_peer_loss(exc):
                    raise
                error, self._saved_step = exc, saved_step
                if self.ddp is not None:
                    release_process_group(self.ddp)
                round_ = regroup.join_next_round(self._rounds, error, step=self.step)
        self.telemetry.resumed(step, None)  # metrics: steps after `step` are recomputed; the next is the first
        self._reformed(round_, step, started)
        return step

    def _reformed(self, round_: Round, step: int, started: float) -> None:
        seconds = round(time.monotonic() - started, 3)
        emit("reformed", step=step, world=round_.world_size, generation=round_.generation, pid=os.getpid(),
             reform_s=seconds)
        log.info("reformed world=%d pid=%d step=%d in %.3fs", round_.world_size, os.getpid(), step, seconds)

    def _reenter(self, round_: Round | None, error: BaseException | None, started: float) -> None:
        """A sharded run (under run_elastic) with a new round: end this incarnation without telling the agent it
        finished, and raise Reentry: run_elastic joins the round's group once the old model and its hold on the
        old group are gone, and runs the training function again (trainer/in_place.py). No round: return, or
        re-raise `error`."""
        if round_ is None:
            if error is not None:
                raise error
            return
        if round_.stop:
            self._stop_below_minimum(round_.stop)
        self._closed = True
        self._later.close()  # its hook off the old model (reform ran what the last step left)
        self._unhook()
        try:  # its copies done (nothing reads the model after this); run_elastic closes it once the group is joined
            self.checkpointer.wait_staged()
        except CheckpointError as exc:  # that save is lost; the newest complete one is still there
            log.warning("rank %d: a save's copy did not finish before a re-formation: %s", self.topology.rank, exc)
        self.telemetry.close()  # the next incarnation's takes over its file
        raise in_place.Reentry(started, closing=self.checkpointer)

    def _stop_below_minimum(self, why: str) -> NoReturn:
        """The job stops: too few nodes are left (the agent's round says why). Persist the step held in memory
        (tier 1 now, tier 2's uploads flushed) and exit with EXIT_BELOW_MIN, so a requeue resumes from it."""
        step = self._live_step
        saved = step > self._saved_step and step > 0 and not self._stepped  # else the state is past the step
        if saved:
            if self._boundary_rng is not None:
                rng.restore(self._boundary_rng)  # the interrupted step's draws are void
            self.step = step
            self.save(step)
        try:
            self.close()
        except CheckpointSaveError as exc:  # still exit 75: the requeue resumes from the newest committed step
            log.error("rank %d: %s", self.topology.rank, exc)
            saved = False
        emit("below_min_exit", step=step if saved else self._saved_step, persisted=saved, why=why)
        log.error("rank %d: %s; persisted step %d, exiting with %d", self.topology.rank, why,
                  step if saved else self._saved_step, EXIT_BELOW_MIN)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_BELOW_MIN)  # the old process group may be wedged: no interpreter teardown through it

    def check_round(self) -> None:
        """Raise RoundChanged when the agent has published a new round (a step boundary is the place to
        re-form: `accumulate` and `train_loop` call this before each step; catch it like a failed step)."""
        if self._rounds is not None and (round_ := self._rounds.newest()) is not None:
            raise RoundChanged(f"round {round_.generation} published: this worker becomes rank {round_.rank} "
                               f"of {round_.world_size}; call Resumable.reform()")

    def _regroup(self, rank: int, world_size: int) -> None:
        """This process's place in the new group: topology, DDP wrapper, sampler, checkpointer."""
        old = self.topology
        self.topology = Topology(rank=rank, world_size=world_size, local_rank=old.local_rank)
        self.layout = Layout.data_parallel(rank, world_size)
        if self.ddp is not None:
            regroup.rewrap_ddp(self.ddp)
        if self.sampler is not None:
            self.sampler.repartition(rank, world_size)
        if (rank, world_size) != (old.rank, old.world_size):
            # Its commits count ranks of the old world: finish what it has in flight, start one for this world.
            # world_over: tier 2 does not wait for the old world's other ranks. One lost with the node that left
            # never uploads the step it was saving, and waiting for it held the whole new group for the 2 minutes.
            if not self.checkpointer.close(timedelta(minutes=2), world_over=True):
                log.warning("rank %d: checkpoint work left unfinished at a re-formation: %s", old.rank,
                            self.checkpointer.last_error)
            self.checkpointer = Checkpointer(self.config.ckpt, rank=rank, world_size=world_size,
                                             on_written=_save_hook())

    def _mark_live(self, step: int) -> None:
        self._live_step, self._stepped = step, False
        if self._rounds is not None:
            self._boundary_rng = rng.capture()  # only where a re-formation can use it: 0.1-0.3 ms

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _declare_ready(self) -> None:
        if self._rounds is not None:  # replicated state, or sharded under run_elastic (trainer/in_place.py)
            self._rounds.declare_ready()

    # -- the step --------------------------------------------------------------------------------

    def accumulate(self, batches: Iterable[Any]) -> Iterator[tuple[Any, float, AbstractContextManager[Any]]]:
        """This step's micro-batches from `batches`, as (batch, loss weight, sync context): see
        trainer/accumulate.py. Needs the sampler."""
        if self.sampler is None:
            raise ValueError("Resumable.accumulate needs a Resumable with a sampler (it knows the micro-batches)")
        self.check_round()  # a new round: re-form before this step (the loop catches RoundChanged)
        batches = self.telemetry.timed(batches)  # the time blocked on the loader, for metrics
        return accumulate(batches, self.sampler, self.ddp, sharded=self.model if self.sharded else None)

    def step_done(self, step: int, *, loss: float | torch.Tensor | None = None) -> bool:
        """Call after each completed optimizer step with the number of completed steps.

        Advances the data position; persists when `step` is a multiple of `persist_every`, else snapshots
        into tier 0 when it is a multiple of `save_every` (and there is a tier 0). With a tier 0, a persist
        due while the previous one is still being written is snapshotted instead and the first step after
        that write persists (the loop does not wait for a slow disk). Returns True if it persists. Where snapshots
        are deferred (trainer/deferred.py) a persist is too: its state is taken here, its copies are launched once
        the next forward is queued (or at the next save, re-formation or close).
        `loss` (optional) goes into the `step` event; a tensor is read with .item() (a device sync).
        """
        step = self._check_step(step, f"step_done({step!r})", self.step + 1)
        # What the step before left, if no forward ran since (a compiled or scripted one runs no hook); first, so
        # that a metrics write it holds is done before the telemetry judges the next one due.
        self._later.flush()
        flush_metrics = self.telemetry.step(step)
        self.step = step
        if self.sampler is not None:
            self.sampler.advance(step)
        self._mark_live(step)
        if flush_metrics:
            self._later.later(self.telemetry.flush)
        # Lets elastic-run's agent tell a hung worker from a slow one: the first beat at once (until then the agent
        # cannot judge this worker), the later ones (a file write now and then) off the boundary.
        if self._beaten:
            self._later.later(partial(worker.beat, step))
        else:
            self._beaten = True
            worker.beat(step)
        fields: dict[str, Any] = {"step": step}
        if loss is not None:
            fields["loss"] = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
        if self._deferred is not None:
            # Where snapshots wait for the next forward, the event line does too (its JSON, log line and write:
            # ~70 us a step inside a loop), stamped with the boundary's time: a worker killed before that forward
            # loses this step's snapshot as well, so the line never claims a step no tier holds.
            self._later.later(partial(emit, "step", ts=round(time.time(), 3), **fields))
        else:
            emit("step", **fields)
        saved = self._cadence.persists(step, self.checkpointer, self.topology)
        if saved or self._cadence.snapshots(step, self.checkpointer):
            if not saved or self._deferred is not None:
                # The snapshot before published first: a kill from here on loses `step` at most
                # (trainer/cadence.py). A deferred one was launched in this step's forward (its copies overlap the
                # step); one still checksumming after a step means the node cannot keep up, and the loop runs at
                # the checksum's pace.
                self._cadence.wait_for_previous_snapshot(self.checkpointer)
            if self._deferred is not None:
                # The rest once the next forward is queued (trainer/deferred.py), a persist's too: taken whole
                # here, the step after each tier-1 save was the slow one on an H200.
                self._emit_digest(step, "save")
                self._deferred.defer(step, self._take_boundary(self._boundary_rng), self.checkpointer.mark(),
                                     persist=saved)
            else:
                self._checkpoint(step, persist=saved, rng_state=self._boundary_rng)
        faults.fire("step", step)  # before the loop runs step `step + 1`
        return saved

    # -- save ------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The tree a checkpoint holds (this rank's part; DTensor leaves of a sharded model)."""
        setup.check_json_able(self.extras)
        if self.sharded:  # by parameter name, so that optimizer state reshards like the parameters
            model_sd, optim_sd = sharding.model_state(self.model, self.optimizer)
            names = None
        else:
            model_sd = self.model.state_dict()
            optim_sd = self.optimizer.state_dict() if self.optimizer is not None else None
            names = self._param_names() if self.optimizer is not None else None
        return self._tree(model_sd, optim_sd, names)

    def _tree(self, model_sd: Any, optim_sd: Any, names: list[list[str | None]] | None,
              rng_state: dict[str, Any] | None = None) -> dict[str, Any]:
        layout = {"layout": self.layout.record()} if self.sharded else {}
        return {
            "step": self.step,
            "world_size": self.topology.world_size,
            **layout,
            "model": model_sd,
            "optimizer": optim_sd,
            "optimizer_class": optimizer_class(self.optimizer) if self.optimizer is not None else None,
            "param_names": names,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng_state if rng_state is not None else rng.capture(),
            "extras": self.extras,
        }

    def _checkpoint_state(self, rng_state: dict[str, Any] | None = None) -> dict[str, Any] | Flat:
        """What a save or snapshot hands the checkpointer: `state()`, flattened without walking the model and
        the optimizer state again while they are the same tensors (trainer/state_view.py). `rng_state`: the
        RNG streams captured at this step's end already (Resumable._mark_live), else captured now."""
        if self.sharded:
            return self.state()
        return self._view.flat(self._boundary(rng_state))

    def _boundary(self, rng_state: dict[str, Any] | None = None) -> Boundary:
        """The part of the (replicated) state the next step changes, taken now (trainer/state_view.py)."""
        return self._take_boundary(rng_state)()

    def _take_boundary(self, rng_state: dict[str, Any] | None = None) -> Callable[[], Boundary]:
        """`_boundary`, its values taken now and flattened when called: a deferred snapshot flattens them once
        the next forward is queued (trainer/deferred.py). What the loop may change in between is copied: the
        extras (the caller's dict), the scheduler's and scaler's state (a user's object may return its own live
        dict) and the param_groups (their lr); the RNG streams, the data position and the names are made anew."""
        setup.check_json_able(self.extras)
        params = param_key(self.optimizer.param_groups) if self.optimizer is not None else None  # once, for both
        names = self._param_names(params) if self.optimizer is not None else None
        rest = self._tree(None, None, names, rng_state)
        for key in ("scheduler", "scaler", "extras"):
            rest[key] = copy_plain(rest[key])
        groups = self._view.param_groups(params)

        def flattened() -> Boundary:
            return self._view.boundary(rest, groups)

        return flattened

    def _stateful(self) -> dict[str, Any]:
        """The run's scheduler and scaler, by their names in the state tree (for check_state)."""
        return {"scheduler": self.scheduler, "scaler": self.scaler}

    def _param_names(self, key: ParamKey | None = None) -> list[list[str | None]]:
        """param_names(model, optimizer), walked again only when the optimizer's parameters change: a
        snapshot every step should not walk the model every step."""
        assert self.optimizer is not None
        key = key or param_key(self.optimizer.param_groups)
        cached = self._names_cache
        if cached is None or cached[0] != key:
            cached = self._names_cache = (key, param_names(self.model, self.optimizer))
        return [list(g) for g in cached[1]]

    def save(self, step: int) -> None:
        """Snapshot this rank's state for `step`; writing, committing and uploading run in the
        background (no collective here: the last local rank commits tier 1, rank 0 tier 2).

        A failed save is logged and training goes on, until `max_failed_saves` fail in a row:
        then CheckpointSaveError (naming the directory and the cause) stops the job."""
        step = self._check_step(step, f"save({step!r})", self.step)
        if self._checkpoint(step, persist=True):
            self._cadence.persist_owed = False

    def snapshot(self, step: int) -> None:
        """Snapshot this rank's state for `step` into tier 0 only (host memory; ckpt/tier0.py); failures
        as for `save`. A snapshot that finds its slots busy is skipped (in the checkpointer's metrics)."""
        step = self._check_step(step, f"snapshot({step!r})", self.step)
        self._checkpoint(step, persist=False)

    def _check_step(self, step: Any, call: str, expected: int) -> int:
        """`step` as an int, when `call` is in order: after restore(), before close(), with the step count
        `expected`. Else UsageError: a checkpoint whose step is not the state's is refused at the next restart,
        which then starts over and replaces it (nothing is written here)."""
        if self._closed:
            raise UsageError(f"{call}: this Resumable is closed (close() or teardown() ran); make a new one to "
                             "train on")
        if not self._restored_once:
            raise UsageError(f"{call} before restore(): call run.restore() first and continue from the step it "
                             f"returns (train_loop does); a run that saves without it overwrites the checkpoints "
                             f"in {self.config.ckpt_dir}")
        try:
            value = operator.index(step)
        except TypeError:
            value = None
        if value != expected or isinstance(step, bool):
            raise UsageError(f"{call}: expected {expected}, the run having completed {self.step} steps; pass the "
                             "number of optimizer steps completed so far, counting from 1 (step_done(step + 1) in a "
                             "loop over range(run.restore(), total))")
        return value

    def _checkpoint(self, step: int, *, persist: bool, rng_state: dict[str, Any] | None = None) -> bool:
        if self._deferred is not None:
            if persist:  # the last step saved at teardown or below the minimum: one copy of it, not two
                self._deferred.drop(step)
            self._deferred.flush()  # the save of the step before first
        self._emit_digest(step, "save")
        return self._save(step, persist, lambda: self._checkpoint_state(rng_state))

    def _finish_deferred(self, step: int, boundary: Boundary, mark: StateMark, persist: bool) -> None:
        """The rest of a deferred snapshot or persist (trainer/deferred.py): the state's tensors as at `mark`."""
        self._save(step, persist, lambda: self._view.flat(boundary), at=mark)

    def _save(self, step: int, persist: bool, state: Callable[[], Any], *, at: StateMark | None = None) -> bool:
        """Hand `state()` to the checkpointer, a persist or a tier-0 snapshot (`at`: as of that mark); a persist
        made becomes the step saved. A failed one is logged and training goes on (see `save`)."""
        save = self.checkpointer.save_async if persist else self.checkpointer.snapshot
        try:
            save(step, state(), at=at)
            if persist:
                self._saved_step = step
            return True
        except CheckpointSaveError:
            raise
        except CheckpointError as exc:
            what = "checkpoint" if persist else "tier-0 snapshot"
            log.error("%s of step %d failed on rank %d: %s", what, step, self.topology.rank, exc)
            emit("ckpt_failed", step=step, tier="local" if persist else "memory", error=str(exc))
            return False

    def save_final(self) -> bool:
        """Save the current step unless a save of it was made already or nothing ran since the restore,
        so that a finished job, restarted, does not redo its tail. Returns whether it saved."""
        if self.step == self._saved_step or self.step == 0:
            return False
        self.save(self.step)
        return True

    def _wait_for_copy_hooks(self) -> list[Any]:
        # "overlapped" mode: the state must not change until the save's copy of it is consistent.
        def wait(*_: Any) -> None:
            self._later.flush()  # a snapshot whose copies are not launched yet: launch them first
            self.checkpointer.wait_staged()

        hooks = [self.optimizer.register_step_pre_hook(wait)] if self.optimizer is not None else []
        if any(True for _ in self.model.buffers()):  # BatchNorm's running stats change in forward
            hooks.append(self.model.register_forward_pre_hook(wait))
        return hooks

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush the save in flight and pending uploads (bounded), then stop the checkpointer's threads.

        Raises CheckpointSaveError when the last save failed (the run's end is not checkpointed; no
        later save would have noticed), unless max_failed_saves is None. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        unfinished: BaseException | None = None
        try:  # a snapshot waiting for its rest; the close goes on either way, its error raised at the end
            self._later.close()
        except Exception as exc:  # noqa: BLE001 - re-raised below, once everything is closed
            unfinished = exc
        if self._rounds is not None:
            regroup.stop_round_watcher()  # from here on a membership change restarts this process
        worker.finish()  # flushing may outlast elastic-run's --hang-timeout; nothing is stuck
        self._unhook()
        # The local writes get 5 minutes; the uploads one operation's retry deadline, which the user set for the
        # shared store: with the store down they held every rank's exit a fixed 5 minutes.
        shared = self.checkpointer.config.shared
        if not self.checkpointer.close(timedelta(minutes=5), uploads=shared.retry.deadline if shared else None):
            log.warning("rank %d: checkpoint work left unfinished at close: %s", self.topology.rank,
                        self.checkpointer.last_error)
        self.telemetry.flush()  # the last saves' outcomes, for the agent's summary
        self.checkpointer.check(final=True)
        if unfinished is not None:
            raise unfinished

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self.sampler is not None and self.sampler.sample_log is not None:
            self.sampler.sample_log.close()

    def final_digest(self) -> str:
        """The digest of the model's and optimizer's state (trainer.training_digest), also emitted as
        the `final_digest` event: call it once training is over, on every rank."""
        digest = training_digest(self.model, self.optimizer)
        emit("final_digest", step=self.step, digest=digest)
        return digest

    def _emit_digest(self, step: int, point: str) -> None:
        # ELASTIC_STATE_DIGESTS=1 (trainer/digest.py): a restore can be checked against the save it read.
        if state_digests_on():
            emit("state_digest", step=step, point=point, digest=training_digest(self.model, self.optimizer))

    def teardown(self, batches: Iterable[Any] | None = None, *, destroy_process_group: bool = True) -> str:
        """End a finished run in the one order that cannot hang, and return the final digest: stop the
        DataLoader workers of `batches` (the loader's iterator), save the last step (`save_final`),
        close, digest, drop DDP's hold on the process group (trainer/ddp.py, "Teardown": the wrapper is
        unusable afterwards), then destroy the process group (unless told not to)."""
        shutdown = getattr(batches, "_shutdown_workers", None)  # what the iterator's __del__ would do
        if callable(shutdown):
            shutdown()
        self.save_final()
        self.close()
        digest = self.final_digest()
        if self.ddp is not None:
            release_process_group(self.ddp)
        if destroy_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return digest


def _save_hook() -> Callable[[int], None] | None:
    """The fault-injection point inside a save, only where a fault is planned there: with the hook the
    worker writes tier 1 itself (the node's helper process cannot run it, ckpt/helper.py)."""
    return _rank_saved if any(f.point == "save" for f in faults.configured()) else None


def _rank_saved(step: int) -> None:
    # On the writer thread, once this rank's files of `step` are written, before the commit.
    faults.fire("save", step)
