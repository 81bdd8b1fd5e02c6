"""The `elastic-run` console script: the workers' interpreters first (elastic/prestart.py), then the launcher,
whose imports (torch) they overlap. A module of its own: the launcher imports prestart, not the other way."""

from __future__ import annotations

import signal
import sys

from core.heap import imports_without_gc
from elastic import prestart, stop_signals


def elastic_run() -> int:
    argv = sys.argv[1:]
    stop_signals.install(argv)  # until the launcher's own handlers: its imports take 1-2 s
    try:
        prestart.begin(argv)
        with imports_without_gc():  # the launcher's (core/heap.py), on the same cores as the workers' warm-up
            from elastic.launcher import cli

        return cli()
    except stop_signals.EarlyStop as stop:
        for sig in stop_signals.signals_to_handle(argv):
            signal.signal(sig, signal.SIG_IGN)  # stopping already: a second signal must not interrupt the cleanup
        prestart.dismiss()
        print(f"elastic-run: {stop} before the workers started", file=sys.stderr)
        return 128 + stop.signum


if __name__ == "__main__":  # `python -m elastic.launcher` comes here (runpy)
    sys.exit(elastic_run())
