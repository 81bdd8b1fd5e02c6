"""What `Resumable` reports to elastic-run's agent: steps, step and data-wait time, throughput,
checkpoints, restores and goodput (series in elastic/worker_metrics.py, served by the agent).

Per step it reads the clock once (`step`) and twice per batch fetched (`timed`); everything else
(the checkpointer's per-save metrics, the samples per second, the file) runs at the flush cadence,
once a second. Outside elastic-run the recorder is off and every call returns at once.

Goodput ledger (`state`, carried across restarts by the worker file): `productive` is the step time
of the steps kept so far; `marks` holds it at the recent checkpoint steps. A restore to step R
finds R's mark and throws away what came after it: those steps count as recomputed, their time as
lost. Data wait counts as productive (the loader is part of training), a wait for a checkpoint's
copy does not, nor does the time from a failure to the first step after it (no step runs then).
"""

from __future__ import annotations

import atexit
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ckpt import Checkpointer, Restored
from ckpt.metrics import SaveMetrics
from elastic.worker_metrics import FLUSH_INTERVAL_S, RESTORE_TIERS, SAVE_OUTCOMES, SPECS, WorkerMetrics

_MAX_MARKS = 64
_FINAL = {"snapshot": "ok", "persisted": "ok", "uploaded": "ok", "committed": "ok", "skipped": "skipped",
          "failed": "failed", "abandoned": "abandoned", "superseded": "superseded"}


