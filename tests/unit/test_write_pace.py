"""ckpt/write_pace.py: a paced write keeps its bytes and its rate, and starts the writeback as it goes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckpt import persist
from ckpt.write_pace import WritePace


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


def test_the_rate_comes_from_the_environment_or_there_is_none() -> None:
    assert WritePace.from_env("X", {}) is None
    assert WritePace.from_env("X", {"X": "0"}) is None
    assert WritePace.from_env("X", {"X": "fast"}) is None
    paced = WritePace.from_env("X", {"X": "250"})
    assert paced is not None and paced.bytes_per_s == 250e6
    with pytest.raises(ValueError, match="positive rate"):
        WritePace(0)
