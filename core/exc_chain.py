"""Walking an exception's chain: what it was raised from (`__cause__`), or during (`__context__`)."""

from __future__ import annotations

from collections.abc import Iterator


def chain(exc: BaseException | None, *, limit: int = 16) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during, and so on: at most `limit`, each once (a cycle ends it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < limit:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
