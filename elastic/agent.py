"""The elastic-run agent: torch's `LocalElasticAgent` plus three things torchrun lacks.

1. Hang detection. Workers report progress (`elastic.progress.beat`); a worker with no progress for
   `hang_timeout` is killed (SIGKILL works on a SIGSTOPped process too), so the group restarts
   instead of waiting for a collective timeout. A stopped worker is judged at half of it, before the
   agents of its peers, which wait in a collective with it, judge theirs: they re-form in place.
2. Membership-aware restart accounting. A worker group that failed because a peer node was lost is
   restarted without consuming `--max-restarts`: if membership already shows the loss when the
   failure is seen, the restart is a membership restart (as torch does for scale-up); if the loss
   only shows in the next round, the restart is refunded. `--max-restarts` therefore counts this
   node's own failures, not other nodes' (compare pytorch#108158).
3. Structured events (`restart`, `recovered`, `hang_detected`, `reform`, `reform_done`, `reform_fallback`) with
   timings, and optional metrics.
4. In-process re-formation (`--reform in-process`, the default, with a round-aware rendezvous such as
   `etcd-v3`): on a membership change, workers that declared they can (elastic/reform.py) keep their
   processes; the agent runs the next round and hands it to them. A worker that has not joined the new
   round within `reform_timeout` is killed, and the group restarts the old way (logged and counted).
5. Only the failed process restarts: when a worker crashes and every other one can re-form in place,
   the agent runs the next round, the others re-form, and a warm spare (elastic/spare.py: a process
   with Python, torch and the script's imports already loaded, started once the workers run) becomes
   the crashed local rank; without a warm spare a fresh one is started for that rank alone.

Process supervision, worker env, error files and the restart loop itself stay torch's.
`launch()` is the thin equivalent of `torch.distributed.launcher.api.launch_agent` that builds
this agent instead of the stock one.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol, runtime_checkable

from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

from core import events, procfs, tier0_dir
from core.deadline import Deadline
from core.events import NODE_ID_ENV, emit
from elastic import peer_loss, prestart, progress, reform
from elastic.errors import BelowMinimumError
from elastic.job_metrics import JobMetrics
from elastic.liveness import listening_socket
from elastic.metrics import AgentMetrics
from elastic.node_helper import ENV as NODE_HELPER_ENV
from elastic.node_helper import NodeHelper
from elastic.spare import ENV_CUDA_DEVICE, Spare, can_run, stop_all
from elastic.worker import STACKS_SIGNAL

log = logging.getLogger(__name__)


REPLICA_KEY = "replica"
"""The membership record's field with the address of the node helper's tier-0 replica listener."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    hang_timeout: timedelta | None = None
    """A worker with no progress beat for this long is killed as hung; None disables hang detection."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port); None disables them."""
    reform: Literal["in-process", "restart"] = "in-process"
    """On a membership change, keep the workers that can re-form in place (in-process) or restart all."""
    reform_leave_timeout: timedelta = timedelta(seconds=10)
    """How long a kept worker may take to leave its old process group once the round is published: it
    notices at its next step boundary, or at once when its collective fails. Longer means stuck."""
    reform_timeout: timedelta = timedelta(minutes=5)
    """How long a kept worker may take to join the new round's process group (which waits for the round's
    freshly started workers: a process start and a model build) before it is restarted."""
    warm_spare: bool = True
    """In in-process mode, keep one worker process per node started ahead of need (Python, torch and the
    script's imports loaded) to take a crashed worker's place; it costs one idle process's memory."""

    def __post_init__(self) -> None:
        if self.reform not in reform.MODES:
            raise ValueError(f"reform must be one of {', '.join(reform.MODES)}, got {self.reform!r}")
        if self.hang_timeout is not None and self.hang_timeout <= timedelta(0):
            raise ValueError(f"hang_timeout must be positive, got {self.hang_timeout}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be 0..65535, got {self.metrics_port}")


