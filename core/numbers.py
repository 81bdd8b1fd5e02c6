"""Numbers read from names and keys that others may have written (file and directory names, etcd keys, records)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

_DECIMAL = re.compile(r"[0-9]{1,18}")


def decimal(text: str) -> int | None:
    """`text` as an int when it is 1-18 ASCII digits (so it fits an int64), else None.

    Not `text.isdigit()`: that is also true of "²" and other Unicode digits, which `int()` then refuses with a
    ValueError, and of a 5000-digit string, past Python's limit on int conversion."""
    return int(text) if _DECIMAL.fullmatch(text) else None


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: a whole number >= `minimum` (argparse then names the flag: "argument --steps: must be a
    whole number >= 0, got '-1'"), where a bad value otherwise failed in every worker, after the group formed."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
        return value

    return parse
