"""From what the jobs did to the report: the reference taken from the fault-free job, the cost of each
fault, the evidence for the invariants, and the report itself. Pure functions over `JobResult`s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos import invariants as inv
from chaos import lineage as ln
from chaos import report as rpt
from chaos import timeline as tl
from chaos.config import ChaosConfig
from chaos.faults import CATALOG
from chaos.schedule import PlannedFault, describe_target
from ckpt.layout import parse_rank_dir_name
from trainer.data import DataConfig


class ChaosError(Exception):
    """The run could not be judged (e.g. the fault-free reference run failed)."""


@dataclass
class JobResult:
    """What one job (the reference or the chaos run) did."""

    events: list[tl.Event]
    attempts: list[ln.Attempt]
    lineage: ln.Lineage
    completed: bool
    completion_detail: str
    final_digest: str | None
    final_world: int | None
    duration_s: float
    t0: float
    orphans: list[str]
    consumed: tuple[dict[int, list[int]], list[str]] | None = None
    """Sample ids per committed step, from the workers' sample log, and gaps in them."""


@dataclass
class Reference:
    digest: str | None
    world: int | None
    losses: dict[int, float | None]
    seconds_per_step: float | None
    """For scripts that emit no steps: faults fire at times estimated from this..."""
    startup_s: float = 0.0
    """... counted from this long after the job started (its first worker start, if any)."""
    notes: list[str] = field(default_factory=list)
    job: dict[str, Any] = field(default_factory=dict)
    """What the reference ran (`job_key`): another run may reuse it only for the same job."""
    goodput: float | None = None
    """The fault-free job's goodput (`goodput_of`); None: not measured (an older reference)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Reference:
        losses = {int(k): v for k, v in doc["losses"].items()}
        return cls(**{**doc, "losses": losses})


REFERENCE_FILE = "reference.json"
"""Written into every report directory whose run had a reference; `--reference DIR` reads it back."""


def job_key(config: ChaosConfig) -> dict[str, Any]:
    """The settings that decide what a fault-free run computes: equal keys, equal reference."""
    return {
        "script": str(config.script), "nodes": config.nodes,
        "script_args": None if config.script_args is None else list(config.script_args),
        "nproc_per_node": config.nproc_per_node, "max_nodes": config.max_nodes, "steps": config.steps,
        "ckpt_every": config.ckpt_every, "train_seed": config.train_seed,
        "global_batch": config.effective_global_batch, "dataset_size": config.effective_dataset_size,
        "step_sleep_s": config.effective_step_sleep,
    }


def load_reference(directory: Path, config: ChaosConfig) -> Reference:
    """The reference recorded in `directory` by an earlier run of the same job. ValueError (bad input)
    when there is none or it was made for another job."""
    path = directory / REFERENCE_FILE
    try:
        ref = Reference.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--reference {directory}: cannot read {path} ({exc}); pass the --report directory of an "
                         "earlier run whose reference run passed") from exc
    want = job_key(config)
    differs = sorted(k for k in set(want) | set(ref.job) if want.get(k) != ref.job.get(k))
    if differs:
        raise ValueError(f"--reference {directory}: its reference ran another job (different {', '.join(differs)}); "
                         "a reference serves only runs of the same script, arguments, nodes and steps")
    return ref


def save_reference(reference: Reference, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / REFERENCE_FILE).write_text(json.dumps(reference.to_json(), indent=1) + "\n")


def reference_of(job: JobResult, config: ChaosConfig) -> Reference:
    """The reference is the first attempt that finished, and it must have run without a restart."""
    worker_starts = [e for e in job.events if isinstance(e, tl.WorkerStart)]
    begin = worker_starts[0].t if worker_starts else job.t0
    digests = [e for e in job.events if isinstance(e, tl.Digest)]
    if not job.lineage.steps:
        per_step = (job.t0 + job.duration_s - begin) / config.steps
        return Reference(job.final_digest, job.final_world, {}, per_step, begin - job.t0, job=job_key(config),
                         goodput=goodput_of(job))
    done_t = digests[0].t if digests else float("inf")
    prefix = [e for e in job.events if e.t <= done_t]
    runs = ln.attempts(prefix)
    lin = ln.lineage(runs, config.resume_every)
    made_by = {c.attempt for c in lin.steps.values()}
    if len(made_by) > 1:
        raise ChaosError(f"the fault-free reference run restarted mid-run ({why_restarted(prefix)}), so it cannot "
                         "serve as the reference; see the reference-*.log files")
    notes = []
    if any(a.start_t > done_t and a.steps for a in job.attempts):
        notes.append(f"the fault-free reference job was restarted after it had finished ({why_restarted(job.events)}); "
                     "its digest is the one of the attempt that finished first")
    world = runs[made_by.pop()].world
    losses = {s: c.loss for s, c in lin.steps.items()}
    return Reference(digests[0].digest if digests else None, world, losses, None, begin - job.t0, notes,
                     job=job_key(config), goodput=goodput_of(job))


def goodput_of(job: JobResult) -> float | None:
    """The job's goodput as its agents measured it (the `job_summary` event of each agent that saw the
    end: the mean over their ranks of the step time kept, over the agent's wall-clock time), averaged
    over those agents; None when none reported it (a custom script without trainer, or no agent left)."""
    found = [float(e.fields["goodput"]) for e in job.events
             if isinstance(e, tl.AgentEvent) and e.name == "job_summary" and e.fields.get("goodput") is not None]
    return round(sum(found) / len(found), 4) if found else None


def why_restarted(events: list[tl.Event]) -> str:
    """The agents' reasons for the restarts among `events`, in words."""
    reasons = {e.name for e in events if isinstance(e, tl.AgentEvent) and e.name in ("hang_detected", "leave")}
    reasons |= {str(e.fields.get("reason")) for e in events if isinstance(e, tl.AgentEvent) and e.name == "restart"}
    return ", ".join(sorted(reasons)) or "no reason in the agents' events"


