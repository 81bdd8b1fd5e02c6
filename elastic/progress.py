"""Worker progress heartbeats, the contract between workers and their agent for hang detection.

The agent sets `ELASTIC_PROGRESS_DIR` for its workers. A worker calls `beat(step)` after each step
(`trainer.Resumable.step_done` does it for you); that rewrites `<dir>/local_rank_<n>` at most a few
times a second. The agent treats a worker whose file is older than its hang timeout as hung (for
example one stopped with SIGSTOP, or stuck in a collective) and kills it, so the group restarts.
A worker that never beats is never judged: plain torchrun scripts keep working unchanged, and
neither is one that called `finish()`: flushing checkpoints and tearing down the process group at
the end can take longer than the hang timeout without anything being stuck.

A beat holds "<step> <time.monotonic()>": the worker and its agent share the host's monotonic clock, so an NTP
step of the wall clock neither makes a healthy worker's beat look an hour old (its agent killed it as hung) nor
hides a hung one's (judged an hour late). A beat without the time (another writer) is aged by its file's mtime.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core import owned_dir
from core.tier0_dir import shm_root

ENV_DIR = "ELASTIC_PROGRESS_DIR"
_MIN_INTERVAL_S = 0.25
_FINISHED = "finished"
_RESTARTED = "restarted"
_last_beat = 0.0


def beat(step: int) -> None:
    """Report progress to the agent (a no-op outside elastic-run). Cheap enough to call every step."""
    global _last_beat
    now = time.monotonic()
    if now - _last_beat < _MIN_INTERVAL_S:
        return
    _last_beat = now
    _write(f"{step} {now:.3f}")


def finish() -> None:
    """Tell the agent this worker is done training: from now on it is never judged as hung."""
    _write(_FINISHED)


def _write(text: str) -> None:
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    try:
        _replace(Path(directory) / f"local_rank_{os.environ.get('LOCAL_RANK', '0')}", text)
    except OSError:
        pass  # progress reporting must never break training


def _replace(path: Path, text: str) -> None:
    """`path` holds `text`, whole (the agent never reads half a beat)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Beat:
    age: float
    """Seconds since the worker's last beat, or since it was (re)started where it has not beaten since."""
    restarted: bool
    """No beat since the (re)start `clear` marked: its first step (a restore, a compile) is still running."""


def last_beat(directory: str | Path, local_rank: int, now: float | None = None) -> Beat | None:
    """The worker's last beat (`now`: time.monotonic()); None if it never beat (nor did its predecessor) or it
    has finished."""
    path = Path(directory) / f"local_rank_{local_rank}"
    try:
        mtime = path.stat().st_mtime
        text = path.read_text()
    except FileNotFoundError:
        return None
    if text == _FINISHED:
        return None
    at = beat_time(text)
    if at is None:  # no monotonic time in it: the file's age on the wall clock
        return Beat(time.time() - mtime, restarted=False)
    return Beat(max((time.monotonic() if now is None else now) - at, 0.0), restarted=text.startswith(_RESTARTED))


def beat_time(text: str) -> float | None:
    """The time.monotonic() a beat's text was written at, if it holds one."""
    _, _, at = text.partition(" ")
    try:
        value = float(at)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def make_dir(root: Path | None = None) -> str:
    """A fresh beat directory for this agent, named after its pid.

    An agent killed with SIGKILL cannot remove its directory, so each new agent first removes the
    directories of agents that no longer exist (core/owned_dir.py).
    """
    # In tmpfs where there is one: a beat is a write and a rename on the training thread, and on the
    # checkpoints' disk those can wait behind a tier-1 fsync (seen: 1.6 s behind a 1 GiB write).
    return owned_dir.make(root if root is not None else shm_root(), "elastic-progress-")


def clear(directory: str | Path, local_ranks: Iterable[int] | None = None) -> None:
    """Forget the beats of `local_ranks` (all: before a new set of workers starts; some: their processes were
    replaced, or kept through a re-formation) and mark each that had beaten as (re)started now: a new process
    is not judged by its predecessor's last beat, and one that hangs before its first step is judged from its
    start (`Beat.restarted`; unmarked, it was never judged: seen, a replacement that hung in its restore hung the
    job for good). A worker that never beat stays unjudged (a plain script)."""
    paths = (Path(directory).glob("local_rank_*") if local_ranks is None
             else (Path(directory) / f"local_rank_{lr}" for lr in local_ranks))
    marker = f"{_RESTARTED} {time.monotonic():.3f}"
    for f in paths:
        if f.suffix == ".tmp":  # a beat's write cut short
            f.unlink(missing_ok=True)
            continue
        try:
            if f.read_text() == _FINISHED:
                f.unlink(missing_ok=True)
                continue
            _replace(f, marker)
        except FileNotFoundError:
            continue
        except OSError:
            f.unlink(missing_ok=True)
