"""One deadline type for every bounded wait: `Deadline.after(30).remaining()` instead of
`max(0, deadline - time.monotonic())` spelled at each call site.

The clock is injectable so that tests of timeouts pass a fake clock instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

Clock = Callable[[], float]


@dataclass(frozen=True)
class Deadline:
    """A point on a monotonic clock. `at` is in the clock's seconds; `None` means no deadline."""

    at: float | None
    clock: Clock = field(default=time.monotonic, compare=False, repr=False)

    @classmethod
    def after(cls, seconds: float | timedelta | None, *, clock: Clock = time.monotonic) -> Deadline:
        """The deadline `seconds` from now; `None` gives one that never expires."""
        if seconds is None:
            return cls(None, clock)
        if isinstance(seconds, timedelta):
            seconds = seconds.total_seconds()
        return cls(clock() + seconds, clock)

    def remaining(self) -> float | None:
        """Seconds left, never negative; `None` for no deadline (what `Event.wait` and `join` take)."""
        if self.at is None:
            return None
        return max(0.0, self.at - self.clock())

    def expired(self) -> bool:
        return self.at is not None and self.clock() >= self.at

    def capped(self, seconds: float) -> float:
        """Seconds left, but at most `seconds`: for a poll loop that must also wake up regularly."""
        left = self.remaining()
        return seconds if left is None else min(seconds, left)