def _on_a_thread(call: Callable[..., None], *args: Any) -> None:
    """`call(*args)` on a daemon thread, this thread waiting in Python (where signals are handled); its error
    raised here. The call's own timeout bounds the wait."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call(*args)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="elastic-rendezvous-wait", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if failed:
        raise failed[0]


@runtime_checkable
class RoundAware(Protocol):
    """What the agent reads from a rendezvous handler that knows the run's membership (our `etcd-v3`
    handler). Any other handler (c10d, static) works too, without these extras."""

    @property
    def node_id(self) -> str:
        """This agent's node id in the run."""
        ...

    @property
    def round_members(self) -> tuple[str, ...]:
        """Node ids of the round the workers run in, in rank order."""
        ...

    @property
    def generation(self) -> int:
        """The number of that round (0: none yet)."""
        ...

    @property
    def degraded(self) -> bool:
        """True while the membership store cannot be reached (workers keep running)."""
        ...

    @property
    def lease_ttl(self) -> timedelta:
        """How soon after a node dies its peers learn of it."""
        ...

    @property
    def join_timeout(self) -> timedelta:
        """The longest one rendezvous waits (for its peers, or for etcd to answer again)."""
        ...

    def mark_succeeded(self) -> None:
        """The workers finished the job: the handler may close the run on shutdown."""
        ...

    @property
    def bind_addr(self) -> str | None:
        """The address this node's listeners bind (None: every interface)."""
        ...

    @property
    def replica_key(self) -> bytes | None:
        """The key that signs the run's tier-0 replica pushes (None: pushes unsigned, a run without a join token)."""
        ...

    def advertise(self, key: str, port: int) -> str:
        """Publish `key`: "<this node's address>:<port>" in this node's membership record."""
        ...

    def advertised(self, key: str) -> dict[str, str]:
        """Node id -> the address each live node advertises under `key`."""
        ...

    def stop_below_minimum(self) -> None:
        """Once a round has run, raise BelowMinimumError from a later round with fewer than MIN live nodes."""
        ...


@dataclass(frozen=True)
class _Awaiting:
    """An in-place round under way: the kept workers must leave the old group and join the new one in time."""

    generation: int
    kept: frozenset[int]  # the local ranks kept in place
    leave_by: Deadline  # to leave the old group (AgentConfig.reform_leave_timeout)
    join_by: Deadline  # to join the new one (AgentConfig.reform_timeout)
    grace: Deadline  # after it, a kept worker that neither leaves nor steps is hung (_hung_kept)


