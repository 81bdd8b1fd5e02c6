"""Worker-side metrics, served by the node's agent: counters, gauges and histogram bucket counts kept
in the worker's memory and written, at most once a second and at exit, to
`<ELASTIC_PROGRESS_DIR>/metrics_<local rank>.json` (atomic replace, in the tmpfs beside the progress
beats). The agent reads those files when Prometheus scrapes it (elastic/job_metrics.py) and serves
the series labelled by rank, so a worker runs no HTTP server of its own and pays no syscall per step:
an update is a dict write and, for a histogram, a bisect. Outside elastic-run everything is a no-op.

A restarted worker continues its predecessor's file (same local rank, same agent): its `_total`
series never go back across restarts, and `state` (the trainer's goodput ledger) carries over.

`SPECS` is the one table of the series (name, type, help, label); the agent exports exactly these.
The cadence (FLUSH_INTERVAL_S, and a flush at exit) is the caller's: trainer/telemetry.py.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from elastic import progress

FLUSH_INTERVAL_S = 1.0
"""The most often a worker rewrites its file (a scrape is rarely more frequent than every 5 s)."""
FILE_PREFIX = "metrics_"

Kind = Literal["counter", "gauge", "histogram"]
# Seconds from 1 ms (a tiny CPU step) to 2 minutes (a large model's step or an upload).
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


@dataclass(frozen=True, kw_only=True)
class Spec:
    kind: Kind
    help: str
    label: str | None = None
    """The one label besides `rank` (e.g. `tier`), or None."""
    buckets: tuple[float, ...] = TIME_BUCKETS
    """Upper bounds of a histogram's buckets (+Inf is implied)."""


SPECS: dict[str, Spec] = {
    "elastic_train_step": Spec(kind="gauge", help="Last completed optimizer step"),
    "elastic_train_steps_total": Spec(kind="counter", help="Steps completed by this rank, recomputed ones included"),
    "elastic_train_step_seconds": Spec(kind="histogram", help="Time between two completed steps (data wait, "
                                       "forward, backward, optimizer and the save in between)"),
    "elastic_train_data_wait_seconds": Spec(kind="histogram", help="Time a step was blocked on the data loader"),
    "elastic_train_samples_total": Spec(kind="counter", help="Samples this rank trained on"),
    "elastic_train_samples_per_second": Spec(kind="gauge", help="Samples per second of this rank (last second)"),
    "elastic_train_tokens_total": Spec(kind="counter", help="Tokens this rank trained on (needs tokens_per_sample)"),
    "elastic_train_tokens_per_second": Spec(kind="gauge", help="Tokens per second of this rank (last second)"),
    "elastic_train_steps_recomputed_total": Spec(kind="counter", help="Steps run again after a restore "
                                                 "threw them away"),
    "elastic_train_lost_seconds_total": Spec(kind="counter", help="Step time thrown away by restores"),
    "elastic_train_productive_seconds": Spec(kind="gauge", help="Step time of the steps kept (not recomputed), "
                                             "less the waits for checkpoint copies"),
    "elastic_ckpt_stall_seconds": Spec(kind="histogram", help="Time a save blocked the training loop"),
    "elastic_ckpt_persist_seconds": Spec(kind="histogram", help="Consistent copy to the published tier-1 directory"),
    "elastic_ckpt_upload_seconds": Spec(kind="histogram", help="Published tier-1 directory to the tier-2 marker"),
    "elastic_ckpt_upload_lag_steps": Spec(kind="gauge", help="Newest saved step minus the newest uploaded one"),
    "elastic_ckpt_saves_total": Spec(kind="counter", help="Saves by outcome", label="outcome"),
    "elastic_ckpt_restores_total": Spec(kind="counter", help="Restores by the tier read", label="tier"),
}
SAVE_OUTCOMES = ("ok", "skipped", "failed", "abandoned", "superseded")
RESTORE_TIERS = ("memory", "local", "shared")


def file_path(directory: str | Path, local_rank: int) -> Path:
    return Path(directory) / f"{FILE_PREFIX}{local_rank}.json"


class WorkerMetrics:
    """One worker's series. `path` None: a no-op recorder (not under elastic-run)."""

    def __init__(self, path: Path | None, *, rank: int, local_rank: int, restart: int,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.enabled = path is not None
        self.wall = wall
        self.meta: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "restart": restart, "pid": os.getpid(),
                                     "started_at": wall(), "first_step_at": None,
                                     "first_step_mono": None}
        self.values: dict[str, dict[str, float]] = {}
        self.hist: dict[str, list[float]] = {}
        """name -> per-bucket counts (the last one +Inf), then the sum."""
        self.state: dict[str, Any] = {}
        """Carried across restarts as it is (the trainer's own bookkeeping)."""
        self.carried: dict[str, Any] | None = None
        """The predecessor's file (its `meta` and `state`), or None."""
        for name, spec in SPECS.items():
            if spec.kind == "histogram":
                self.hist[name] = [0.0] * (len(spec.buckets) + 2)
        if path is not None:
            self._carry(path)

    @classmethod
    def from_env(cls, *, rank: int, local_rank: int, restart: int) -> WorkerMetrics:
        """The recorder of this worker: files in the agent's progress dir, or a no-op outside elastic-run."""
        directory = os.environ.get(progress.ENV_DIR)
        return cls(file_path(directory, local_rank) if directory else None, rank=rank, local_rank=local_rank,
                   restart=restart)

    def _carry(self, path: Path) -> None:
        old = read(path)
        if old is None:
            return
        self.carried = {"meta": old.get("meta", {}), "state": old.get("state", {})}
        self.state = dict(self.carried["state"])
        for name, by_label in old.get("values", {}).items():
            spec = SPECS.get(name)
            if spec is not None and spec.kind == "counter":  # gauges describe the dead process: not carried
                self.values[name] = {k: float(v) for k, v in by_label.items()}
        for name, counts in old.get("hist", {}).items():
            if name in self.hist and len(counts) == len(self.hist[name]):
                self.hist[name] = [float(c) for c in counts]

    # -- updates (cheap: called on the training thread) ---------------------------------------

    def inc(self, name: str, amount: float = 1.0, label: str = "") -> None:
        by_label = self.values.setdefault(name, {})
        by_label[label] = by_label.get(label, 0.0) + amount

    def set(self, name: str, value: float, label: str = "") -> None:
        self.values.setdefault(name, {})[label] = value

    def get(self, name: str, label: str = "") -> float:
        return self.values.get(name, {}).get(label, 0.0)

    def observe(self, name: str, value: float) -> None:
        counts = self.hist[name]
        counts[bisect.bisect_left(SPECS[name].buckets, value)] += 1  # le: a value on a bound is in its bucket
        counts[-1] += value

    # -- the file -------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the file now (atomic replace); never raises: metrics must not break training."""
        if self.path is None:
            return
        body = {"meta": {**self.meta, "written_at": self.wall()}, "values": self.values, "hist": self.hist,
                "state": self.state}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(body, separators=(",", ":")))
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError):
            pass


def read(path: Path) -> dict[str, Any] | None:
    """One worker's file, or None when it is missing or unreadable (being replaced, or a worker of an
    older version): a scrape skips it rather than fail."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("meta"), dict) else None


def read_all(directory: str | Path) -> list[dict[str, Any]]:
    """Every worker file of an agent's progress dir, by local rank."""
    found = []
    for path in sorted(Path(directory).glob(f"{FILE_PREFIX}*.json")):
        data = read(path)
        if data is not None:
            found.append(data)
    return sorted(found, key=lambda d: int(d["meta"].get("local_rank", 0)))
