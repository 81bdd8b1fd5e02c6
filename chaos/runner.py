"""One chaos run, top to bottom: etcd, a fault-free reference job, the same job under the fault plan,
the invariants, the report.

    report = run(ChaosConfig(report_dir=Path("out"), nodes=2, faults=parse_faults("kill-worker,kill-node")))
    assert report.passed

Both jobs run on the same etcd under different run ids, each on fresh local tiers and a fresh
shared tier. A fault fires at the first step at or past its planned step once the job has
recovered from the previous fault, so that each restart belongs to exactly one fault.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from chaos import invariants as inv
from chaos import report as rpt
from chaos import timeline as tl
from chaos.cluster import Cluster, EtcdMembers, ProcessLedger
from chaos.config import ChaosConfig
from chaos.faults import CATALOG
from chaos.inject import Capabilities, Target, inject, newest_committed, probe, skip_reason
from chaos.network import NetnsNetwork
from chaos.schedule import PlannedFault, plan
from ckpt.layout import parse_rank_dir_name
from core.procfs import descendants
from trainer.data import DataConfig

log = logging.getLogger("chaos")


class ChaosError(Exception):
    """The run could not be judged (e.g. the fault-free reference run failed)."""


@dataclass
class JobResult:
    """What one job (the reference or the chaos run) did."""

    events: list[tl.Event]
    attempts: list[tl.Attempt]
    lineage: tl.Lineage
    completed: bool
    completion_detail: str
    final_digest: str | None
    final_world: int | None
    duration_s: float
    t0: float
    orphans: list[str]
    consumed: tuple[dict[int, list[int]], list[str]] | None = None
    """Sample ids per committed step, from the workers' logs (with --log-samples), and gaps in them."""


@dataclass
class Reference:
    digest: str | None
    world: int | None
    losses: dict[int, str | None]
    seconds_per_step: float | None
    """For scripts that print no steps: faults fire at times estimated from this..."""
    startup_s: float = 0.0
    """... counted from this long after the job started (its first worker line, if any)."""
    notes: list[str] = field(default_factory=list)


