"""bench/persist_bench.py at a tiny size: both modes and the disk's limit run on real files, and the JSON holds
every figure the README quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_persist_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "persist.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "persist_bench.py"), "--gb", "0.01", "--rounds", "2",
                           "--dir", str(tmp_path), "--slot-dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    for mode in ("direct", "buffered", "disk_limit"):
        assert len(result["rounds"][mode]) == 2
        assert result["medians"][mode]["wall_s"] > 0
    assert result["medians"]["direct"]["page_cache_mb"] == 0  # nothing of the file left cached
    assert set(result["ratios"]) == {"direct_over_buffered_wall", "direct_over_buffered_cpu",
                                     "direct_over_disk_limit_wall", "buffered_over_disk_limit_wall"}
    assert list(tmp_path.iterdir()) == [out]  # the slot and the persists are cleaned up
