"""A tier-1 write spread over time instead of one burst (a probe for issue J; off unless asked for).

On one H200 host the steps 3-4 after each tier-1 persist (1.2 GB written by the checkpoint helper) were the
slowest of the ten, with the training thread's CPU time up: the persist's `fsync` writes the whole file back
at the disk's full speed at once. A training step has slack on the CPU (its kernels are queued ~20 ms ahead
of the device), so the same writeback spread over the steps until the next persist may cost nothing visible.
`WritePace` writes in chunks, starts each chunk's writeback at once (`sync_file_range`, Linux) and sleeps so
that the bytes go out at `bytes_per_s`; the closing fsync then finds little left to write. The helper uses it
where `$ELASTIC_HELPER_WRITE_MBPS` is set (ckpt/helper_process.py): a rate in MB/s, or `auto` (the file over
half the time between the rank's persists), so a benchmark can compare the ways.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from typing import Any

CHUNK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range, or None where there is none (not Linux, no glibc)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the symbols this process has loaded, libc's among them
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing `nbytes` at `offset` of `fd` back to the disk, without waiting (best effort)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # an error only leaves the pages to the closing fsync


class WritePace:
    """Writes at most `bytes_per_s` on average, counted from the first write."""

    def __init__(self, bytes_per_s: float, chunk: int = CHUNK) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a write pace needs a positive rate, not {bytes_per_s}")
        self.bytes_per_s, self.chunk = bytes_per_s, chunk
        self._started: float | None = None
        self._done = 0

    def write(self, fd: int, data: memoryview, offset: int, write: Callable[[int, memoryview], None]) -> None:
        """Write `data` at the file's position (`offset` bytes into the file) through `write`, chunk by chunk."""
        if self._started is None:
            self._started = time.monotonic()
        view = data
        while len(view):
            piece = view[: self.chunk]
            write(fd, piece)
            start_writeback(fd, offset, len(piece))
            offset += len(piece)
            self._done += len(piece)
            view = view[len(piece):]
            # Bounded: at most one chunk's time at this rate.
            time.sleep(max(0.0, self._started + self._done / self.bytes_per_s - time.monotonic()))


AUTO_SHARE = 0.5
"""`auto`: the share of the time between a rank's persists over which its next file is written."""
AUTO_MIN_RATE = 100e6
"""`auto`: never slower than this (bytes/s), whatever the cadence."""


def pace_for(setting: str, nbytes: int, interval_s: float | None) -> WritePace | None:
    """The pace a setting asks for: MB/s as a whole number >= 1; `auto`, `nbytes` over AUTO_SHARE of the time
    since the rank's previous persist (`interval_s`; None for its first: at full speed); anything else, none."""
    if setting == "auto":
        if interval_s is None or interval_s <= 0:
            return None
        return WritePace(max(AUTO_MIN_RATE, nbytes / (AUTO_SHARE * interval_s)))
    if setting.isdigit() and int(setting) >= 1:
        return WritePace(int(setting) * 1e6)
    return None