def in_flight(record: rpt.FaultRecord, ckpt_every: int) -> int:
    """Steps run after a checkpoint step whose save had not committed everywhere at the fault."""
    committed = record.details.get("committed_everywhere")
    if committed is None or record.at_step is None:
        return 0
    return max(0, record.at_step - committed - ckpt_every)


def cost_faults(records: list[rpt.FaultRecord], job: JobResult, t0: float) -> None:
    """Fill in each fired fault's detect_s, resume_s, steps_lost, restarts and, for a corruption,
    whether a restore on the damaged node rejected the damaged step (`exercised`), else the newer step the first
    resume after it went on from (`superseded_by`)."""
    fired = [r for r in records if r.injected_t is not None]
    for i, r in enumerate(fired):
        assert r.injected_t is not None
        start = t0 + r.injected_t
        after = fired[i + 1].injected_t if i + 1 < len(fired) else None
        end = t0 + after if after is not None else float("inf")
        cost = ln.fault_cost(job.events, job.attempts, job.lineage, start, end)
        r.detect_s, r.resume_s, r.steps_lost, r.restarts = cost.detect_s, cost.resume_s, cost.steps_lost, cost.restarts
        resumed = next((e.step for e in job.events if isinstance(e, tl.Resumed) and start < e.t < end), None)
        r.details["resumed_from"] = resumed
        step = r.details.get("corrupted_step")
        if step is not None:
            damaged = set(damaged_steps(r.details))
            r.details["exercised"] = any(isinstance(e, tl.CheckpointSkipped) and e.step in damaged
                                         and e.node == r.node and e.t > start for e in job.events)
            # Superseded only by a step newer than every damaged copy (tier 0's snapshots are newer than tier 1's).
            if not r.details["exercised"] and resumed is not None and resumed > max(damaged):
                r.details["superseded_by"] = resumed


def damaged_steps(details: dict[str, Any]) -> tuple[int, ...]:
    """The steps a corruption damaged a copy of (older reports: the corrupted tier-1 step alone)."""
    steps = details.get("damaged_steps") or [details.get("corrupted_step")]
    return tuple(sorted(s for s in steps if isinstance(s, int)))


