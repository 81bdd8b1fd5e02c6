"""Worker progress heartbeats, the contract between workers and their agent for hang detection.

The agent sets `ELASTIC_PROGRESS_DIR` for its workers. A worker calls `beat(step)` after each step
(`trainer.Resumable.step_done` does it for you); that rewrites `<dir>/local_rank_<n>` at most a few
times a second. The agent treats a worker whose file is older than its hang timeout as hung (for
example one stopped with SIGSTOP, or stuck in a collective) and kills it, so the group restarts.
A worker that never beats is never judged: plain torchrun scripts keep working unchanged.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV_DIR = "ELASTIC_PROGRESS_DIR"
_MIN_INTERVAL_S = 0.25
_last_beat = 0.0


def beat(step: int) -> None:
    """Report progress to the agent (a no-op outside elastic-run). Cheap enough to call every step."""
    global _last_beat
    directory = os.environ.get(ENV_DIR)
    now = time.monotonic()
    if not directory or now - _last_beat < _MIN_INTERVAL_S:
        return
    _last_beat = now
    path = Path(directory) / f"local_rank_{os.environ.get('LOCAL_RANK', '0')}"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(str(step))
        os.replace(tmp, path)
    except OSError:
        pass  # progress reporting must never break training


def last_beat_age(directory: str | Path, local_rank: int, now: float | None = None) -> float | None:
    """Seconds since the worker's last beat, or None if it has not beaten yet."""
    try:
        mtime = (Path(directory) / f"local_rank_{local_rank}").stat().st_mtime
    except FileNotFoundError:
        return None
    return (time.time() if now is None else now) - mtime


def clear(directory: str | Path) -> None:
    """Forget all beats (before a new set of workers starts)."""
    for f in Path(directory).glob("local_rank_*"):
        f.unlink(missing_ok=True)
