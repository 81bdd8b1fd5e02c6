"""What happened, in order: every node's output parsed into timestamped events, and what follows
from them (the attempts of the worker group, the committed line of steps, the cost of each fault).

The harness reads the same lines a user sees. A training script reports to it by printing, on
rank 0 (the contract of `examples/train_tiny.py`):

    worker rank=R world=W pid=P restart=C     every worker, once at start
    step=<n> loss=<x>                         after every optimizer step
    resumed from step K                       after restoring checkpoint K
    final_digest=<hex>                        at the end

plus the trainer's warnings (`skipping checkpoint step N: ...`) and the agents' JSON event lines
(logger `elastic.events`). A script that prints none of these still runs; the checks that need
them say so in the report instead of passing.

Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PREFIX = r"^(?:\[[^\]]*\]:?\s*)?"  # torchrun's --tee / --log-line-prefix-template, e.g. "[default0]:"
_STEP = re.compile(_PREFIX + r"step=(\d+)(?:\s+loss=(\S+))?")
_WORKER = re.compile(r"worker rank=(\d+) world=(\d+) pid=(\d+) restart=(\d+)")
_RESUMED = re.compile(_PREFIX + r"resumed from step (\d+)")
_DIGEST = re.compile(_PREFIX + r"final_digest=([0-9a-fA-F]+)\s*$")
_SKIPPED = re.compile(r"skipping checkpoint step (\d+): (.*)$")
_SAVE_FAILED = re.compile(r"checkpoint of step (\d+) failed")
_EVENT = re.compile(r"elastic\.events: (\{.*\})\s*$")
_FAILURE = re.compile(r"Worker group (?:FAILED|UNHEALTHY)|will restart worker group|Detected \d+ new nodes")


@dataclass(frozen=True)
class Event:
    t: float
    node: str


@dataclass(frozen=True)
class Step(Event):
    step: int
    loss: str | None


@dataclass(frozen=True)
class WorkerStart(Event):
    rank: int
    world: int
    pid: int
    restart: int


@dataclass(frozen=True)
class Resumed(Event):
    step: int


@dataclass(frozen=True)
class Digest(Event):
    digest: str


@dataclass(frozen=True)
class CheckpointSkipped(Event):
    step: int
    reason: str


@dataclass(frozen=True)
class CheckpointFailed(Event):
    step: int


@dataclass(frozen=True)
class AgentEvent(Event):
    name: str
    fields: dict[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class AgentFailure(Event):
    text: str


def parse(t: float, node: str, text: str) -> Event | None:
    """The event one output line stands for, or None."""
    if m := _STEP.match(text):
        return Step(t, node, int(m[1]), m[2])
    if m := _WORKER.search(text):
        return WorkerStart(t, node, int(m[1]), int(m[2]), int(m[3]), int(m[4]))
    if m := _RESUMED.match(text):
        return Resumed(t, node, int(m[1]))
    if m := _DIGEST.match(text):
        return Digest(t, node, m[1].lower())
    if m := _SKIPPED.search(text):
        return CheckpointSkipped(t, node, int(m[1]), m[2])
    if m := _SAVE_FAILED.search(text):
        return CheckpointFailed(t, node, int(m[1]))
    if m := _EVENT.search(text):
        try:
            doc = json.loads(m[1])
        except ValueError:
            return None
        if isinstance(doc, dict) and "event" in doc:
            return AgentEvent(t, node, str(doc["event"]), doc)
        return None
    if _FAILURE.search(text):
        return AgentFailure(t, node, text.strip())
    return None


class Timeline:
    """Events of one job, appended by the node reader threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[Event] = []

    def add(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def events(self) -> list[Event]:
        with self._lock:
            return sorted(self._events, key=lambda e: e.t)

    def latest_step(self, since: float = float("-inf")) -> Step | None:
        with self._lock:
            steps = [e for e in self._events if isinstance(e, Step) and e.t >= since]
        return max(steps, key=lambda e: e.t) if steps else None


# -- analysis ----------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One start of the worker group: from its workers' start to its last step."""

    start_t: float
    world: int | None
    resumed_from: int = 0
    steps: list[Step] = field(default_factory=list)


def attempts(events: list[Event]) -> list[Attempt]:
    """Split the job into attempts. A new attempt begins at a rank-0 `worker` line, or, for scripts
    that print none, when the step count goes back."""
    out: list[Attempt] = []
    for e in events:
        if isinstance(e, WorkerStart) and e.rank == 0:
            out.append(Attempt(e.t, e.world))
        elif isinstance(e, Resumed):
            if not out or out[-1].steps:
                out.append(Attempt(e.t, out[-1].world if out else None))
            out[-1].resumed_from = e.step
        elif isinstance(e, Step):
            if not out:
                out.append(Attempt(e.t, None))
            elif out[-1].steps and e.step <= out[-1].steps[-1].step:
                out.append(Attempt(e.t, out[-1].world, resumed_from=e.step - 1))
            out[-1].steps.append(e)
    return out


@dataclass(frozen=True)
class CommittedStep:
    step: int
    t: float
    loss: str | None
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


def lineage(runs: list[Attempt], ckpt_every: int) -> Lineage:
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
        elif start and start % ckpt_every:
            problems.append(f"attempt {i + 1} resumed from step {start}, which is not a checkpoint step "
                            f"(every {ckpt_every})")
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
    """(time, world size) at every change: from rank-0 worker lines, else the agents' round events."""
    series = [(e.t, e.world) for e in events if isinstance(e, WorkerStart) and e.rank == 0]
    if not series:
        seen: set[int] = set()
        for e in events:
            if isinstance(e, AgentEvent) and e.name == "round_closed" and e.fields.get("generation") not in seen:
                seen.add(e.fields.get("generation"))  # type: ignore[arg-type]
                series.append((e.t, int(e.fields.get("world_size", 0)) * nproc_per_node))
    return series


@dataclass(frozen=True)
class FaultCost:
    detect_s: float | None
    """Fault to the first sign that the system noticed it (an agent's failure line or event)."""
    resume_s: float | None
    """Fault to the first training step of the attempt that recovered from it."""
    steps_lost: int
    """Steps computed before the fault and thrown away by the restarts it caused."""
    restarts: int
    """Restarts of the worker group in the fault's window."""


_DETECTIONS = {"hang_detected", "leave", "restart", "round_closed", "degraded"}


def fault_cost(events: list[Event], runs: list[Attempt], lin: Lineage, start: float, end: float) -> FaultCost:
    """What the fault injected at `start` cost, judged from the events before `end` (the next fault)."""
    detect = next((e.t for e in events if start <= e.t < end and (
        isinstance(e, AgentFailure) or (isinstance(e, AgentEvent) and e.name in _DETECTIONS
                                        and not (e.name == "leave" and e.fields.get("reason") == "shutdown")
                                        and not (e.name == "degraded" and not e.fields.get("degraded"))))), None)
    restarted = [a for a in runs if start <= a.start_t < end]
    resume = next((a.steps[0].t for a in restarted if a.steps), None)
    lost = sum(n for t, n in lin.lost if start <= t < end)
    return FaultCost(
        detect_s=None if detect is None else round(detect - start, 3),
        resume_s=None if resume is None else round(resume - start, 3),
        steps_lost=lost,
        restarts=len(restarted),
    )


# -- consumed samples (train_tiny --log-samples) -------------------------------------------------


@dataclass(frozen=True)
class SampleRecord:
    """One rank's sample ids at one step, as the script logged them."""

    pid: int
    step: int
    rank: int
    ids: tuple[int, ...]


_SAMPLES_FILE = re.compile(r"-p(\d+)\.jsonl$")


def read_samples(directory: Path) -> list[SampleRecord]:
    """Every `{"step", "rank", "ids"}` line of `directory/*-p<pid>.jsonl` (a torn last line is skipped)."""
    out = []
    for path in sorted(directory.glob("*.jsonl")):
        m = _SAMPLES_FILE.search(path.name)
        if m is None:
            continue
        for line in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
                out.append(SampleRecord(int(m[1]), int(doc["step"]), int(doc["rank"]), tuple(int(i) for i in doc["ids"])))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def consumed_by_step(events: list[Event], runs: list[Attempt], lin: Lineage,
                     records: list[SampleRecord]) -> tuple[dict[int, list[int]], list[str]]:
    """For every committed step, the sample ids the attempt that committed it consumed, in rank order.

    A worker belongs to the attempt whose start is nearest to its `worker rank=` line."""
    starts = [a.start_t for a in runs]
    attempt_of: dict[int, int] = {}
    for e in events:
        if isinstance(e, WorkerStart) and starts:
            attempt_of[e.pid] = min(range(len(starts)), key=lambda i: abs(starts[i] - e.t))
    by_key: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
    for r in records:
        if r.pid in attempt_of:
            by_key.setdefault((attempt_of[r.pid], r.step), {})[r.rank] = r.ids
    consumed: dict[int, list[int]] = {}
    problems: list[str] = []
    for step, c in sorted(lin.steps.items()):
        ranks = by_key.get((c.attempt, step))
        if not ranks:
            problems.append(f"no sample record for committed step {step}")
            continue
        if c.world is not None and sorted(ranks) != list(range(c.world)):
            problems.append(f"step {step}: sample records of ranks {sorted(ranks)}, expected 0..{c.world - 1}")
        consumed[step] = [i for rank in sorted(ranks) for i in ranks[rank]]
    return consumed, problems
