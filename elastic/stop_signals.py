"""The launcher's stop signals from its first instruction (no torch import here).

`elastic-run` spends its first 1-2 s importing torch and forking its workers' interpreters (elastic/prestart.py)
before `launcher.cli` can install the handlers that end the agent through its cleanup. A signal in that window
killed the launcher without its one-line message (SIGTERM, SIGHUP, SIGQUIT) or printed the import's traceback
(SIGINT). `install` handles them from the start: `EarlyStop` unwinds to the console script, which ends the
interpreters started so far and exits 128+N with one line. A forked interpreter gets the handlers it would have
had as a fresh process back (`restore`), so a worker dies of SIGTERM as torch expects.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torch's default --signals-to-handle."""

_before: dict[signal.Signals, Any] = {}
"""The handlers `install` replaced, for `restore`."""


class EarlyStop(BaseException):
    """A stop signal before the launcher's own handlers: a BaseException, so that no `except Exception` holds it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def signals_to_handle(argv: Sequence[str]) -> list[signal.Signals]:
    """--signals-to-handle's signals in `argv` (read before the parser has run, which checks the value later; a
    training script's own flag of that name after `--` is not read), none that this process was started ignoring
    (`nohup`: SIGHUP; `cmd &` in a script: SIGINT)."""
    given = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg in ("--signals-to-handle", "--signals_to_handle") and i + 1 < len(argv):
            given = argv[i + 1]
        elif arg.startswith(("--signals-to-handle=", "--signals_to_handle=")):
            given = arg.split("=", 1)[1]
    found = [getattr(signal, name.strip(), None) for name in (given if given is not None else STOP_SIGNALS).split(",")]
    return [sig for sig in found if isinstance(sig, signal.Signals) and signal.getsignal(sig) is not signal.SIG_IGN]


def install(argv: Sequence[str]) -> None:
    """Raise EarlyStop on each stop signal of `argv`'s --signals-to-handle, until the launcher installs its own."""
    def stop(signum: int, _frame: FrameType | None) -> None:
        raise EarlyStop(signum)

    for sig in signals_to_handle(argv):
        _before.setdefault(sig, signal.signal(sig, stop))


def restore() -> None:
    """In a process forked from the launcher: the handlers it had before `install`."""
    for sig, handler in _before.items():
        signal.signal(sig, handler)
    _before.clear()
