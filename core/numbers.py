"""Numbers read from names and keys that others may have written (file and directory names, etcd keys, records)."""

from __future__ import annotations

import re

_DECIMAL = re.compile(r"[0-9]{1,18}")


def decimal(text: str) -> int | None:
    """`text` as an int when it is 1-18 ASCII digits (so it fits an int64), else None.

    Not `text.isdigit()`: that is also true of "²" and other Unicode digits, which `int()` then refuses with a
    ValueError, and of a 5000-digit string, past Python's limit on int conversion."""
    return int(text) if _DECIMAL.fullmatch(text) else None
