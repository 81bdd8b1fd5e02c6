"""Bulk imports without the cyclic garbage collector's passes over them.

Importing torch and dynamo allocates about a million objects, and each allocation threshold crossed
triggers a collection that walks the ones made so far: on this project's 2-core host those passes were
~25% of the imports' time (torch + dynamo: 1.87 s with them, 1.46 s without; a warm spare and a
joining node's worker pay it on their critical path, issue K). Nothing an import makes is garbage
worth finding, so the objects are frozen afterwards (`gc.freeze`): no later collection walks them
again, and forked children share their pages instead of touching them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Pause the cyclic collector around bulk imports, then freeze what exists; its previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def freeze_now() -> int:
    """Collect once, then freeze what exists (a long-lived process after its imports: no later collection walks
    them again); returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
