"""How a worker process ends: without the interpreter's last full garbage collection, and, once it holds
process groups it could not free, without the interpreter's finalization at all.

Last collection: at exit CPython collects every object still alive; a process that imported torch holds about
a million of them, and that last pass cost 1.3-1.6 s of CPU per worker and per agent here (measured: a 2-worker
elastic-run job of examples/train_tiny.py, 15.7 -> 13.6 CPU-s). Freezing them at exit skips it: memory
goes back to the OS with the process anyway. Objects are still freed by reference counting, so files
are closed and flushed as before; only finalizers of objects caught in reference cycles no longer run
at exit (our checkpoint and event files are written with explicit fsync, renames and O_APPEND writes,
never left to a finalizer).

No finalization (`end_without_finalization`): a survivor of an in-place re-formation keeps the old gloo group
for the life of the process (trainer/regroup.py: freeing it can wait forever), with its C++ threads. Python's
finalization with such threads alive aborted an FSDP survivor that had finished its job ("terminate called
without an active exception", exit -6, so its agent restarted the whole node: seen twice in CI, never in ~40
runs of a reproduction): torch documents the hazard of a gloo group alive at exit (pytorch/pytorch#190489).
Such a process ends as a warm spare's worker always does (elastic/spare_process.py): the non-daemon threads are
waited for, the atexit handlers run, the standard streams are flushed, then os._exit with the exit code Python
would have used.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import os
import signal
import sys
import threading
from typing import Any, NoReturn

KILLED_BY_SIGINT = 1 << 40
"""The code `end` takes for an uncaught KeyboardInterrupt: the process then ends killed by SIGINT, as Python's own
exit does (a value no exit code takes: sys.exit(-2) is status 254, not a death by SIGINT)."""

_installed = False
_exit_code: int | None = None
"""The code sys.exit was called with once finalization is to be skipped (None: not called)."""
_threads_shutdown = getattr(threading, "_shutdown", None)
"""Python's own wait for the non-daemon threads, the first step of its exit (replaced while finalization is
skipped: the interpreter calls `threading._shutdown` once the main module has ended, before the atexit handlers)."""


def install() -> None:
    """Freeze the heap at exit (idempotent). Registered first, so it runs after every later atexit hook."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(gc.freeze)


def end_without_finalization(code: int | None = None) -> None:
    """From now on this process ends as a warm spare's worker does (see the module docstring): once the main
    module has ended, the non-daemon threads are waited for, the atexit handlers run and the standard streams are
    flushed, then os._exit with the code Python would use. `code`: the code already decided (a SystemExit on its
    way out of the main module), else 0; then that of an uncaught exception, a KeyboardInterrupt, or sys.exit /
    exit / quit on the main thread. Call it where the script is done (trainer.run_elastic returning): a bare
    `raise SystemExit(code)` after it is not seen, nor is a sys.exit whose SystemExit was caught and ignored."""
    global _exit_code
    if code is not None:
        _exit_code = code
    if _threads_shutdown is None or threading._shutdown is _shutdown_then_end:  # type: ignore[attr-defined]
        return
    threading._shutdown = _shutdown_then_end  # type: ignore[attr-defined]
    sys.exit = _recording_exit
    builtins.exit = builtins.quit = _recording_exit  # type: ignore[assignment]


def _recording_exit(code: Any = None) -> NoReturn:
    global _exit_code
    if threading.current_thread() is threading.main_thread():  # on another thread it ends only that thread
        _exit_code = code_of(code)
    raise SystemExit(code)


def code_of(code: Any) -> int:
    """The process exit code of SystemExit(code), as Python computes it (a message means 1)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _shutdown_then_end() -> NoReturn:
    uncaught = getattr(sys, "last_value", None)  # set by Python as it printed an uncaught exception
    if isinstance(uncaught, KeyboardInterrupt):
        code = KILLED_BY_SIGINT
    elif uncaught is not None:
        code = 1
    else:
        code = _exit_code or 0
    exit_as_python_does(code)


def exit_as_python_does(code: int) -> NoReturn:
    """What an interpreter does when its main module ends (wait for non-daemon threads, run the atexit handlers,
    flush), then os._exit: the interpreter's finalization does not run (objects' finalizers at shutdown, C-level
    exit handlers and C++ static destructors)."""
    try:
        if _threads_shutdown is not None:
            _threads_shutdown()
        atexit._run_exitfuncs()  # noqa: SLF001 - the worker's own handlers (a logger's flush, a tracker's finish)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced by the script
                pass
    finally:
        end(code)


def end(code: int) -> NoReturn:
    """os._exit(code) (its low 8 bits, as the status Python's exit leaves), or for KILLED_BY_SIGINT death by
    SIGINT, as Python's own exit after a KeyboardInterrupt."""
    if code == KILLED_BY_SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + int(signal.SIGINT)  # not reached
    os._exit(code & 0xFF)
