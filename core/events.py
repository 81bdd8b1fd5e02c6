"""Structured events: the only protocol between components. Log lines are for people.

Every event is one JSON object. It goes to three places:
- the `elastic.events` logger (one line of JSON; for people and log pipelines);
- when `ELASTIC_EVENTS_DIR` is set, one line appended to `<dir>/events-<pid>.jsonl` (the chaos
  harness and tests set it per simulated node and read only these files, never stdout);
- torch's event handler, see below.

Every record carries `event`, `ts` (wall clock, seconds), `mono` (CLOCK_MONOTONIC) with `boot` (the
kernel's boot id; `read_events` orders one machine's records by `mono`), `pid`, and from the torchrun worker
environment where it is set: `rank`, `local_rank`, `world`, `restart` (TORCHELASTIC_RESTART_COUNT)
and `node` (ELASTIC_NODE_ID). Field names below are the contract; add fields, never rename them.

Agent events (elastic/): `join`, `leave`, `round_closed`, `restart`, `recovered`, `degraded`,
`hang_detected`, `bad_record`; each carries the run id, the node id and timings in seconds.

Worker events (trainer/, ckpt/):
- `worker_started`  rank, world, local_rank, restart
- `restored`        step, tier ("local" | "shared"), source_rank (whose files), path
- `resumed`         step (the first step this incarnation will run is step + 1; 0 = fresh start)
- `step`            step (completed, 1-based), loss (float, optional)
- `ckpt_saved`      step, tier ("local" | "shared"), seconds
- `ckpt_skipped`    step, reason; from a restore that rejected a copy also tier, source_rank
- `ckpt_failed`     step, tier, error
- `fault`           point, step, action (the library fault injector, just before it acts)
- `final_digest`    step, digest
- `state_digest`    step, point ("save" | "restore"), digest: the global digest of the state at each
                    save and right after each restore; only with ELASTIC_STATE_DIGESTS=1 (it gathers
                    every sharded tensor)

The same events also go to torch's event handler (`torch.distributed.elastic.events.record`) as
`elastic.<event>` from source AGENT, to the destination `--event-log-handler` names, next to
torch's own worker events. The agent sets that destination (`route_to_torch`); until then (stock
torchrun loading only the rendezvous handler) it is torch's `null` handler.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("elastic.events")

_torch_destination = "null"


def route_to_torch(destination: str) -> None:
    """Also record every event to torch's event handler `destination` (`--event-log-handler`)."""
    from torch.distributed.elastic.events.handlers import get_logging_handler

    try:
        get_logging_handler(destination)
    except KeyError as exc:
        raise ValueError(f"--event-log-handler {destination!r} is not a registered torch event handler "
                         "(torch ships 'console' and 'null')") from exc
    global _torch_destination
    _torch_destination = destination


EVENTS_DIR_ENV = "ELASTIC_EVENTS_DIR"
NODE_ID_ENV = "ELASTIC_NODE_ID"
"""The node of every record: elastic-run sets it for its workers (the node's id in the run), elastic-chaos per node."""

# Worker identity from the torchrun environment, added to every record where it is set.
_IDENTITY_ENV = {"rank": "RANK", "local_rank": "LOCAL_RANK", "world": "WORLD_SIZE", "group_rank": "GROUP_RANK",
                 "restart": "TORCHELASTIC_RESTART_COUNT", "node": NODE_ID_ENV}

_file_lock = threading.Lock()


