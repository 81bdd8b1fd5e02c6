"""The sample ids each rank consumed at each step, for the exactly-once check.

The harness sets `ELASTIC_SAMPLE_LOG_DIR=<dir>` for every node; the trainer's sampler hook then
appends one JSON line per step, `{"step", "epoch", "rank", "ids"}`, to
`<dir>/samples-w{world}-r{rank}-c{restart}-p{pid}.jsonl`, and one per micro-batch as it is handed
out, `{"step", "micro", "rank", "ids"}`, to `<dir>/drawn-w{world}-r{rank}-c{restart}-p{pid}.jsonl`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from chaos.lineage import Attempt, Lineage
from chaos.timeline import Event, WorkerStart
from trainer.samples import SAMPLE_LOG_ENV

__all__ = ["SAMPLE_LOG_ENV", "SampleRecord", "consumed_by_step", "read_samples"]

log = logging.getLogger("chaos")


@dataclass(frozen=True)
class SampleRecord:
    """One rank's sample ids at one step, as the worker logged them."""

    pid: int
    step: int
    rank: int
    ids: tuple[int, ...]
    world: int | None = None
    """The world size the worker was in (from the file name): a process re-formed in place writes a file
    per world it ran in."""
    micro: int | None = None
    """A drawn micro-batch (drawn-* files): its index in the step; None for a completed step's record."""


_SAMPLES_FILE = re.compile(r"^(samples|drawn)-.*-p(\d+)\.jsonl$")
_WORLD = re.compile(r"-w(\d+)-")


def read_samples(directory: Path) -> list[SampleRecord]:
    """Every `{"step", "rank", "ids"}` line of `directory/samples-*-p<pid>.jsonl` and every `{"step", "micro",
    "rank", "ids"}` line of `directory/drawn-*-p<pid>.jsonl` (a torn last line is skipped)."""
    out = []
    for path in sorted(directory.glob("*.jsonl")):
        m = _SAMPLES_FILE.search(path.name)
        if m is None:
            continue
        w = _WORLD.search(path.name)
        for line in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
                out.append(SampleRecord(int(m[2]), int(doc["step"]), int(doc["rank"]),
                                        tuple(int(i) for i in doc["ids"]), int(w[1]) if w else None,
                                        int(doc["micro"]) if m[1] == "drawn" else None))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def consumed_by_step(events: list[Event], runs: list[Attempt], lin: Lineage,
                     records: list[SampleRecord]) -> tuple[dict[int, list[int]], list[str]]:
    """For every committed step, the sample ids the attempt that committed it consumed, in rank order.

    A worker belongs to the attempt whose start is nearest to its `worker_started` event, and a worker that
    re-formed in place also to the attempt of each `reformed` event (there, its records of the attempt's
    world size)."""
    starts = [a.start_t for a in runs]
    attempts_of: dict[int, set[int]] = {}
    for e in events:
        if isinstance(e, WorkerStart) and starts:
            attempts_of.setdefault(e.pid, set()).add(min(range(len(starts)), key=lambda i: abs(starts[i] - e.t)))
    by_key: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
    drawn: dict[tuple[int, int, int], dict[int, tuple[int, ...]]] = {}  # (attempt, step, rank) -> micro -> ids
    completed = {(r.pid, r.step) for r in records if r.micro is None}
    for r in records:
        for a in attempts_of.get(r.pid, ()):
            if r.world is None or runs[a].world in (None, r.world):
                if r.micro is None:
                    by_key.setdefault((a, r.step), {})[r.rank] = r.ids
                elif (r.pid, r.step) not in completed:
                    drawn.setdefault((a, r.step, r.rank), {})[r.micro] = r.ids
    consumed: dict[int, list[int]] = {}
    problems: list[str] = []
    for step, c in sorted(lin.steps.items()):
        ranks = by_key.get((c.attempt, step))
        if not ranks:
            problems.append(f"no sample record for committed step {step}")
            continue
        if c.world is not None:
            # A rank killed after its gradients entered the step's all-reduce, before it completed the step, has
            # no record of it though its peers completed it with its samples: what it drew for the step is its
            # record (every micro-batch of it; it drew them before any collective of the step used them).
            for rank in set(range(c.world)) - set(ranks):
                micro = drawn.get((c.attempt, step, rank), {})
                if micro and sorted(micro) == list(range(len(micro))):
                    ranks[rank] = tuple(i for m in sorted(micro) for i in micro[m])
                    log.info("elastic-chaos: step %d: rank %d did not complete it (killed during it); its samples "
                             "are those it drew for it", step, rank)
        if c.world is not None and sorted(ranks) != list(range(c.world)):
            problems.append(f"step {step}: sample records of ranks {sorted(ranks)}, expected 0..{c.world - 1}")
        consumed[step] = [i for rank in sorted(ranks) for i in ranks[rank]]
    return consumed, problems
