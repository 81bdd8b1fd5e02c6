"""The agent's view of the job's training: its workers' series (elastic/worker_metrics.py) served on
the agent's Prometheus endpoint, restarts by cause, re-formations, the time from a failure to the
first step after it, and the one-line summary at the end of the job.

The workers' files are read when Prometheus scrapes (`WorkersCollector`), not on a timer: between
scrapes the agent does nothing for them. While a failure is being recovered from, the agent's
monitor loop (`JobMetrics.poll`) reads them too, to see the first step after it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.events import emit
from elastic.worker_metrics import SPECS, read_all

log = logging.getLogger(__name__)

CAUSE_OF_REASON = {"worker failure": "worker_failure", "peer lost": "peer_lost",
                   "membership change": "membership_change"}
"""The agent's restart reasons (the `restart` event) and their `cause` label."""


class WorkersCollector:
    """A prometheus_client collector: the series of every worker file of `directory`, labelled by
    rank, and `elastic_goodput_ratio` (productive step time over the time since the agent started, at
    `started_at` on `clock`: time.monotonic(), which an NTP step of the wall clock does not move)."""

    def __init__(self, directory: str | Path, started_at: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.started_at, self._clock = started_at, clock

    def describe(self) -> list[Any]:
        return []  # unchecked collector: the series come and go with the workers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        files = read_all(self.directory)
        for name, spec in SPECS.items():
            labels = ["rank", *([spec.label] if spec.label else [])]
            family: Any
            if spec.kind == "histogram":
                family = HistogramMetricFamily(name, spec.help, labels=labels)
                for data in files:
                    counts = data.get("hist", {}).get(name)
                    if counts is None or len(counts) != len(spec.buckets) + 2:
                        continue
                    cumulative, buckets = 0.0, []
                    for bound, count in zip([*map(_le, spec.buckets), "+Inf"], counts[:-1], strict=True):
                        cumulative += count
                        buckets.append((bound, cumulative))
                    family.add_metric([_rank(data)], buckets, counts[-1])
            else:
                cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
                family = cls(name, spec.help, labels=labels)
                for data in files:
                    for label, value in data.get("values", {}).get(name, {}).items():
                        family.add_metric([_rank(data), *([label] if spec.label else [])], value)
            yield family
        goodput = GaugeMetricFamily("elastic_goodput_ratio", "Productive step time of the rank over the time since "
                                    "its agent started", labels=["rank"])
        elapsed = max(self._clock() - self.started_at, 1e-9)
        for data in files:
            productive = data.get("values", {}).get("elastic_train_productive_seconds", {}).get("")
            if productive is not None:
                goodput.add_metric([_rank(data)], min(productive / elapsed, 1.0))
        yield goodput


def _rank(data: dict[str, Any]) -> str:
    return str(data["meta"].get("rank", ""))


def _le(bound: float) -> str:
    return f"{bound:g}" if bound != int(bound) else f"{bound:.1f}"


@dataclass(frozen=True, kw_only=True)
class Summary:
    steps: int | None
    restarts: dict[str, int]
    reformations: int
    recovering_s: float
    """Sum over failures of the time from the failure to the first step after it."""
    recomputed_steps: int
    recomputed_s: float
    elapsed_s: float
    goodput: float | None
    """Mean over this node's ranks of productive step time over `elapsed_s`; None without trainer workers."""

    @property
    def lost_s(self) -> float:
        return self.recovering_s + self.recomputed_s

    def line(self) -> str:
        n = sum(self.restarts.values())
        causes = ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items()) if v)
        steps = "? steps" if self.steps is None else f"{self.steps} steps"
        goodput = "goodput unknown (no trainer workers)" if self.goodput is None else f"goodput {self.goodput:.2f}"
        return (f"job summary: {steps}, {n} restart{'s' if n != 1 else ''}{f' ({causes})' if causes else ''}, "
                f"{self.reformations} re-formation{'s' if self.reformations != 1 else ''}, "
                f"{self.lost_s:.1f} s lost to failures ({self.recovering_s:.1f} s from failure to the next step, "
                f"{self.recomputed_s:.1f} s recomputing {self.recomputed_steps} steps), {goodput} "
                f"over {self.elapsed_s:.1f} s")


