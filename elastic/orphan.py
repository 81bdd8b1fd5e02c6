"""Workers end themselves when their agent dies.

torch starts every worker in a session of its own, so when an agent is killed with SIGKILL (the
OOM killer, `kill -9`, a crashed container runtime) nothing kills its workers: they live on as
orphans, hold their GPU memory and ports, and hang in their next collective until its timeout
(30 minutes for gloo by default), while the agent's replacement starts new workers beside them.

`exit_with_parent()` starts a daemon thread that notices the worker's parent process changing
(the kernel re-parents an orphan to init or a subreaper) and ends the worker at once. It is a poll
of getppid(), not PR_SET_PDEATHSIG: that signal fires when the parent *thread* that forked
exits, and only the process that starts the worker could set it. `trainer.Resumable` calls it for
every worker started by an elastic agent (elastic-run or torchrun).
"""

from __future__ import annotations

import os
import sys
import threading

_POLL_S = 0.5
_started = False
_lock = threading.Lock()

EXIT_CODE = 70
"""The exit status of a worker that ended itself because its agent died."""


def under_agent() -> bool:
    """Whether this process is a worker started by a torch elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def exit_with_parent(poll_s: float = _POLL_S) -> bool:
    """Start watching the parent process (once per process). Returns True if a watch runs."""
    global _started
    with _lock:
        if _started:
            return True
        parent = os.getppid()
        if parent <= 1:
            return False  # already orphaned, or started by init: nothing to watch
        threading.Thread(target=_watch, args=(parent, poll_s), name="elastic-parent-watch", daemon=True).start()
        _started = True
        return True


def _watch(parent: int, poll_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(poll_s):
        if os.getppid() != parent:
            try:  # a stderr whose reader is gone with the agent (a pipe: EPIPE; a hung-up tty: EIO) ended this
                # thread here, and the worker lived on for seconds to minutes
                sys.stderr.write(f"elastic: worker {os.getpid()} exits: its agent (pid {parent}) is gone\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            finally:
                os._exit(EXIT_CODE)  # other threads may be stuck in a collective: do not wait for them
