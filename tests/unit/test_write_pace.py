"""ckpt/write_pace.py: a paced write keeps its bytes and its rate, and starts the writeback as it goes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckpt import persist
from ckpt.write_pace import AUTO_MIN_RATE, WritePace, pace_for


def test_a_paced_write_is_the_same_bytes_and_takes_at_least_size_over_rate(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    pace = WritePace(bytes_per_s=20e6, chunk=1 << 20)  # 3 MiB at 20 MB/s: >= 0.157 s, whatever the load
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        started = time.monotonic()
        pace.write(fd, memoryview(data)[: 1 << 20], 0, persist.write_all)
        pace.write(fd, memoryview(data)[1 << 20:], 1 << 20, persist.write_all)  # a second part, the same pace
        took = time.monotonic() - started
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert took >= len(data) / 20e6  # it sleeps after each chunk until its bytes are due at that rate


def test_the_pace_a_setting_asks_for() -> None:
    assert pace_for("", 1 << 30, 1.0) is None  # unset: at full speed
    assert pace_for("0", 1 << 30, 1.0) is None
    assert pace_for("fast", 1 << 30, 1.0) is None
    fixed = pace_for("250", 1 << 30, None)
    assert fixed is not None and fixed.bytes_per_s == 250e6
    assert pace_for("auto", 1 << 30, None) is None  # a rank's first persist: no cadence known yet
    auto = pace_for("auto", 1_200_000_000, 1.6)  # 1.2 GB every 1.6 s: over half of it, 1.5 GB/s
    assert auto is not None and auto.bytes_per_s == 1.5e9
    slow = pace_for("auto", 1_000_000, 60.0)  # a small file at a slow cadence: never below the floor
    assert slow is not None and slow.bytes_per_s == AUTO_MIN_RATE
    with pytest.raises(ValueError, match="positive rate"):
        WritePace(0)
