"""bench/sharded_bench.py at a tiny size: it runs its real worker processes to the end, cleans them
up, and every restore (ours and DCP's, same layout and resharded) checks out element by element."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BENCH = REPO / "bench" / "sharded_bench.py"


def test_sharded_bench_tiny(procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "sharded.json"
    # fadvise: drops only the bench's own files from the page cache, not the whole machine's
    proc = procs.start(
        [sys.executable, str(BENCH), "--state-gb", "0.01", "--ranks", "2", "--saves", "1", "--restores", "1",
         "--drop-cache", "fadvise", "--timeout", "100", "--dir", str(tmp_path), "--json", str(out)],
    )
    stdout, _ = proc.communicate(timeout=110)
    assert proc.returncode == 0, stdout[-4000:]
    result = json.loads(out.read_text())
    assert result["exitcodes"] == [0, 0], result["errors"]
    assert result["errors"] == {}, result["errors"]
    assert result["page_cache"]["dropped_before_each_restore_with"] == ["posix_fadvise_dontneed"]
    for phase, ranks in (("restore_same_layout", 2), ("restore_reshard", 1)):
        section = result[phase]
        assert section["ranks"] == ranks
        for impl in ("ours_restore", "dcp_load"):
            assert section[impl]["verified"] == ["ok"], (phase, impl, section[impl])
            assert section[impl]["s"]["max"] > 0
    for key in ("copy_limit_s", "ours_stall_s", "dcp_async_blocked_s", "dcp_save_s"):
        assert result["save"][key]["max"] > 0, key
    assert set(result["targets_met"]) == set(result["targets"])
    assert not list(tmp_path.glob("sharded-bench-*")), "the bench leaves its checkpoints behind"