def run(config: ChaosConfig, *, reference: Reference | None = None) -> tuple[rpt.Report, Reference | None]:
    """Run the reference job (unless given), then the chaos job; check; write the report."""
    started = time.monotonic()
    work = config.work_dir or Path(tempfile.mkdtemp(prefix="elastic-chaos-"))
    logs = config.report_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    kinds = {s.kind for s in config.faults}
    fault_plan = plan(config.faults, steps=config.steps, ckpt_every=config.ckpt_every, seed=config.seed,
                      nodes=config.nodes, nproc_per_node=config.nproc_per_node, etcd_members=config.etcd_members)
    caps = probe(config, kinds)
    skips = {pf.index: skip_reason(pf.kind, caps) for pf in fault_plan}
    tmpfs_mb = 256 if any(pf.kind == "disk-full" and skips[pf.index] is None for pf in fault_plan) else None
    network = None
    if any(pf.kind == "partition-node" and skips[pf.index] is None for pf in fault_plan):
        network = NetnsNetwork()
    etcd: EtcdMembers | None = None
    ledger = ProcessLedger()
    report: rpt.Report
    try:
        if network is not None:
            network.up()
        etcd = EtcdMembers(config.etcd_members, work / f"etcd-{config.seed}",
                           host=network.host_ip if network else "127.0.0.1")
        etcd.ledger = ledger
        etcd.start()
        log.info("elastic-chaos: etcd at %s; plan: %s", etcd.endpoints,
                 ", ".join(f"{pf.kind}@step {pf.at_step}" for pf in fault_plan) or "no faults")
        if reference is None:
            ref_job, _ = _job(config, "reference", (), {}, work, logs, etcd, ledger, caps, tmpfs_mb, None, None)
            if not ref_job.completed:
                raise ChaosError(f"the fault-free reference run failed ({ref_job.completion_detail}); "
                                 f"see {logs}/reference-*.log")
            reference = _reference(ref_job, config)
        chaos_job, records = _job(config, "chaos", fault_plan, skips, work, logs, etcd, ledger, caps, tmpfs_mb,
                                  reference, network)
        etcd.stop()
        ledger.kill_survivors()
        report = _judge(config, fault_plan, chaos_job, records, reference, time.monotonic() - started)
    except ChaosError as exc:
        report = _error_report(config, fault_plan, str(exc), time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001 - a harness bug must still end in a (failed) report
        log.exception("elastic-chaos: internal error")
        report = _error_report(config, fault_plan, f"internal error in elastic-chaos ({type(exc).__name__}: {exc}); "
                               f"please report it with the logs in {logs}", time.monotonic() - started)
    finally:
        if etcd is not None:
            etcd.stop()
        ledger.kill_survivors()
        ledger.close()
        if network is not None:
            network.down()
        if config.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    rpt.write(report, config.report_dir)
    return report, reference


def _reference(job: JobResult, config: ChaosConfig) -> Reference:
    """The reference is the first attempt that finished, and it must have run without a restart."""
    worker_starts = [e for e in job.events if isinstance(e, tl.WorkerStart)]
    begin = worker_starts[0].t if worker_starts else job.t0
    digests = [e for e in job.events if isinstance(e, tl.Digest)]
    if not job.lineage.steps:
        per_step = (job.t0 + job.duration_s - begin) / config.steps
        return Reference(job.final_digest, job.final_world, {}, per_step, begin - job.t0)
    done_t = digests[0].t if digests else float("inf")
    prefix = [e for e in job.events if e.t <= done_t]
    runs = tl.attempts(prefix)
    lin = tl.lineage(runs, config.ckpt_every)
    made_by = {c.attempt for c in lin.steps.values()}
    if len(made_by) > 1:
        raise ChaosError(f"the fault-free reference run restarted mid-run ({_why_restarted(prefix)}), so it cannot "
                         "serve as the reference; see the reference-*.log files")
    notes = []
    if any(a.start_t > done_t and a.steps for a in job.attempts):
        notes.append(f"the fault-free reference job was restarted after it had finished ({_why_restarted(job.events)}); "
                     "its digest is the one of the attempt that finished first")
    world = runs[made_by.pop()].world
    losses = {s: c.loss for s, c in lin.steps.items()}
    return Reference(digests[0].digest if digests else None, world, losses, None, begin - job.t0, notes)


def _why_restarted(events: list[tl.Event]) -> str:
    reasons = sorted({e.name for e in events if isinstance(e, tl.AgentEvent) and e.name in ("hang_detected", "leave")}
                     | {"worker group failed" for e in events if isinstance(e, tl.AgentFailure)})
    return ", ".join(reasons) or "no reason in the agents' events"


def _job(config: ChaosConfig, name: str, fault_plan: tuple[PlannedFault, ...], skips: dict[int, str | None],
         work: Path, logs: Path, etcd: EtcdMembers, ledger: ProcessLedger, caps: Capabilities, tmpfs_mb: int | None,
         reference: Reference | None, network: NetnsNetwork | None) -> tuple[JobResult, list[rpt.FaultRecord]]:
    shared_flag = caps.shared_flag if config.is_default_script else None
    cluster = Cluster(config, name=name, work_dir=work / f"{name}-{config.seed}", log_dir=logs, etcd=etcd,
                      ledger=ledger, shared_flag=shared_flag, samples_flag=caps.samples_flag, network=network)
    t0 = cluster.t0
    deadline = t0 + config.timeout_s
    records: list[rpt.FaultRecord] = []
    try:
        cluster.start(config.nodes, tmpfs_mb=tmpfs_mb)
        if fault_plan:
            records = _drive(config, cluster, fault_plan, skips, deadline, reference,
                             Target(cluster, etcd, ledger, tmpfs_mb, network=network))
        finished = cluster.wait(cluster.finished, deadline, poll_s=0.1)
        ended = time.monotonic()
        if finished:
            time.sleep(1.0)  # let the agents' last children go before counting orphans
        # etcd serves both jobs; a partitioned node cannot learn that the job ended: neither is an orphan.
        exempt = {p for pid in etcd.pids() for p in (pid, *descendants(pid))}
        exempt |= {p for n in cluster.nodes if n.partitioned for p in (n.pid, *descendants(n.pid))}
        orphans = [s for s in ledger.survivors() if int(s.split()[0]) not in exempt] if finished else []
    finally:
        cluster.stop()
    codes = {n.name: n.proc.returncode for n in cluster.nodes if not n.killed and not n.partitioned}
    if not finished:
        completed, detail = False, f"the job did not finish within {config.timeout_s:.0f} s (--timeout)"
    elif any(rc != 0 for rc in codes.values()):
        completed, detail = False, "agents exited with " + ", ".join(f"{k}: {v}" for k, v in codes.items())
    else:
        completed, detail = True, f"{len(codes)} agents exited 0 after {ended - t0:.1f} s"
    events = cluster.timeline.events()
    runs = tl.attempts(events)
    lin = tl.lineage(runs, config.ckpt_every)
    digests = [e.digest for e in events if isinstance(e, tl.Digest)]
    world = next((a.world for a in reversed(runs) if a.world is not None), None)
    if world is None:
        series = tl.world_series(events, config.nproc_per_node)
        world = series[-1][1] if series else None
    consumed = None
    if cluster.samples_flag and config.is_default_script:
        consumed = tl.consumed_by_step(events, runs, lin, tl.read_samples(cluster.samples_dir))
    job = JobResult(events, runs, lin, completed, detail, digests[-1] if digests else None, world, ended - t0, t0,
                    orphans, consumed)
    _cost_faults(records, job, t0)
    return job, records


def _drive(config: ChaosConfig, cluster: Cluster, fault_plan: tuple[PlannedFault, ...], skips: dict[int, str | None],
           deadline: float, reference: Reference | None, target: Target) -> list[rpt.FaultRecord]:
    """Fire each planned fault in turn; wait for the job to recover before the next one."""
    records = []
    full_world = config.nodes * config.nproc_per_node
    timeline = cluster.timeline
    by_time = reference is not None and reference.seconds_per_step is not None

    def formed() -> bool:
        runs = tl.attempts(timeline.events())
        return bool(runs) and runs[-1].steps != [] and runs[-1].world in (full_world, None)

    if by_time:
        assert reference is not None
        cluster.wait(partial(_time_reached, cluster, cluster.t0 + reference.startup_s), deadline)
    else:
        cluster.wait(lambda: cluster.finished() or formed(), deadline, poll_s=0.1)
    never_formed = None if by_time or formed() else (
        f"the job never trained at its full world size {full_world}; see the start-up in the node logs")
    armed_at = time.monotonic()
    last_recovery = armed_at
    healthy = True
    for pf in fault_plan:
        record = rpt.FaultRecord(pf.index, pf.kind, None, _describe_target(pf), pf.at_step, None)
        records.append(record)
        if skips.get(pf.index):
            record.skipped = skips[pf.index]
            continue
        if never_formed:
            record.details["not_fired"] = never_formed
            continue
        if not healthy:
            record.details["not_fired"] = "the job had not recovered from the previous fault"
            continue
        if by_time:
            assert reference is not None and reference.seconds_per_step is not None
            fire_at = armed_at + pf.at_step * reference.seconds_per_step
            reached = cluster.wait(partial(_time_reached, cluster, fire_at), deadline)
        else:
            reached = cluster.wait(partial(_step_reached, cluster, pf.at_step, last_recovery), deadline, poll_s=0.02)
        if cluster.finished() or not reached:
            record.details["not_fired"] = (f"the job {'finished' if cluster.finished() else 'timed out'} before step "
                                          f"{pf.at_step}; give it more --steps or fewer faults")
            continue
        latest = timeline.latest_step()
        committed = _committed_everywhere(cluster)
        t_inj = time.monotonic()
        injection = inject(pf, target)
        record.node, record.target, record.details = injection.node, injection.target or record.target, injection.details
        if injection.skipped:
            record.skipped = injection.skipped
            continue
        record.at_step = latest.step if latest else None
        record.injected_t = round(t_inj - cluster.t0, 3)
        record.details["committed_everywhere"] = committed
        record.details["corrupted_step"] = injection.corrupted_step
        log.info("elastic-chaos: fault %d %s on %s at step %s", pf.index + 1, pf.kind, injection.target, record.at_step)
        recovery_deadline = min(deadline, time.monotonic() + config.recovery_timeout_s)
        if CATALOG[pf.kind].restarts:
            ok = cluster.wait(partial(_restarted, cluster, t_inj), recovery_deadline, poll_s=0.1)
        else:
            ok = cluster.wait(partial(_progressed, cluster, time.monotonic()), recovery_deadline, poll_s=0.1)
        if not ok:
            record.details["recovered"] = False
            healthy = False
            log.warning("elastic-chaos: no progress within %.0f s after %s", config.recovery_timeout_s, pf.kind)
        last_recovery = time.monotonic()
    return records


# Wait conditions: each also ends the wait when the job is over.


def _time_reached(cluster: Cluster, at: float) -> bool:
    return cluster.finished() or time.monotonic() >= at


def _step_reached(cluster: Cluster, step: int, since: float) -> bool:
    latest = cluster.timeline.latest_step(since=since)
    return cluster.finished() or (latest is not None and latest.step >= step)


def _restarted(cluster: Cluster, since: float) -> bool:
    """A worker group started after `since` has made a step."""
    return cluster.finished() or any(a.start_t >= since and a.steps for a in tl.attempts(cluster.timeline.events()))


def _progressed(cluster: Cluster, since: float) -> bool:
    return cluster.finished() or cluster.timeline.latest_step(since=since) is not None


def _committed_everywhere(cluster: Cluster) -> int | None:
    """The newest step committed in the local tier of every live node (None: no node has one,
    e.g. a custom script that keeps its checkpoints elsewhere)."""
    steps = [newest_committed(n.local_dir)[0] for n in cluster.live_nodes]
    if all(s is None for s in steps):
        return None
    return min(s or 0 for s in steps)


def _in_flight(record: rpt.FaultRecord, ckpt_every: int) -> int:
    """Steps run after a checkpoint step whose save had not committed everywhere at the fault."""
    committed = record.details.get("committed_everywhere")
    if committed is None or record.at_step is None:
        return 0
    return max(0, record.at_step - committed - ckpt_every)


def _describe_target(pf: PlannedFault) -> str:
    kind = CATALOG[pf.kind].target
    if kind == "worker":
        return f"global rank {pf.target}"
    if kind == "node":
        return f"group rank {pf.target}"
    if kind == "etcd":
        return f"etcd member m{pf.target}"
    return ""


def _cost_faults(records: list[rpt.FaultRecord], job: JobResult, t0: float) -> None:
    fired = [r for r in records if r.injected_t is not None]
    for i, r in enumerate(fired):
        assert r.injected_t is not None
        start = t0 + r.injected_t
        end = t0 + fired[i + 1].injected_t if i + 1 < len(fired) else float("inf")  # type: ignore[operator]
        cost = tl.fault_cost(job.events, job.attempts, job.lineage, start, end)
        r.detect_s, r.resume_s, r.steps_lost, r.restarts = cost.detect_s, cost.resume_s, cost.steps_lost, cost.restarts
        step = r.details.get("corrupted_step")
        if step is not None:
            r.details["exercised"] = any(isinstance(e, tl.CheckpointSkipped) and e.step == step and e.node == r.node
                                         and e.t > start for e in job.events)


def _judge(config: ChaosConfig, fault_plan: tuple[PlannedFault, ...], job: JobResult,
           records: list[rpt.FaultRecord], reference: Reference, duration_s: float) -> rpt.Report:
    first_fault = min((job.t0 + r.injected_t for r in records if r.injected_t is not None), default=float("inf"))
    outcomes = [
        inv.FaultOutcome(
            kind=r.kind, injected=r.injected_t is not None, skipped=r.skipped, steps_lost=r.steps_lost,
            lost_bound=CATALOG[r.kind].lost_bound,
            injected_t=None if r.injected_t is None else job.t0 + r.injected_t,
            corrupted_step=r.details.get("corrupted_step"), corrupted_node=r.node,
            exercised=r.details.get("exercised"), not_fired=r.details.get("not_fired"),
            corrupted_ranks=_ranks_of(r.details.get("files", {})),
            in_flight=_in_flight(r, config.ckpt_every),
        )
        for r in records
    ]
    data = None
    if config.is_default_script:
        data = DataConfig(dataset_size=config.effective_dataset_size, global_batch=config.effective_global_batch,
                          seed=config.train_seed)
    orphans = list(job.orphans)
    for r in records:
        orphans += [f"{pid} (left alive by kill-node of {r.node})" for pid in r.details.get("left_alive", [])]
    evidence = inv.Evidence(
        steps=config.steps, ckpt_every=config.ckpt_every, data=data, completed=job.completed,
        completion_detail=job.completion_detail, lineage=job.lineage, events=job.events, faults=outcomes,
        orphans=orphans, final_digest=job.final_digest, reference_digest=reference.digest,
        reference_world=reference.world, reference_losses=reference.losses,
        startup_lost=sum(n for t, n in job.lineage.lost if t < first_fault),
        consumed=job.consumed[0] if job.consumed else None,
        consumed_problems=job.consumed[1] if job.consumed else [],
    )
    checks = inv.check_all(evidence)
    notes = list(reference.notes)
    finished = [e.t for e in job.events if isinstance(e, tl.Digest)]
    if finished and any(a.start_t > finished[0] and a.steps for a in job.attempts):
        notes.append(f"the job was restarted after it had printed its final digest ({_why_restarted(job.events)}): "
                     "the framework re-ran it from its last checkpoint; the final digest is the last one printed")
    if not config.is_default_script:
        notes.append("custom script: the data check replays no sampler (the harness does not know its data settings); "
                     "it checks the committed steps and the per-step losses against the reference")
    skipped = [r for r in records if r.skipped]
    if skipped:
        notes.append(f"{len(skipped)} fault(s) skipped, see the faults table; a skipped fault is not a passed one")
    if evidence.startup_lost:
        notes.append(f"the first round closed before every node had joined; {evidence.startup_lost} steps were re-run "
                     "at start-up (not charged to any fault)")
    return rpt.Report(
        passed=all(c.ok for c in checks.values() if c.ok is not None),
        invariants={k: bool(c.ok) for k, c in checks.items() if c.ok is not None},
        not_checked={k: c.detail for k, c in checks.items() if c.ok is None},
        invariant_details={k: c.detail for k, c in checks.items()},
        faults=records, reference_digest=reference.digest, final_digest=job.final_digest,
        reference_world_size=reference.world, final_world_size=job.final_world, scenario=config.scenario,
        seed=config.seed, config=_config_json(config), duration_s=round(duration_s, 2), notes=notes,
        plot=_plot(job, records),
    )


def _ranks_of(files: dict[str, object]) -> tuple[int, ...]:
    """Rank numbers of the damaged files (`.../rank_00001/state.safetensors` -> 1)."""
    ranks = {parse_rank_dir_name(Path(f).parent.name) for f in files}
    return tuple(sorted(r for r in ranks if r is not None))


def _plot(job: JobResult, records: list[rpt.FaultRecord]) -> rpt.Plot:
    t0 = job.t0
    steps = [(round(s.t - t0, 3), s.step, i + 1) for i, a in enumerate(job.attempts) for s in a.steps]
    worlds = [(round(t - t0, 3), w) for t, w in tl.world_series(job.events, 1)] if any(
        isinstance(e, tl.WorkerStart) for e in job.events) else []
    faults = [(r.injected_t, r.kind) for r in records if r.injected_t is not None]
    recoveries = [r.injected_t + r.resume_s for r in records if r.injected_t is not None and r.resume_s is not None]
    return rpt.Plot(steps, worlds, faults, recoveries, end_t=job.duration_s)


def _config_json(config: ChaosConfig) -> dict[str, object]:
    doc = asdict(config)
    doc["faults"] = [str(f) for f in config.faults]
    doc["global_batch"] = config.effective_global_batch
    doc["dataset_size"] = config.effective_dataset_size
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in doc.items()}


def _error_report(config: ChaosConfig, fault_plan: tuple[PlannedFault, ...], error: str, duration_s: float) -> rpt.Report:
    records = [rpt.FaultRecord(pf.index, pf.kind, None, _describe_target(pf), pf.at_step, None) for pf in fault_plan]
    return rpt.Report(passed=False, invariants={}, not_checked={}, invariant_details={}, faults=records,
                      reference_digest=None, final_digest=None, reference_world_size=None, final_world_size=None,
                      scenario=config.scenario, seed=config.seed, config=_config_json(config),
                      duration_s=round(duration_s, 2), error=error)