def judge(config: ChaosConfig, job: JobResult, records: list[rpt.FaultRecord], reference: Reference,
          duration_s: float) -> rpt.Report:
    first_fault = min((job.t0 + r.injected_t for r in records if r.injected_t is not None), default=float("inf"))
    outcomes = [
        inv.FaultOutcome(
            kind=r.kind, injected=r.injected_t is not None, skipped=r.skipped, steps_lost=r.steps_lost,
            lost_bound=CATALOG[r.kind].lost_bound,
            injected_t=None if r.injected_t is None else job.t0 + r.injected_t,
            corrupted_step=r.details.get("corrupted_step"), corrupted_node=r.node,
            damaged_steps=damaged_steps(r.details),
            exercised=r.details.get("exercised"), superseded_by=r.details.get("superseded_by"),
            not_fired=r.details.get("not_fired"),
            corrupted_ranks=_ranks_of(r.details.get("files", {})),
            in_flight=in_flight(r, config.ckpt_every), node=r.node,
            held_everywhere=r.details.get("held_everywhere"), resumed_from=r.details.get("resumed_from"),
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
        in_process_expected=config.reform == "in-process" and config.is_default_script,
    )
    checks = inv.check_all(evidence)
    return rpt.Report(
        passed=all(c.ok for c in checks.values() if c.ok is not None),
        invariants={k: bool(c.ok) for k, c in checks.items() if c.ok is not None},
        not_checked={k: c.detail for k, c in checks.items() if c.ok is None},
        invariant_details={k: c.detail for k, c in checks.items()},
        faults=records, reference_digest=reference.digest, final_digest=job.final_digest,
        reference_world_size=reference.world, final_world_size=job.final_world, scenario=config.scenario,
        seed=config.seed, config=config_json(config), duration_s=round(duration_s, 2),
        notes=_notes(config, job, records, reference, evidence), plot=_plot(job, records),
        goodput=goodput_of(job), reference_goodput=reference.goodput,
    )


def _notes(config: ChaosConfig, job: JobResult, records: list[rpt.FaultRecord], reference: Reference,
           evidence: inv.Evidence) -> list[str]:
    notes = list(reference.notes)
    finished = [e.t for e in job.events if isinstance(e, tl.Digest)]
    if finished and any(a.start_t > finished[0] and a.steps for a in job.attempts):
        notes.append(f"the job was restarted after it had emitted its final digest ({why_restarted(job.events)}): "
                     "the framework re-ran it from its last checkpoint; the final digest is the last one emitted")
    if not config.is_default_script:
        notes.append("custom script: the data check replays no sampler (the harness does not know its data settings); "
                     "it checks the committed steps and the per-step losses against the reference")
    skipped = [r for r in records if r.skipped]
    if skipped:
        notes.append(f"{len(skipped)} fault(s) skipped, see the faults table; a skipped fault is not a passed one")
    if evidence.startup_lost:
        notes.append(f"the first round closed before every node had joined; {evidence.startup_lost} steps were re-run "
                     "at start-up (not charged to any fault)")
    return notes


def _ranks_of(files: dict[str, object]) -> tuple[int, ...]:
    """Rank numbers of the damaged files (`.../rank_00001/state.safetensors` -> 1)."""
    ranks = {parse_rank_dir_name(Path(f).parent.name) for f in files}
    return tuple(sorted(r for r in ranks if r is not None))


def _plot(job: JobResult, records: list[rpt.FaultRecord]) -> rpt.Plot:
    t0 = job.t0
    steps = [(round(s.t - t0, 3), s.step, i + 1) for i, a in enumerate(job.attempts) for s in a.steps]
    worlds = [(round(t - t0, 3), w) for t, w in ln.world_series(job.events, 1)] if any(
        isinstance(e, tl.WorkerStart) for e in job.events) else []
    faults = [(r.injected_t, r.kind) for r in records if r.injected_t is not None]
    recoveries = [r.injected_t + r.resume_s for r in records if r.injected_t is not None and r.resume_s is not None]
    return rpt.Plot(steps, worlds, faults, recoveries, end_t=job.duration_s)


def config_json(config: ChaosConfig) -> dict[str, object]:
    doc = asdict(config)
    doc["faults"] = [str(f) for f in config.faults]
    doc["global_batch"] = config.effective_global_batch
    doc["dataset_size"] = config.effective_dataset_size
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in doc.items()}


def error_report(config: ChaosConfig, fault_plan: tuple[PlannedFault, ...], error: str,
                 duration_s: float) -> rpt.Report:
    records = [rpt.FaultRecord(pf.index, pf.kind, None, describe_target(pf), pf.at_step, None) for pf in fault_plan]
    return rpt.Report(passed=False, invariants={}, not_checked={}, invariant_details={}, faults=records,
                      reference_digest=None, final_digest=None, reference_world_size=None, final_world_size=None,
                      scenario=config.scenario, seed=config.seed, config=config_json(config),
                      duration_s=round(duration_s, 2), error=error)