def emit(event: str, **fields: Any) -> dict[str, Any]:
    """Record `event` with `fields` (JSON-serialisable; anything else is written as its str). A `ts` among the
    fields (an event stamped with an earlier moment) moves `mono` back with it."""
    wall, mono = time.time(), time.monotonic()
    record: dict[str, Any] = {"event": event, "ts": round(wall, 3), "pid": os.getpid()}
    for key, env in _IDENTITY_ENV.items():
        value = os.environ.get(env)
        if value is not None:
            record[key] = int(value) if value.lstrip("-").isdigit() else value
    if _BOOT is not None:
        given = fields.get("ts")
        earlier = wall - given if isinstance(given, (int, float)) and not isinstance(given, bool) else 0.0
        record.update(mono=round(mono - earlier, 6), boot=_BOOT)
    record.update(fields)
    line = json.dumps(record, sort_keys=True, default=str)
    log.info("%s", line)
    _append_to_file(line)
    if _torch_destination != "null":
        _record_in_torch(record)
    return record


def events_path(directory: str, pid: int | None = None) -> str:
    """The file a process with `pid` appends its events to under `directory`."""
    return os.path.join(directory, f"events-{os.getpid() if pid is None else pid}.jsonl")


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


_BOOT = _boot_id()
"""This machine's boot: records of one boot carry `mono` (CLOCK_MONOTONIC, the same clock in all its processes)."""


def read_events(directory: str) -> list[dict[str, Any]]:
    """Every event under `directory`, all processes, ordered by time: by `mono` where every record has it from
    the same boot (processes of one machine: a wall-clock step, NTP's or an operator's, does not reorder them),
    else by `ts`. A torn last line (a process killed mid-write) is skipped."""
    records: list[dict[str, Any]] = []
    if not os.path.isdir(directory):
        return records
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("events-") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
            for raw in f:
                try:
                    records.append(json.loads(raw))
                except json.JSONDecodeError:
                    continue
    one_boot = len({r.get("boot") for r in records}) == 1 and all("mono" in r for r in records)
    clock = "mono" if one_boot and records and records[0].get("boot") is not None else "ts"
    records.sort(key=lambda r: (r.get(clock, 0.0), r.get("pid", 0)))
    return records


class _EventFile:
    """The open event file of this process: one write() per event, not open + write + close (a "step" event
    every step of a training loop: the syscalls and the directory check were most of emit's cost there).
    Opened again after a fork (another pid: another file), when the directory changes, and when the file was
    removed or replaced (its inode no longer the one written to)."""

    def __init__(self) -> None:
        self.fd = -1
        self.key: tuple[int, str] = (0, "")
        self.inode = (0, 0)

    def write(self, directory: str, data: bytes) -> None:
        key = (os.getpid(), directory)
        path = events_path(directory, key[0])
        if self.fd >= 0 and (key != self.key or self._inode(path) != self.inode):
            self.close()
        if self.fd < 0:
            os.makedirs(directory, exist_ok=True)
            # O_APPEND: lines from threads and forks never interleave.
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            stat = os.fstat(self.fd)
            self.key, self.inode = key, (stat.st_dev, stat.st_ino)
        os.write(self.fd, data)

    @staticmethod
    def _inode(path: str) -> tuple[int, int]:
        try:
            stat = os.stat(path)
        except OSError:
            return (0, 0)
        return (stat.st_dev, stat.st_ino)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


_event_file = _EventFile()


def _append_to_file(line: str) -> None:
    directory = os.environ.get(EVENTS_DIR_ENV)
    if not directory:
        return
    data = (line + "\n").encode()
    with _file_lock:
        try:
            _event_file.write(directory, data)
        except OSError as exc:  # an event file must never take down training
            _event_file.close()
            log.warning("cannot append to the event file under %s=%s: %s", EVENTS_DIR_ENV, directory, exc)


def _record_in_torch(record: dict[str, Any]) -> None:
    from torch.distributed.elastic import events as torch_events

    # torch's metadata values are scalars: lists and dicts travel as JSON text.
    metadata = {k: v if v is None or isinstance(v, str | int | float | bool) else json.dumps(v, default=str)
                for k, v in record.items() if k not in ("event", "ts")}
    torch_events.record(
        torch_events.Event(name=f"elastic.{record['event']}", source=torch_events.EventSource.AGENT,
                           timestamp=int(record["ts"] * 1000), metadata=metadata),
        _torch_destination,
    )