class JobMetrics:
    """Restarts, re-formations and recoveries of one agent's job (the agent calls in; see agent.py). Every time
    here is the host's time.monotonic() (`clock`), the workers' "first_step_mono" too: with the wall clock, an NTP
    step back made an 18 s recovery an hour long and the job's elapsed time 0."""

    def __init__(self, directory: str | Path, metrics: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.metrics = metrics
        self._clock = clock
        self.started_at = clock()
        self.restarts: Counter[str] = Counter()
        self.reformations = 0
        self.recovering_s = 0.0
        self._failed_at: float | None = None
        metrics.serve_workers(WorkersCollector(self.directory, self.started_at, clock))

    def failed(self, seen_at: float | None = None) -> None:
        """A failure was seen (at `seen_at`, time.monotonic(); None: now). The first one counts until a
        step is done after it."""
        if self._failed_at is None:
            self._failed_at = seen_at if seen_at is not None else self._clock()

    def restarted(self, reason: str, *, reformed: bool) -> None:
        """The worker group restarted for `reason` (the `restart` event's); `reformed`: with other members
        than before (a peer lost, a node joined), not the same ones after a worker failed."""
        cause = CAUSE_OF_REASON.get(reason, "other")
        self.restarts[cause] += 1
        self.metrics.restarted(cause)
        if reformed:
            self.reformed()

    def reformed(self) -> None:
        """The group re-formed with other members."""
        self.reformations += 1
        self.metrics.reformed()

    def poll(self) -> None:
        """After a failure: has a worker completed a step since? (Cheap: reads only while recovering.)"""
        if self._failed_at is None:
            return
        firsts = [d["meta"]["first_step_mono"] for d in read_all(self.directory)
                  if isinstance(d["meta"].get("first_step_mono"), (int, float))]
        after = [t for t in firsts if t >= self._failed_at]
        if not after:
            return
        seconds = round(min(after) - self._failed_at, 3)
        self._failed_at = None
        self.recovering_s += seconds
        self.metrics.failure_to_step(seconds)
        emit("first_step_after_failure", failure_to_step_s=seconds)

    def summary(self) -> Summary:
        self.poll()
        files = read_all(self.directory)

        def values(name: str) -> list[float]:
            return [d.get("values", {}).get(name, {}).get("", 0.0) for d in files]

        steps = [int(v) for v in values("elastic_train_step")]
        productive = values("elastic_train_productive_seconds")
        elapsed = max(self._clock() - self.started_at, 1e-9)
        return Summary(
            steps=max(steps) if steps else None, restarts=dict(self.restarts), reformations=self.reformations,
            recovering_s=self.recovering_s, recomputed_steps=int(max(values("elastic_train_steps_recomputed_total"),
                                                                     default=0)),
            recomputed_s=max(values("elastic_train_lost_seconds_total"), default=0.0), elapsed_s=elapsed,
            goodput=min(sum(productive) / len(productive) / elapsed, 1.0) if productive else None)

    def finish(self) -> Summary:
        """At the end of the job: log the one-line summary and emit it as the `job_summary` event."""
        s = self.summary()
        log.info("%s", s.line())
        emit("job_summary", steps=s.steps, restarts=s.restarts, reformations=s.reformations,
             lost_s=round(s.lost_s, 3), recovering_s=round(s.recovering_s, 3), recomputed_steps=s.recomputed_steps,
             recomputed_s=round(s.recomputed_s, 3), elapsed_s=round(s.elapsed_s, 3),
             goodput=None if s.goodput is None else round(s.goodput, 4))
        return s
