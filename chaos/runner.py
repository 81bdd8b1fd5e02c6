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
from functools import partial
from pathlib import Path

from chaos import lineage as ln
from chaos import report as rpt
from chaos.cluster import Cluster
from chaos.config import ChaosConfig
from chaos.etcd_members import EtcdMembers
from chaos.faults import CATALOG
from chaos.inject import Capabilities, Target, inject, newest_committed, probe, skip_reason, steps_held
from chaos.judge import (
    ChaosError,
    JobResult,
    Reference,
    cost_faults,
    error_report,
    judge,
    reference_of,
    save_reference,
)
from chaos.ledger import ProcessLedger
from chaos.network import NetnsNetwork
from chaos.samples import consumed_by_step, read_samples
from chaos.schedule import PlannedFault, describe_target, plan
from chaos.timeline import Digest
from core.procfs import descendants

log = logging.getLogger("chaos")


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
            reference = reference_of(ref_job, config)
        save_reference(reference, config.report_dir)  # for `--reference` of a later run of the same job
        chaos_job, records = _job(config, "chaos", fault_plan, skips, work, logs, etcd, ledger, caps, tmpfs_mb,
                                  reference, network)
        etcd.stop()
        ledger.kill_survivors()
        report = judge(config, chaos_job, records, reference, time.monotonic() - started)
    except ChaosError as exc:
        report = error_report(config, fault_plan, str(exc), time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001 - a harness bug must still end in a (failed) report
        log.exception("elastic-chaos: internal error")
        report = error_report(config, fault_plan, f"internal error in elastic-chaos ({type(exc).__name__}: {exc}); "
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


def _job(config: ChaosConfig, name: str, fault_plan: tuple[PlannedFault, ...], skips: dict[int, str | None],
         work: Path, logs: Path, etcd: EtcdMembers, ledger: ProcessLedger, caps: Capabilities, tmpfs_mb: int | None,
         reference: Reference | None, network: NetnsNetwork | None) -> tuple[JobResult, list[rpt.FaultRecord]]:
    shared_flag = caps.shared_flag if config.is_default_script else None
    cluster = Cluster(config, name=name, work_dir=work / f"{name}-{config.seed}", log_dir=logs, etcd=etcd,
                      ledger=ledger, shared_flag=shared_flag, network=network)
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
        orphans = _orphans(cluster, etcd, ledger) if finished else []
    finally:
        cluster.stop()
    codes = {n.name: n.proc.returncode for n in cluster.nodes if not n.killed and not n.partitioned}
    if not finished:
        completed, detail = False, f"the job did not finish within {config.timeout_s:.0f} s (--timeout)"
    elif any(rc != 0 for rc in codes.values()):
        completed, detail = False, "agents exited with " + ", ".join(f"{k}: {v}" for k, v in codes.items())
    else:
        completed, detail = True, f"{len(codes)} agents exited 0 after {ended - t0:.1f} s"
    events = cluster.timeline.load()  # every node's event files, read whole now that the job is over
    runs = ln.attempts(events)
    lin = ln.lineage(runs, config.resume_every)
    digests = [e.digest for e in events if isinstance(e, Digest)]
    world = next((a.world for a in reversed(runs) if a.world is not None), None)
    if world is None:
        series = ln.world_series(events, config.nproc_per_node)
        world = series[-1][1] if series else None
    consumed = None
    if config.is_default_script:  # a custom script's data settings are unknown to the harness
        consumed = consumed_by_step(events, runs, lin, read_samples(cluster.samples_dir))
    job = JobResult(events, runs, lin, completed, detail, digests[-1] if digests else None, world, ended - t0, t0,
                    orphans, consumed)
    cost_faults(records, job, t0)
    return job, records


def _orphans(cluster: Cluster, etcd: EtcdMembers, ledger: ProcessLedger, grace_s: float = 1.0) -> list[str]:
    """What the job left alive once its agents exited, after `grace_s` for the agents' last children to go."""
    # etcd serves both jobs; a partitioned node cannot learn that the job ended: neither is an orphan.
    exempt = {p for pid in etcd.pids() for p in (pid, *descendants(pid))}
    exempt |= {p for n in cluster.nodes if n.partitioned for p in (n.pid, *descendants(n.pid))}

    def left() -> list[str]:
        return [s for s in ledger.survivors() if int(s.split()[0]) not in exempt]

    cluster.wait(lambda: not left(), time.monotonic() + grace_s)
    return left()


def _drive(config: ChaosConfig, cluster: Cluster, fault_plan: tuple[PlannedFault, ...], skips: dict[int, str | None],
           deadline: float, reference: Reference | None, target: Target) -> list[rpt.FaultRecord]:
    """Fire each planned fault in turn; wait for the job to recover before the next one."""
    records = []
    full_world = config.nodes * config.nproc_per_node
    timeline = cluster.timeline
    by_time = reference is not None and reference.seconds_per_step is not None

    def formed() -> bool:
        runs = ln.attempts(timeline.events())
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
        record = rpt.FaultRecord(pf.index, pf.kind, None, describe_target(pf), pf.at_step, None)
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
        held = _held_everywhere(cluster, config.nproc_per_node)
        t_inj = time.monotonic()
        injection = inject(pf, target)
        record.node, record.details = injection.node, injection.details
        record.target = injection.target or record.target
        if injection.skipped:
            record.skipped = injection.skipped
            continue
        record.at_step = latest.step if latest else None
        record.injected_t = round(t_inj - cluster.t0, 3)
        record.details["committed_everywhere"] = committed
        record.details["held_everywhere"] = held
        record.details["corrupted_step"] = injection.corrupted_step
        if injection.damaged_steps:
            record.details["damaged_steps"] = list(injection.damaged_steps)
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
    return cluster.finished() or any(a.start_t >= since and a.steps for a in ln.attempts(cluster.timeline.events()))


def _progressed(cluster: Cluster, since: float) -> bool:
    return cluster.finished() or cluster.timeline.latest_step(since=since) is not None


def _held_everywhere(cluster: Cluster, nproc: int) -> int | None:
    """The newest step every live node holds whole, in tier 0 or tier 1, as a restore agrees on one (None: there
    is none). Not the oldest of each node's newest: a node that skipped snapshots may hold that step, another not."""
    held = [steps_held(n, nproc) for n in cluster.live_nodes]
    common = set.intersection(*held) if held else set()
    return max(common) if common else None


def _committed_everywhere(cluster: Cluster) -> int | None:
    """The newest step committed in the local tier of every live node (None: no node has one,
    e.g. a custom script that keeps its checkpoints elsewhere)."""
    steps = [newest_committed(n.local_dir)[0] for n in cluster.live_nodes]
    if all(s is None for s in steps):
        return None
    return min(s or 0 for s in steps)