class ElasticAgent(LocalElasticAgent):
    def __init__(self, spec: WorkerSpec, *, agent_config: AgentConfig, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.agent_config = agent_config
        self.progress_dir = progress.make_dir()
        self._workers_started_at: float | None = None
        self._first_step_s: float | None = None  # how long the job's first step took (hang detection's allowance)
        self._judged: set[Any] = set()  # the worker pids judged hung (and SIGKILLed): each reported once
        os.environ[progress.ENV_DIR] = self.progress_dir  # workers inherit the agent's environment
        # The node's host memory for tier-0 snapshots (core/tier0_dir.py): it outlives any one worker.
        # A value set by the user (a directory of their own, or "" for none) is left alone.
        self.tier0_dir: str | None = None
        if tier0_dir.ENV not in os.environ:
            self.tier0_dir = tier0_dir.make_node_dir()
            os.environ[tier0_dir.ENV] = self.tier0_dir
        # Like the beacon and the round's store: only on --local-addr when one is given.
        self.metrics = AgentMetrics.start(agent_config.metrics_port, getattr(spec, "local_addr", None) or "0.0.0.0")
        self.job = JobMetrics(self.progress_dir, self.metrics)  # workers' series, restarts by cause, summary
        self._failure_seen_at: float | None = None
        self._rounds = reform.RoundChannel(self.progress_dir)
        self._awaiting: _Awaiting | None = None  # an in-place round under way
        self._fell_back = False  # a kept worker was killed as stuck: the next failure restarts the node's workers
        self._spare: Spare | None = None
        self._spare_failures = 0
        self._prestarted: dict[int, Spare] = {}  # local rank -> a process started ahead for the node's first worker
        self._started_once = False
        handler = spec.rdzv_handler
        self._round_info: RoundAware | None = handler if isinstance(handler, RoundAware) else None
        if self._round_info is not None:  # below the minimum mid-round: persist and stop (_next_round_in_place)
            self._round_info.stop_below_minimum()
            # Every record of the node's processes (core/events.py) and a fault's `node` key (core/faults.py) name
            # the node by its id in the run. A value already set (elastic-chaos names its nodes) is left alone.
            os.environ.setdefault(NODE_ID_ENV, self._round_info.node_id)
        # Checksums and publishes the workers' tier-0 snapshots off their training processes; with membership
        # records, also keeps peers' tier-0 replicas on a port advertised in this node's record.
        self.ckpt_helper: NodeHelper | None = None
        if self.tier0_dir is not None:
            listener, replica_key = None, None
            if self._round_info is not None and os.environ.get(NODE_HELPER_ENV, "1") != "0":
                listener = listening_socket(self._round_info.bind_addr, backlog=16)
                self._round_info.advertise(REPLICA_KEY, listener.getsockname()[1])
                replica_key = self._round_info.replica_key
            # Its process starts with the workers (_initialize_workers): a joining node's prestarted workers
            # warm up first, not beside another torch import on the same cores.
            self.ckpt_helper = NodeHelper.start(self.tier0_dir, listener, spawn=False, replica_key=replica_key)
        if self._round_info is not None:
            # A rendezvous that watches membership: a worker that dies of a lost peer waits this long
            # for us to stop it (elastic/peer_loss.py): the lease TTL, two monitor intervals, a margin.
            grace = self._round_info.lease_ttl.total_seconds() + 2 * spec.monitor_interval + 2
            os.environ[peer_loss.ENV_GRACE] = f"{grace:g}"
            if agent_config.reform == "in-process":
                os.environ[reform.ENV_MODE] = "in-process"
                os.environ[reform.ENV_TIMEOUT] = f"{agent_config.reform_timeout.total_seconds():g}"

    @property
    def _handler(self) -> Any:
        return self._worker_group.spec.rdzv_handler

    def _membership(self) -> tuple[str, ...]:
        return self._round_info.round_members if self._round_info is not None else ()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if isinstance(self._handler, StaticTCPRendezvous):
            # torch's static rendezvous waits for every node inside C++ (TCPStore's waitForWorkers, up to its
            # 600 s timeout), where no Python signal handler runs: a SIGTERM (Slurm, kubectl) there was answered
            # only by the SIGKILL after it, leaving the node's directories behind. On a thread of its own (ended by
            # torch's timeout at the latest) the wait leaves this thread free to take the signal.
            _on_a_thread(super()._rendezvous, worker_group)
            return
        super()._rendezvous(worker_group)

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if not self._started_once:
            self._started_once = True
            self._prestart(worker_group)
        if self.ckpt_helper is not None:
            self.ckpt_helper.begin()
        super()._initialize_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        progress.clear(self.progress_dir)
        self._judged.clear()  # new processes
        if self._workers_started_at is None:
            self._workers_started_at = time.monotonic()  # the first workers: their first step's time is measured
        self._rounds.clear()
        self._awaiting, self._fell_back = None, False
        info = self._round_info
        os.environ[reform.ENV_GENERATION] = str(info.generation if info is not None else 0)
        if self._prestarted:
            pids = self._start_through(self._prestarted, worker_group)
            self._prestarted = {}
        else:
            pids = super()._start_workers(worker_group)
        self.metrics.update(members=worker_group.group_world_size or 0,
                            generation=info.generation if info is not None else 0,
                            degraded=info.degraded if info is not None else False)
        if self._failure_seen_at is not None:
            # From the failure (or membership change) being seen to the new workers running.
            seconds = round(time.monotonic() - self._failure_seen_at, 3)
            self.metrics.update(last_recovery_seconds=seconds)
            emit("recovered", node=info.node_id if info is not None else None,
                 world_size=worker_group.group_world_size, group_rank=worker_group.group_rank, recovery_s=seconds)
            self._failure_seen_at = None
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # Before torch's poll, which stops every worker of the node once one has failed.
        self._replace_failed_in_place(worker_group)
        result = super()._monitor_workers(worker_group)
        if self._awaiting is not None and result.state == WorkerState.HEALTHY:
            self._check_joined(worker_group)
        if result.state == WorkerState.HEALTHY:
            self._keep_spare_warm(worker_group)
        self.job.poll()  # after a failure: the first step after it
        if self.ckpt_helper is not None:
            self.ckpt_helper.ensure_running()
            if self._round_info is not None:
                self.ckpt_helper.update_targets(self._round_info.node_id, self._membership(),
                                                self._round_info.advertised(REPLICA_KEY), self._handler.get_run_id())
        # Not while a re-formation is under way: it has deadlines of its own, and kept workers make no steps then.
        if (result.state == WorkerState.HEALTHY and self.agent_config.hang_timeout is not None
                and self._awaiting is None):
            self._kill_hung_workers(worker_group, self.agent_config.hang_timeout.total_seconds())
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) or (
                result.state == WorkerState.HEALTHY and self._peer_change_known()):
            self._stop_if_below_minimum(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            if self._failure_seen_at is None:
                self._failure_seen_at = time.monotonic()
            if self._peer_change_known():
                # A peer was lost: torch's HEALTHY branch then restarts us without consuming a restart.
                log.info("agent: workers failed after a membership change; restarting without consuming --max-restarts")
                return RunResult(state=WorkerState.HEALTHY)
        elif result.state == WorkerState.HEALTHY and self._failure_seen_at is None and self._peer_change_known():
            self._failure_seen_at = time.monotonic()
        return result

    def _peer_change_known(self) -> bool:
        try:
            return int(self._handler.num_nodes_waiting()) > 0
        except Exception:  # noqa: BLE001 - membership unknown: count the failure as usual
            return False

    def _kill_hung_workers(self, worker_group: WorkerGroup, timeout: float) -> None:
        for worker in self._judged_hung(worker_group.workers, timeout):
            try:
                os.kill(int(worker.id), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _judged_hung(self, workers: list[Any], timeout: float) -> list[Any]:
        """The running `workers` whose last progress beat is older than `timeout` seconds, or a stopped one's
        older than STOPPED_SHARE of it, each reported (`hang_detected`).

        Why the stopped one sooner: its peers on other nodes wait in a collective with it, and their last beats
        are as old as its own, so at `timeout` their agents judge them hung too and restart healthy workers. A
        stopped process cannot make progress; ended first, its connections close, its peers' collectives fail
        at once and they re-form in place, their hang detection paused for the round."""
        now, hung = time.monotonic(), []  # the beats' clock (elastic/progress.py): an NTP step moves neither
        for worker in workers:
            beat = progress.last_beat(self.progress_dir, worker.local_rank, now)
            if beat is None or worker.id is None:
                continue
            if not beat.restarted and self._first_step_s is None and self._workers_started_at is not None:
                self._first_step_s = now - self._workers_started_at  # the job's first step, seen within a tick
            # A worker (re)started in a restart or a re-formation has not beaten since: its first step may take as
            # long as the job's first did (a restore, a compile), twice over, on top of the timeout.
            allowance = (2 * self._first_step_s if self._first_step_s is not None else timeout) if beat.restarted \
                else 0.0
            if beat.age <= timeout * STOPPED_SHARE:
                continue
            stopped = _stopped(worker.id)
            if stopped or beat.age > timeout + allowance:
                if worker.id not in self._judged:  # once: a SIGKILLed process can take ticks to be reaped
                    self._judged.add(worker.id)
                    emit("hang_detected", local_rank=worker.local_rank, global_rank=worker.global_rank,
                         pid=worker.id, seconds_without_progress=round(beat.age, 2), hang_timeout_s=timeout,
                         stopped=stopped, first_step=beat.restarted)
                hung.append(worker)
        return hung

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self._can_reform_in_place(worker_group):
            self._reform_in_place(worker_group)
            return
        before, state = self._membership(), worker_group.state
        if self._failure_seen_at is None:
            self._failure_seen_at = time.monotonic()
        self.job.failed(self._failure_seen_at)
        try:
            super()._restart_workers(worker_group)
        except BelowMinimumError as exc:  # the next round lost nodes below the minimum; the workers are stopped
            log.error("elastic-run: %s", exc)
            emit("below_min", live=exc.live, min_nodes=exc.minimum)
            raise
        lost = sorted(set(before) - set(self._membership()))
        reason = "worker failure" if state in (WorkerState.FAILED, WorkerState.UNHEALTHY) else "membership change"
        if lost and reason == "worker failure":
            self._remaining_restarts += 1  # the failure came from losing a peer, not from this node
            reason = "peer lost"
        if lost:
            log.warning("peer node%s %s lost; the group re-formed with %d node%s",
                        "s" if len(lost) > 1 else "", ", ".join(lost), worker_group.group_world_size or 0,
                        "s" if (worker_group.group_world_size or 0) != 1 else "")
        self.job.restarted(reason, reformed=set(before) != set(self._membership()))
        emit("restart", reason=reason, lost=lost, remaining_restarts=self._remaining_restarts,
             max_restarts=worker_group.spec.max_restarts)


    # -- in-process re-formation (elastic/reform.py) ---------------------------------------------------

    def _can_reform(self) -> bool:
        return self.agent_config.reform == "in-process" and self._round_info is not None

    def _can_reform_in_place(self, worker_group: WorkerGroup) -> bool:
        """Every local worker is alive and declared it can join a new round without a restart."""
        if not self._can_reform():
            return False
        ready = self._rounds.ready_pids()
        return bool(worker_group.workers) and all(
            w.id is not None and ready.get(w.local_rank) == int(w.id) and procfs.alive(int(w.id))
            for w in worker_group.workers)

    def _reform_in_place(self, worker_group: WorkerGroup) -> None:
        if self._failure_seen_at is None:
            self._failure_seen_at = time.monotonic()
        self.job.failed(self._failure_seen_at)  # metrics: the time to the first step after it
        before = self._membership()
        generation = self._next_round_in_place(worker_group, {w.local_rank: w.id for w in worker_group.workers})
        lost = sorted(set(before) - set(self._membership()))
        if lost:
            log.warning("peer node%s %s lost; re-forming the group in place with %d node%s",
                        "s" if len(lost) > 1 else "", ", ".join(lost), worker_group.group_world_size or 0,
                        "s" if (worker_group.group_world_size or 0) != 1 else "")
        emit("reform", generation=generation, lost=lost, world_size=worker_group.group_world_size,
             group_rank=worker_group.group_rank)
        self.job.reformed()

    def _next_round_in_place(self, worker_group: WorkerGroup, kept: dict[int, Any]) -> int:
        """Run the next round with the processes of `kept` (local rank -> pid) staying; publish it to them."""
        while True:
            if self._round_info is not None:  # they wait for it as long as the rendezvous may take (etcd down, say)
                self._rounds.announce(self._round_info.generation, self._round_info.join_timeout)
            try:
                self._rendezvous(worker_group)  # the next round: new ranks, a new store; the processes stay
                break
            except BelowMinimumError:
                # Nodes lost while the round formed: the kept workers persist what they hold, then the agent stops.
                self._stop_if_below_minimum(worker_group)
                log.info("agent: the nodes are back above the minimum; joining the round again")
        for w in worker_group.workers:
            w.id = kept.get(w.local_rank)
        info = self._round_info
        assert info is not None
        self._rounds.publish(info.generation, str(worker_group.master_addr), int(worker_group.master_port or 0),
                             [(w.local_rank, w.global_rank, w.world_size) for w in worker_group.workers])
        if kept:
            self._awaiting = _Awaiting(info.generation, frozenset(kept),
                                       leave_by=Deadline.after(self.agent_config.reform_leave_timeout),
                                       join_by=Deadline.after(self.agent_config.reform_timeout),
                                       grace=Deadline.after(_HUNG_LEAVE_GRACE))
        worker_group.state = WorkerState.HEALTHY
        self.metrics.update(members=worker_group.group_world_size or 0, generation=info.generation)
        return info.generation

    # -- below the minimum of nodes ----------------------------------------------------------------

    def _stop_if_below_minimum(self, worker_group: WorkerGroup) -> None:
        """Fewer live nodes than --nnodes MIN: no round can form. Instead of waiting out the join timeout, the
        workers that can persist the state they hold and exit; then the agent stops with EXIT_BELOW_MIN."""
        below = getattr(self._round_info, "below_minimum", None)
        if below is None or self._round_info is None or not self._round_info.generation:
            return  # another handler, or no round has run yet (nodes still arriving)
        found = below()
        if found is None:
            return
        live, minimum = found
        why = str(BelowMinimumError.of(live, minimum))
        log.error("elastic-run: %s", why)
        emit("below_min", live=live, min_nodes=minimum)
        handlers: dict[int, Any] = getattr(self._pcontext, "subprocess_handlers", None) or {}
        ready = self._rounds.ready_pids()
        persisting = [h for lr, h in handlers.items() if h.proc.poll() is None and ready.get(lr) == h.proc.pid]
        if persisting:
            self._rounds.publish_stop(self._round_info.generation + 1, why)
            deadline = Deadline.after(_PERSIST_TIMEOUT)
            while any(h.proc.poll() is None for h in persisting) and not deadline.expired():
                time.sleep(0.05)
        self.dismiss_spare()
        raise BelowMinimumError(why)

    # -- only the failed process restarts (elastic/spare.py) -------------------------------------------

    def _replace_failed_in_place(self, worker_group: WorkerGroup) -> None:
        """A worker crashed and every other local worker can re-form in place: the next round, with the
        others kept and a spare (warm if one is ready) in the crashed worker's place."""
        pcontext: Any = self._pcontext
        handlers: dict[int, Any] | None = getattr(pcontext, "subprocess_handlers", None)
        if (not handlers or self._awaiting is not None or self._fell_back or not self._can_reform()
                or self._remaining_restarts <= 0):
            return
        codes = {lr: h.proc.poll() for lr, h in handlers.items()}  # every monitor interval: only polls until here
        failed = sorted(lr for lr, code in codes.items() if code not in (None, 0))
        if not failed or any(code is not None for lr, code in codes.items() if lr not in failed):
            return  # nothing failed, or some worker finished: torch's path
        ready = self._rounds.ready_pids()
        if (any(ready.get(lr) != h.proc.pid for lr, h in handlers.items())
                or not can_run(worker_group.spec.entrypoint, pcontext.args[0])):
            return  # some worker cannot re-form (not trainer), or no spare can run the script: torch's restart
        self._remaining_restarts -= 1  # this node's own failure
        if self._failure_seen_at is None:
            self._failure_seen_at = time.monotonic()
        self.job.failed(self._failure_seen_at)
        dead = {lr: handlers[lr].proc.pid for lr in failed}
        kept = {w.local_rank: w.id for w in worker_group.workers if w.local_rank not in dead}
        generation = self._next_round_in_place(worker_group, kept)
        # A replacement is not judged by its predecessor's last beat, and its first step is timed from its start,
        # as the job's first was: marked before the round, the round's wait counted against it (seen: a healthy
        # replacement judged hung under load).
        progress.clear(self.progress_dir, dead)
        restart_count = worker_group.spec.max_restarts - self._remaining_restarts
        warm, warmed_up = [], []
        for w in worker_group.workers:
            if w.local_rank not in dead:
                continue
            env = {**os.environ, **pcontext.envs[w.local_rank],
                   **_round_env(worker_group, w, restart_count, generation)}
            spare = self._spare if self._spare is not None and self._spare.alive() else None
            self._spare = None
            warm.append(spare is not None)
            warmed_up.append(spare is not None and spare.warm())  # a spare still warming up is used all the same
            if spare is None:
                spare = Spare.start(str(worker_group.spec.entrypoint), pcontext.args[w.local_rank], self._spare_env())
            handlers[w.local_rank] = spare.take(local_rank=w.local_rank, interpreter_args=pcontext.args[w.local_rank],
                                                env=env, stdout=pcontext.stdouts.get(w.local_rank),
                                                stderr=pcontext.stderrs.get(w.local_rank))
            w.id = spare.pid
            self._judged.discard(spare.pid)  # a pid used again: this process was never judged
        by = ("a warm spare" if all(warmed_up) else "a spare still warming up") if all(warm) else "a new process"
        log.warning("worker%s local rank %s (pid %s) failed; replaced by %s, the others re-form in place "
                    "(round %d)", "s" if len(dead) > 1 else "", ", ".join(map(str, dead)),
                    ", ".join(map(str, dead.values())), by, generation)
        self.job.restarted("worker failure", reformed=False)
        emit("restart", reason="worker failure", lost=[], replaced=sorted(dead), dead_pids=sorted(dead.values()),
             warm_spare=all(warm), spare_ready=all(warmed_up), generation=generation,
             remaining_restarts=self._remaining_restarts, max_restarts=worker_group.spec.max_restarts)

    def _prestart(self, worker_group: WorkerGroup) -> None:
        """The node's first workers start through processes started ahead: those the launcher spawned before its
        own imports (elastic/prestart.py), prepared now with the workers' command line; on a node joining a running
        job, new ones if the launcher spawned none. A joining node's warm up (the script's imports, the device) and
        it joins the round only once they are warm: the nodes already training then wait in the new process group
        for a script's start, not for Python, torch and the device context. A job's first workers only skip the
        torch import: they run the script as a new process would."""
        spec = worker_group.spec
        usable = (self.agent_config.warm_spare and self._can_reform() and can_run(spec.entrypoint, spec.args)
                  and getattr(spec, "numa_options", None) is None)  # torch wraps a NUMA-bound worker in numactl
        early, extra = prestart.take(spec.local_world_size if usable else -1)
        joins = getattr(self._round_info, "joins_a_running_round", None)
        joining = bool(usable and joins is not None and joins())
        if extra is not None and joining:  # its warm-up would compete with the one the running job waits for
            stop_all([extra])
            extra = None
        if not early and not joining:
            return
        env, args = self._spare_env(), [str(a) for a in spec.args]
        try:
            for spare in early:
                spare.prepare(args, env, warm=joining)
        except OSError as exc:  # one died since take(): the usual processes, or new spares for a joining node
            log.warning("a worker process started ahead is gone (%s); starting the workers the usual way", exc)
            stop_all(early)
            early = []
        if extra is not None:
            self._adopt_spare(extra, args, env)
        if early:
            self._prestarted = dict(enumerate(early))
        elif joining:
            self._prestarted = {lr: Spare.start(str(spec.entrypoint), args, env) for lr in range(spec.local_world_size)}
        if not joining:  # a job's start: its rendezvous waits for the other nodes meanwhile
            if early:  # else one died before prepare: the usual processes
                emit("workers_prestarted", pids=[s.pid for s in early])
            return
        deadline = Deadline.after(_JOINER_WARM_TIMEOUT)
        while not all(s.warm() or not s.alive() for s in self._prestarted.values()) and not deadline.expired():
            time.sleep(0.05)
        log.info("joining a running job: %d worker process(es) started and warm before the rendezvous",
                 len(self._prestarted))
        emit("joiner_prestarted", pids=[s.pid for s in self._prestarted.values()],
             warm=all(s.warm() for s in self._prestarted.values()), ahead=bool(early))

    def _start_through(self, spares: dict[int, Spare], worker_group: WorkerGroup) -> dict[int, Any]:
        """torch's `_start_workers` (its environment, log files and process context), each local rank's process
        being the one started ahead for it instead of a new one (torch's own where that one is gone)."""
        from torch.distributed.elastic.multiprocessing import api as mp_api

        real = mp_api.get_subprocess_handler

        def adopt(*, entrypoint: str, args: tuple[Any, ...], env: dict[str, str], stdout: str, stderr: str,
                  local_rank_id: int, **rest: Any) -> Any:
            spare = spares[local_rank_id]
            if spare.alive():
                try:
                    return spare.take(local_rank=local_rank_id, interpreter_args=[str(a) for a in args],
                                      env={**os.environ, **env}, stdout=stdout, stderr=stderr)
                except OSError as exc:
                    log.warning("the process started ahead for local rank %d is gone (%s)", local_rank_id, exc)
            spare.stop()
            return real(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                        local_rank_id=local_rank_id, **rest)

        mp_api.get_subprocess_handler = adopt  # type: ignore[assignment]
        try:
            return super()._start_workers(worker_group)
        finally:
            mp_api.get_subprocess_handler = real

    def _keep_spare_warm(self, worker_group: WorkerGroup) -> None:
        """Start a spare once the node's workers run and can re-form in place (and again after one is used)."""
        if (not self.agent_config.warm_spare or not self._can_reform() or self._awaiting is not None
                or self._spare_failures >= _SPARE_FAILURES_MAX):
            return
        if self._spare is not None:
            if self._spare.alive():
                return
            self._spare_failures += 1
            log.warning("warm spare (pid %d) exited with %s%s", self._spare.pid, self._spare.proc.returncode,
                        "; no more spares on this node" if self._spare_failures >= _SPARE_FAILURES_MAX else "")
            self._spare = None
            return
        pcontext: Any = self._pcontext
        if not getattr(pcontext, "subprocess_handlers", None) or not can_run(worker_group.spec.entrypoint,
                                                                               pcontext.args[0]):
            return
        ready = self._rounds.ready_pids()
        if not all(w.id is not None and ready.get(w.local_rank) == int(w.id) for w in worker_group.workers):
            return  # not yet restored and training, or not a script that re-forms (trainer)
        self._spare = Spare.start(str(worker_group.spec.entrypoint), pcontext.args[0], self._spare_env())
        emit("spare_started", pid=self._spare.pid)

    def _adopt_spare(self, spare: Spare, args: list[str], env: dict[str, str]) -> None:
        """The node's warm spare, started with the first workers' interpreters: it warms up (the script's imports,
        the device context, the tier-0 slots once the worker makes them) while they start, not beside training."""
        try:
            spare.prepare(args, env)
        except OSError as exc:
            log.warning("the warm spare started ahead is gone (%s); one is started once the workers train", exc)
            stop_all([spare])
            return
        self._spare = spare
        emit("spare_started", pid=spare.pid, ahead=True)

    def _spare_env(self) -> dict[str, str]:
        """The environment a spare warms up in: the workers' (the agent's before any worker ran), less what names
        one rank of one round."""
        pcontext: Any = self._pcontext
        env = {**os.environ, **(pcontext.envs[0] if pcontext is not None else {})}
        for key in (*_ROUND_KEYS, "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
            env.pop(key, None)
        if self._worker_group.spec.local_world_size == 1:
            env[ENV_CUDA_DEVICE] = "0"  # the one worker's device: its context can be made ahead
        return env

    def dismiss_spare(self) -> None:
        stop_all([*([self._spare] if self._spare is not None else []), *self._prestarted.values()])
        self._spare, self._prestarted = None, {}

    def _check_joined(self, worker_group: WorkerGroup) -> None:
        awaiting = self._awaiting
        assert awaiting is not None
        generation = awaiting.generation
        late = [w for w in worker_group.workers
                if w.local_rank in awaiting.kept and self._rounds.acked(w.local_rank) < generation]
        if not late:
            seconds = round(time.monotonic() - (self._failure_seen_at or time.monotonic()), 3)
            self._awaiting, self._failure_seen_at = None, None
            progress.clear(self.progress_dir, awaiting.kept)  # hang detection starts again at their next step
            self.metrics.update(last_recovery_seconds=seconds)
            emit("reform_done", generation=generation, world_size=worker_group.group_world_size,
                 group_rank=worker_group.group_rank, recovery_s=seconds)
            return
        # Stuck: in a collective whose peer neither answers nor closes the connection (a network partition;
        # gloo's abort() does not end it), in a CUDA call, ... : the old way, a restart.
        config = self.agent_config
        not_leaving = [w for w in late if self._rounds.leaving(w.local_rank) < generation]
        stuck = [(w, "leave its process group", config.reform_leave_timeout)
                 for w in not_leaving if awaiting.leave_by.expired()]
        if not stuck and awaiting.grace.expired():
            stuck = self._hung_kept(not_leaving)
        stuck += [(w, "join the new group", config.reform_timeout) for w in late if awaiting.join_by.expired()]
        if not stuck:
            return
        self._awaiting = None
        self._fell_back = True  # the stuck ones die now: the node's workers restart the old way (torch's path)
        for w, what, timeout in stuck:
            log.warning("worker local rank %d (pid %s) did not %s for round %d within %gs; restarting it",
                        w.local_rank, w.id, what, generation, timeout.total_seconds())
            emit("reform_fallback", generation=generation, local_rank=w.local_rank, pid=w.id, stage=what,
                 timeout_s=timeout.total_seconds())
            try:
                os.kill(int(w.id), STACKS_SIGNAL)  # where it is stuck, in its log (elastic/worker.py)
                time.sleep(0.2)
                os.kill(int(w.id), signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass

    def _hung_kept(self, not_leaving: list[Any]) -> list[tuple[Any, str, timedelta]]:
        """Kept workers that have not begun to leave and made no progress for --hang-timeout: hung (a stopped
        process, say), so they will not leave; restarted now rather than after AgentConfig.reform_leave_timeout.
        Seen when a peer's agent judged its own worker hung first (blocked in a collective with this one) and
        opened the round: hang detection here pauses during a re-formation, and the hung worker waited 10 s."""
        timeout = self.agent_config.hang_timeout
        if timeout is None:
            return []
        return [(w, "leave its process group (no progress: hung)", timeout)
                for w in self._judged_hung(not_leaving, timeout.total_seconds())]


STOPPED_SHARE = 0.5
"""A stopped worker (SIGSTOP or a job-control stop: state T) is judged hung after this share of --hang-timeout:
early enough that its peers' agents, whose workers wait in a collective with it and are judged at the full
timeout, see the new round first."""


def _stopped(pid: Any) -> bool:
    """Whether the worker `pid` is stopped by a signal (not by a debugger's trace: that one is someone's choice)."""
    try:
        st = procfs.stat(int(pid))
    except (TypeError, ValueError):
        return False
    return st is not None and st.state == "T"


_HUNG_LEAVE_GRACE = timedelta(seconds=2)
"""How long a kept worker has to begin leaving its process group for a new round before one without progress for
--hang-timeout is judged hung (a healthy one blocked in a collective on a hung peer begins within ~0.1 s)."""

_PERSIST_TIMEOUT = timedelta(minutes=5)
"""How long workers may take to persist their state and exit when the job stops below its minimum of nodes."""

_JOINER_WARM_TIMEOUT = timedelta(minutes=2)
"""How long a joining node waits for its workers' processes to warm up before it joins the round anyway."""

_SPARE_FAILURES_MAX = 3
"""Spares that died unused before the agent stops offering one (a script whose imports crash, say)."""

# What torch's agent sets per worker and per round (local_elastic_agent._start_workers).
_ROUND_KEYS = ("RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", reform.ENV_GENERATION)


def _round_env(worker_group: WorkerGroup, worker: Any, restart_count: int, generation: int) -> dict[str, str]:
    """The per-round variables of one worker, as torch's `_start_workers` sets them."""
    return {"RANK": str(worker.global_rank), "GROUP_RANK": str(worker_group.group_rank),
            "ROLE_RANK": str(worker.role_rank), "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(worker_group.group_world_size), "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": str(worker_group.master_addr), "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count), reform.ENV_GENERATION: str(generation)}


def _accepted(target: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `target` accepts (older torch releases lack some)."""
    params = inspect.signature(target).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def launch(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: list[Any], agent_config: AgentConfig
) -> dict[int, Any]:
    """Run one node's agent to completion (torch's `launch_agent`, with `ElasticAgent`)."""
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    if hasattr(config, "signals_to_handle"):
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    # LaunchConfig, WorkerSpec and LocalElasticAgent grow fields between torch releases
    # (torch>=2.4 is supported): pass along only what this torch has.
    optional = {name: getattr(config, name) for name in (
        "event_log_handler", "numa_options", "duplicate_stdout_filters", "duplicate_stderr_filters",
        "virtual_local_rank", "local_addr") if hasattr(config, name)}
    spec = WorkerSpec(**_accepted(WorkerSpec, dict(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        **optional,
    )))
    agent = ElasticAgent(spec, agent_config=agent_config, **_accepted(LocalElasticAgent.__init__, dict(
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=getattr(config, "shutdown_timeout", None),
    )))
    events.route_to_torch(getattr(config, "event_log_handler", "null"))
    shutdown_rdzv = True
    try:
        torch_metrics.initialize_metrics(torch_metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=_get_entrypoint_name(entrypoint, args), failures=result.failures)
        if isinstance(spec.rdzv_handler, RoundAware):
            spec.rdzv_handler.mark_succeeded()  # the handler closes the run on shutdown only after a success
        return result.return_values
    except SignalException:
        # Killed by a signal: leave the run open so the other nodes can carry on without us.
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        agent.dismiss_spare()
        if agent.ckpt_helper is not None:
            agent.ckpt_helper.stop()
        agent.job.finish()  # the one-line summary, from the workers' metrics files
        shutil.rmtree(agent.progress_dir, ignore_errors=True)
        if agent.tier0_dir is not None:
            tier0_dir.remove_node_dir(agent.tier0_dir)
            os.environ.pop(tier0_dir.ENV, None)
        agent.metrics.stop()