class Telemetry:
    def __init__(self, recorder: WorkerMetrics, *, checkpointer: Checkpointer | None = None,
                 samples_per_step: int | None = None, tokens_per_sample: int | None = None,
                 cadences: tuple[int] | tuple[int, int] | tuple[()] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recorder = recorder
        self.on = recorder.enabled
        self._ckpt = checkpointer
        self._samples = samples_per_step or 0
        self._tokens = (tokens_per_sample or 0) * self._samples
        cadences = cadences or (1,)
        self._c1, self._c2 = cadences[0], cadences[-1]  # the checkpoint cadences: snapshot and persist
        self._clock = clock
        self._last = clock()
        self._next_flush = self._last
        self._wait = 0.0
        self._steps = 0  # since the last flush: the counters are folded in there, not per step
        self._first_pending = True
        # The hot path's histograms, resolved once.
        self._h_step = recorder.hist["elastic_train_step_seconds"]
        self._h_wait = recorder.hist["elastic_train_data_wait_seconds"]
        self._buckets = SPECS["elastic_train_step_seconds"].buckets
        assert self._buckets == SPECS["elastic_train_data_wait_seconds"].buckets
        self._rate_at, self._rate_samples = self._last, recorder.get("elastic_train_samples_total")  # carried
        self._seen: dict[int, set[str]] = {}
        st = recorder.state
        self.productive: float = float(st.get("productive", 0.0))
        self.marks: list[list[float]] = [list(m) for m in st.get("marks", [])]
        self.last_step: int | None = st.get("step")
        if self.on:
            atexit.register(self.flush)  # the last second's steps, when the process ends without close()
            for outcome in SAVE_OUTCOMES:  # zeros, so that rate() and alerts see the series from the start
                recorder.inc("elastic_ckpt_saves_total", 0.0, outcome)
            for tier in RESTORE_TIERS:
                recorder.inc("elastic_ckpt_restores_total", 0.0, tier)
            for name in ("elastic_train_steps_total", "elastic_train_steps_recomputed_total",
                         "elastic_train_lost_seconds_total"):
                recorder.inc(name, 0.0)

    @classmethod
    def for_run(cls, run: Any) -> Telemetry:
        """The telemetry of a `Resumable` (its topology, checkpointer, sampler and config)."""
        t, config, sampler = run.topology, run.config, run.sampler
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        recorder = WorkerMetrics.from_env(rank=t.rank, local_rank=t.local_rank, restart=restart)
        snapshots = config.snapshot_every if run.checkpointer.has_tier0 else config.persist_interval
        return cls(recorder, checkpointer=run.checkpointer, tokens_per_sample=config.tokens_per_sample,
                   samples_per_step=sampler.local_batch if sampler is not None else None,
                   cadences=(config.persist_interval, snapshots))

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches`, with the time blocked in each next() counted as this step's data wait (a list or
        tuple is not a loader: it is not timed, e.g. train_loop's micro-batches, already timed)."""
        if not self.on or isinstance(batches, (list, tuple)):
            return iter(batches)
        return batches if isinstance(batches, _Timed) else _Timed(iter(batches), self)

    def resumed(self, step: int, restored: Restored | None) -> None:
        """The restore is done (`restored` None: a fresh start): steps after `step` that ran before are lost."""
        if not self.on:
            return
        r = self.recorder
        if restored is not None and restored.step == step:
            r.inc("elastic_ckpt_restores_total", 1.0, restored.tier)
        if self.last_step is not None and self.last_step > step:
            base = _productive_at(self.marks, step, self.productive, self.last_step)
            r.inc("elastic_train_steps_recomputed_total", self.last_step - step)
            r.inc("elastic_train_lost_seconds_total", max(self.productive - base, 0.0))
            self.productive = base
        self.marks = [m for m in self.marks if m[0] < step] + [[step, self.productive]]
        self.last_step = step
        r.set("elastic_train_step", step)
        r.meta["first_step_at"] = r.meta["first_step_mono"] = None  # the next step is the first after this restore
        self._first_pending = True
        self._last = self._clock()  # the first step's time starts now, not at the process start
        self._wait = 0.0
        self.flush()

    def step(self, step: int) -> bool:
        """Step `step` completed (called first thing in Resumable.step_done). True: the file is due to be
        written (`flush`; Resumable does it off the step boundary, trainer/deferred.py); after the first step of a
        (re)start it is written here."""
        if not self.on:
            return False
        # The hot path, kept to a clock read and a few attribute updates (bench/metrics_overhead.py).
        now = self._clock()
        seconds, self._last = now - self._last, now
        wait, self._wait = self._wait, 0.0
        buckets, counts = self._buckets, self._h_step
        counts[bisect_left(buckets, seconds)] += 1  # le: a value on a bound is in that bound's bucket
        counts[-1] += seconds
        counts = self._h_wait
        counts[bisect_left(buckets, wait)] += 1
        counts[-1] += wait
        self._steps += 1
        self.productive += seconds
        self.last_step = step
        if step % self._c1 == 0 or step % self._c2 == 0:
            self.marks.append([step, self.productive])
            if len(self.marks) > _MAX_MARKS:
                del self.marks[0]
        if self._first_pending:  # written at once: the agent's failure-to-first-step time
            self._first_pending = False
            # For the agent, on the host's monotonic clock (elastic/job_metrics.py); the wall time for people.
            self.recorder.meta["first_step_at"], self.recorder.meta["first_step_mono"] = self.recorder.wall(), now
            self.flush()
            return False
        return now >= self._next_flush

    def close(self) -> None:
        """Write the file a last time and not at exit: a run re-entered in place (trainer/in_place.py) has a new
        Telemetry on the same file, which this one's exit flush would overwrite with older counts."""
        self.flush()
        if self.on:
            atexit.unregister(self.flush)

    def flush(self) -> None:
        """Take in the checkpointer's finished saves and the throughput, then write the file."""
        if not self.on:
            return
        r = self.recorder
        if self._ckpt is not None:
            for m in self._ckpt.metrics:
                self._count_save(m)
        now = self._clock()
        self._next_flush = now + FLUSH_INTERVAL_S
        steps, self._steps = self._steps, 0
        r.inc("elastic_train_steps_total", steps)
        if self._samples:
            r.inc("elastic_train_samples_total", steps * self._samples)
            if self._tokens:
                r.inc("elastic_train_tokens_total", steps * self._tokens)
        samples = r.get("elastic_train_samples_total")
        # Over at least half a flush interval: a flush soon after another (the first step's, close's, the
        # one at exit) keeps the last rate rather than report a spike or a zero.
        if self._samples and now - self._rate_at >= FLUSH_INTERVAL_S / 2:
            rate = (samples - self._rate_samples) / (now - self._rate_at)
            r.set("elastic_train_samples_per_second", rate)
            if self._tokens:
                r.set("elastic_train_tokens_per_second", rate * self._tokens / self._samples)
            self._rate_at, self._rate_samples = now, samples
        if self.last_step is not None:
            r.set("elastic_train_step", self.last_step)
        r.set("elastic_train_productive_seconds", self.productive)
        self._save_state()
        r.flush()

    def _count_save(self, m: SaveMetrics) -> None:
        seen = self._seen.setdefault(m.step, set())
        r = self.recorder
        if "stall" not in seen and (m.tier0_s is not None or m.tier1_s is not None or m.done):
            seen.add("stall")
            r.observe("elastic_ckpt_stall_seconds", m.stall_s + m.wait_staged_s)
            self.productive -= m.wait_staged_s  # inside a step, waiting for the checkpoint's copy
        if "persist" not in seen and m.tier1_s is not None:
            seen.add("persist")
            r.observe("elastic_ckpt_persist_seconds", m.tier1_s)
        if "upload" not in seen and m.tier2_s is not None:
            seen.add("upload")
            r.observe("elastic_ckpt_upload_seconds", m.tier2_s)
        if "lag" not in seen and m.upload_lag_steps is not None:
            seen.add("lag")
            r.set("elastic_ckpt_upload_lag_steps", m.upload_lag_steps)
        outcome = _FINAL.get(m.status)
        if "outcome" not in seen and outcome is not None:
            seen.add("outcome")
            r.inc("elastic_ckpt_saves_total", 1.0, outcome)
        if len(self._seen) > 512:  # the checkpointer keeps the last 256 saves
            for old in sorted(self._seen)[:256]:
                del self._seen[old]

    def _save_state(self) -> None:
        self.recorder.state.update(productive=self.productive, marks=self.marks, step=self.last_step)


class _Timed:
    __slots__ = ("_it", "_t")

    def __init__(self, it: Iterator[Any], telemetry: Telemetry) -> None:
        self._it, self._t = it, telemetry

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        t = self._t
        start = t._clock()
        try:
            return next(self._it)
        finally:
            t._wait += t._clock() - start

    def __getattr__(self, name: str) -> Any:  # e.g. a DataLoader iterator's _shutdown_workers
        return getattr(self._it, name)


def _productive_at(marks: list[list[float]], step: int, productive: float, last_step: int) -> float:
    """The productive time at `step`: its mark, else interpolated between the nearest marks (the
    newest mark and `last_step` bound the range from above)."""
    below = [(0.0, 0.0)]
    above = (float(last_step), productive)
    for s, p in marks:
        if s == step:
            return p
        if s < step:
            below.append((s, p))
        elif s < above[0]:
            above = (s, p)
    s0, p0 = max(below)
    s1, p1 = above
    return p0 if s1 <= s0 else p0 + (p1 - p0) * (step - s0) / (s1 - s0)
