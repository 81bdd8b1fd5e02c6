"""What follows from a job's timeline: the attempts of the worker group, the committed line of steps
(each attempt's steps cut back at every resume), the world size over time, and the cost of a fault.
Pure functions over `chaos.timeline` events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chaos.timeline import AgentEvent, Event, FailureSeen, PeerStep, Resumed, Step, WorkerStart


@dataclass
class Attempt:
    """One start of the worker group: from its workers' start to its last step."""

    start_t: float
    world: int | None
    resumed_from: int = 0
    steps: list[Step] = field(default_factory=list)
    in_place: bool = False
    """Re-formed in place: resumed from memory, at any step."""
    opened_by_resume: bool = False
    """Begun at rank 0's `resumed`, not at a worker start (rank 0 re-formed in place says `resumed`, then
    `reformed`: one attempt)."""


def attempts(events: list[Event]) -> list[Attempt]:
    """Split the job into attempts. A new attempt begins at a rank-0 `worker_started`, or, should
    none be emitted, when the step count goes back.

    Rank 0's steps are the attempt's, and one more at its end: a step its peers completed that rank 0 did not
    report. A rank killed (or stopped) after its part of a step's collectives does not report the step its peers
    complete with it, and those peers, re-formed in place, go on from it."""
    out: list[Attempt] = []
    peers: list[PeerStep] = []  # the current attempt's steps reported by other ranks

    def end_attempt() -> None:
        if out:
            last = out[-1].steps[-1].step if out[-1].steps else out[-1].resumed_from
            done = next((p for p in peers if p.step == last + 1), None)
            if done is not None:
                out[-1].steps.append(Step(done.t, done.node, done.step, done.loss))
        peers.clear()

    for e in events:
        if isinstance(e, WorkerStart) and e.rank == 0:
            if out and not out[-1].steps and out[-1].opened_by_resume:
                out[-1].world = e.world  # the `reformed` that follows the `resumed` of one in-place re-formation
            else:
                end_attempt()
                out.append(Attempt(e.t, e.world))
        elif isinstance(e, Resumed):
            if not out or out[-1].steps:
                end_attempt()
                out.append(Attempt(e.t, out[-1].world if out else None, opened_by_resume=True))
            out[-1].resumed_from = e.step
            out[-1].in_place = e.in_place
        elif isinstance(e, PeerStep):
            peers.append(e)
        elif isinstance(e, Step):
            if not out:
                out.append(Attempt(e.t, None))
            elif out[-1].steps and e.step <= out[-1].steps[-1].step:
                end_attempt()
                out.append(Attempt(e.t, out[-1].world, resumed_from=e.step - 1))
            out[-1].steps.append(e)
    end_attempt()
    return out


@dataclass(frozen=True)
class CommittedStep:
    step: int
    t: float
    loss: float | None
    world: int | None
    attempt: int = 0
    """Index of the attempt that computed it."""


@dataclass
class Lineage:
    """The steps the final state is made of: each attempt's steps, cut back at every resume."""

    steps: dict[int, CommittedStep]
    problems: list[str]
    """Resumes from a step never reached or not a checkpoint, steps skipped or repeated."""
    lost: list[tuple[float, int]]
    """(attempt start time, steps thrown away by that restart) for every attempt after the first."""


def lineage(runs: list[Attempt], resume_every: int) -> Lineage:
    """`resume_every`: resumes are at multiples of it (checkpoints, or tier-0 snapshots)."""
    committed: dict[int, CommittedStep] = {}
    problems: list[str] = []
    lost: list[tuple[float, int]] = []
    reached = 0
    for i, attempt in enumerate(runs):
        start = attempt.resumed_from
        if i > 0:
            lost.append((attempt.start_t, max(0, reached - start)))
        if start > reached:
            problems.append(f"attempt {i + 1} resumed from step {start}, but the job had only reached step {reached}")
        elif start and start % resume_every and not attempt.in_place:
            problems.append(f"attempt {i + 1} resumed from step {start}, which is not a checkpoint step "
                            f"(every {resume_every})")
        committed = {s: c for s, c in committed.items() if s <= start}
        prev = start
        for e in attempt.steps:
            if e.step != prev + 1:
                what = "repeated" if e.step <= prev else "skipped"
                problems.append(f"attempt {i + 1}: step {e.step} follows step {prev} (steps {what})")
            committed[e.step] = CommittedStep(e.step, e.t, e.loss, attempt.world, i)
            prev = e.step
        reached = prev if attempt.steps else start
    return Lineage(committed, problems, lost)


def world_series(events: list[Event], nproc_per_node: int) -> list[tuple[float, int]]:
    """(time, world size) at every change: from rank-0 `worker_started`, else the agents' rounds."""
    series = [(e.t, e.world) for e in events if isinstance(e, WorkerStart) and e.rank == 0]
    if not series:
        seen: set[object] = set()
        for e in events:
            if isinstance(e, AgentEvent) and e.name == "round_closed" and e.fields.get("generation") not in seen:
                seen.add(e.fields.get("generation"))
                series.append((e.t, int(e.fields.get("world_size", 0)) * nproc_per_node))
    return series


@dataclass(frozen=True)
class FaultCost:
    detect_s: float | None
    """Fault to the first sign that the system noticed it (an agent saw it, or reacted to it)."""
    resume_s: float | None
    """Fault to the first training step of the attempt that recovered from it."""
    steps_lost: int
    """Steps computed before the fault and thrown away by the restarts it caused."""
    restarts: int
    """Restarts of the worker group in the fault's window."""


_DETECTIONS = {"hang_detected", "leave", "restart", "round_closed", "degraded"}


def _detects(e: Event) -> bool:
    if isinstance(e, FailureSeen):
        return True
    if not isinstance(e, AgentEvent) or e.name not in _DETECTIONS:
        return False
    if e.name == "leave" and e.fields.get("reason") == "shutdown":
        return False  # a node leaving at the end of the job
    return not (e.name == "degraded" and not e.fields.get("degraded"))  # the end of an etcd outage


def fault_cost(events: list[Event], runs: list[Attempt], lin: Lineage, start: float, end: float) -> FaultCost:
    """What the fault injected at `start` cost, judged from the events before `end` (the next fault)."""
    detect = next((e.t for e in events if start <= e.t < end and _detects(e)), None)
    restarted = [a for a in runs if start <= a.start_t < end]
    resume = next((a.steps[0].t for a in restarted if a.steps), None)
    lost = sum(n for t, n in lin.lost if start <= t < end)
    return FaultCost(
        detect_s=None if detect is None else round(detect - start, 3),
        resume_s=None if resume is None else round(resume - start, 3),
        steps_lost=lost,
        restarts=len(restarted),
    )
