"""What happened, in order: every simulated node's structured events, read from its event files.

The harness reads events, never log text. It gives every node's agent `ELASTIC_EVENTS_DIR=<dir>`
and `ELASTIC_NODE_ID=<node>` (the workers inherit both), so every process of the node appends its
`core.events.emit` records to `<dir>/events-<pid>.jsonl`. The contract of the records is the
docstring of `core/events.py`; the harness uses these:

    worker_started   every rank, once at start (rank, world, restart, pid)
    resumed          rank 0: the step restored (0: a fresh start)
    reformed         every rank that re-formed in place (step, world, pid): like a `worker_started`
                     and, from the new rank 0, a `resumed`: a new attempt of the same processes
    step             rank 0: after every optimizer step (step, loss)
    final_digest     rank 0: at the end (digest)
    ckpt_skipped     any rank: a copy of a step was unusable at restore, another was tried
    ckpt_failed      any rank: a save failed
    agent events     join, leave, round_closed, restart, recovered, degraded, hang_detected, ...

A node's events are the files of its directory, whichever process wrote them: the node is the
directory, not a field. A script that emits none of these still runs; the checks that need them say
so in the report instead of passing.

Times are `time.monotonic()` seconds, like the harness's own clock: a record's wall-clock `ts` is
moved onto it by the offset between the two clocks taken when the timeline is made.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.events import read_events


@dataclass(frozen=True)
class Event:
    t: float
    node: str


@dataclass(frozen=True)
class Step(Event):
    step: int
    loss: float | None


@dataclass(frozen=True)
class PeerStep(Event):
    """A step reported by a rank other than 0. Rank 0 speaks for the group, except for a step rank 0 was killed in
    after its part of the step's collectives: its peers completed that step with it (chaos/lineage.py)."""

    step: int
    loss: float | None
    rank: int


@dataclass(frozen=True)
class WorkerStart(Event):
    rank: int
    world: int
    pid: int
    restart: int


@dataclass(frozen=True)
class Resumed(Event):
    step: int
    in_place: bool = False
    """Re-formed in place (`reformed`): from the step in memory, which need not be a checkpoint step."""


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
    error: str


@dataclass(frozen=True)
class AgentEvent(Event):
    name: str
    fields: dict[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class FailureSeen(Event):
    """The moment an agent saw its worker group fail, or learnt of a membership change.

    The agent reports it in its `recovered` event, as the seconds from then to the new workers
    running (`recovery_s`); this event is placed that long before the `recovered` one."""


_RANK0_ONLY = {"step", "resumed", "final_digest"}
"""Worker events the harness takes from rank 0 alone: every rank may emit them, rank 0 speaks for the group."""

_AGENT = {"join", "leave", "round_closed", "restart", "recovered", "degraded", "hang_detected", "bad_record",
          "job_summary", "reform", "reform_done", "reform_fallback", "ckpt_helper_restarted"}


def from_record(record: Mapping[str, Any], node: str, offset: float = 0.0) -> list[Event]:
    """The timeline events one event record stands for (none, one, or two for `recovered`).

    `offset` is wall clock minus monotonic clock: the record's `ts` minus it is the event's `t`."""
    try:
        name = str(record["event"])
        t = float(record["ts"]) - offset
        if name == "step" and record.get("rank", 0) != 0:
            loss = record.get("loss")
            return [PeerStep(t, node, int(record["step"]), None if loss is None else float(loss), int(record["rank"]))]
        if name in _RANK0_ONLY and record.get("rank", 0) != 0:
            return []
        if name == "step":
            loss = record.get("loss")
            return [Step(t, node, int(record["step"]), None if loss is None else float(loss))]
        if name == "worker_started":
            return [WorkerStart(t, node, int(record["rank"]), int(record["world"]), int(record["pid"]),
                                int(record.get("restart", 0)))]
        if name == "resumed":
            return [Resumed(t, node, int(record["step"]))]
        if name == "reformed":  # the same processes in a new group: an attempt of its own (lineage.py)
            rank = int(record["rank"])
            start: list[Event] = [WorkerStart(t, node, rank, int(record["world"]), int(record["pid"]),
                                              int(record.get("restart", 0)))]
            return start + [Resumed(t, node, int(record["step"]), in_place=True)] if rank == 0 else start
        if name == "final_digest":
            return [Digest(t, node, str(record["digest"]).lower())]
        if name == "ckpt_skipped":
            return [CheckpointSkipped(t, node, int(record["step"]), str(record.get("reason", "")))]
        if name == "ckpt_failed":
            return [CheckpointFailed(t, node, int(record["step"]), str(record.get("error", "")))]
        if name in _AGENT:
            out: list[Event] = [AgentEvent(t, node, name, dict(record))]
            if name in ("recovered", "reform_done") and record.get("recovery_s") is not None:
                out.append(FailureSeen(t - float(record["recovery_s"]), node))
            return out
    except (KeyError, TypeError, ValueError):
        pass  # a record without the contract's fields stands for nothing (written by another version?)
    return []


class _Tail:
    """The complete lines appended to the event files of one directory since the last read."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[str, int] = {}

    def new_records(self) -> list[dict[str, Any]]:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.startswith("events-") and n.endswith(".jsonl"))
        except OSError:
            return []  # no process of the node has emitted yet
        out = []
        for name in names:
            path = self.directory / name
            start = self._offsets.get(name, 0)
            try:
                if path.stat().st_size <= start:
                    continue
                with open(path, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written is read next time
            self._offsets[name] = start + len(complete)
            for raw in complete.splitlines():
                try:
                    doc = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    out.append(doc)
        return out


class Timeline:
    """The events of one job, from the event directories of its nodes.

    While the job runs, every query first reads what the nodes appended since the last one (the
    harness polls it to time its faults). `load()` then reads every directory whole, through
    `core.events.read_events`, for the judgement."""

    def __init__(self, *, offset: float | None = None) -> None:
        self.offset = time.time() - time.monotonic() if offset is None else offset
        self._lock = threading.Lock()
        self._tails: dict[str, _Tail] = {}
        self._events: list[Event] = []

    def watch(self, node: str, directory: Path) -> None:
        """Read `node`'s events from `directory` from now on."""
        with self._lock:
            self._tails[node] = _Tail(directory)

    def _refresh(self) -> None:
        # Called with the lock held: one reader at a time, so no line is read twice.
        for node, tail in self._tails.items():
            for record in tail.new_records():
                self._events.extend(from_record(record, node, self.offset))

    def load(self) -> list[Event]:
        """Every event of every watched node, read whole from its files, in time order."""
        with self._lock:
            self._events = [e for node, tail in self._tails.items() for r in read_events(str(tail.directory))
                            for e in from_record(r, node, self.offset)]
            return sorted(self._events, key=lambda e: e.t)

    def events(self) -> list[Event]:
        with self._lock:
            self._refresh()
            return sorted(self._events, key=lambda e: e.t)

    def latest_step(self, since: float = float("-inf")) -> Step | None:
        with self._lock:
            self._refresh()
            steps = [e for e in self._events if isinstance(e, Step) and e.t >= since]
        return max(steps, key=lambda e: e.t) if steps else None
