"""The `elastic-run` console script: the workers' interpreters first (elastic/prestart.py), then the launcher,
whose imports (torch) they overlap. A module of its own: the launcher imports prestart, not the other way."""

from __future__ import annotations

import sys

from core.heap import imports_without_gc
from elastic import prestart


def elastic_run() -> int:
    prestart.begin(sys.argv[1:])
    with imports_without_gc():  # the launcher's (core/heap.py), on the same cores as the workers' warm-up
        from elastic.launcher import cli

    return cli()
