"""The cyclic garbage collector kept off what lives as long as the process.

Importing torch and dynamo allocates about a million objects, and each allocation threshold crossed
triggers a collection that walks the ones made so far: on this project's 2-core host those passes were
~25% of the imports' time (torch + dynamo: 1.87 s with them, 1.46 s without; a warm spare and a
joining node's worker pay it on their critical path, issue K). Nothing an import makes is garbage
worth finding, so the objects are frozen afterwards (`gc.freeze`): no later collection walks them
again, and forked children share their pages instead of touching them.

A training process holds the same: torch's modules, the model, the optimizer and their state live as long as
the loop. The loop's own allocations then trigger a full collection now and then, which walks all of them
(`freeze_long_lived`: on an H200 host a step with one took tens of ms more, the device waiting; ~250 ms a pass
on this project's 2-core host with torch imported).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_frozen = False


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


def freeze_long_lived() -> None:
    """Move every object alive now out of the collector's reach (`gc.freeze`), once per process: the later full
    collections walk only what is made from here on. Frozen objects are still freed when no longer referenced, but
    a cycle among them is never collected, so this is not done again (a later caller is a no-op) and nothing is
    collected first (a full pass, the pause this avoids): the cycles that are garbage at that moment stay, once."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
