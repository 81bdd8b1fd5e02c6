"""bench/goodput_bench.py at a tiny size (CPU, forked workers): every variant runs its real loop and
saves, the kill runs resume, and the JSON holds every figure the issue asks for. Outcomes only:
no timing is asserted (the machine is shared)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BENCH = REPO / "bench" / "goodput_bench.py"
# A subset, for make test's budget: ours with and without tier 0 and one anchor. The 50-step variants need
# 50 steps, and DCP's process mode starts a process that imports torch; the GPU runs cover them.
VARIANTS = {"none", "ours_tier1_10", "ours_tier0_1_tier1_10", "dcp_async_thread_10"}
TIER0 = {"ours_tier0_1_tier1_10"}
SHM = Path("/dev/shm")


def _tier0_dirs() -> set[str]:
    return {p.name for p in SHM.glob("goodput-tier0-*")} if SHM.is_dir() else set()


def test_goodput_bench_tiny(procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    before = _tier0_dirs()
    # 24 steps, warm-up 4: two saves of the 10-step variants are timed.
    proc = procs.start(
        [sys.executable, str(BENCH), "--device", "cpu", "--launcher", "fork", "--rounds", "1", "--steps", "24",
         "--variants", *sorted(VARIANTS), "--kill-variants", *sorted(TIER0),
         "--warmup-steps", "4", "--kill-window", "4", "--steps-after-kill", "2", "--layers", "1", "--heads", "1",
         "--d-model", "32", "--seq-len", "16", "--vocab", "64", "--global-batch", "4", "--max-micro-batch", "2",
         "--run-timeout", "120", "--dir", str(tmp_path), "--out", str(out)],
    )
    stdout, _ = proc.communicate(timeout=170)
    assert proc.returncode == 0, stdout[-4000:]
    result = json.loads(out.read_text())
    assert "partial" not in result
    assert set(result["variants"]) == VARIANTS
    summary = result["summary"]
    # `none` first: every ratio is against it, so a failed `none` shows its own log, not another's missing ratio.
    for name, entry in sorted(result["variants"].items(), key=lambda kv: kv[0] != "none"):
        (run,) = entry["rounds"]
        assert run["rc"] == 0 and "error" not in run, (name, run.get("log_tail"))
        assert run["tokens_per_s"] > 0 and run["timed_steps"] == 20, (name, run)
        ratio = summary[name]["ratio_to_none_median"]
        assert ratio is not None and math.isfinite(ratio) and ratio > 0, (name, summary[name])
        expected_saves = {"none": 0}.get(name, 20 if name in TIER0 else 2)
        # a tier-0 snapshot finding no free slot is skipped by design (ckpt/tier0.py), never waited for
        skipped = run.get("ckpt_status", {}).get("skipped", 0) if name in TIER0 else 0
        assert run["saves"] + skipped == expected_saves, (name, run)
        assert (run["saves"] > 0) == (expected_saves > 0), (name, run)
        assert run.get("ckpt_status", {}).get("failed", 0) == 0, (name, run["ckpt_status"])
        if expected_saves:
            assert run["blocked_per_save_s"]["median"] > 0 and run["blocked_per_save_s"]["p90"] > 0, (name, run)
    assert summary["none"]["ratio_to_none_median"] == 1.0
    assert result["machine"]["torch"] and result["machine"]["cpu_count"] >= 1
    assert result["settings"]["launcher"] == "fork"

    kill_step = result["settings"]["kill_step"]
    assert 5 <= kill_step <= 8
    for name, kill in result["kills"].items():
        assert kill["rc"] == 0 and kill["fault_fired"], (name, kill.get("log_tail"))
        assert kill["steps_lost"] == kill_step - kill["resumed_from"] >= 0, (name, kill)
        assert kill["kill_to_first_step_s"] > 0 and kill["restore_s"] >= 0, (name, kill)
        # tier 0 every step: the restarted worker resumes from memory
        assert kill["restored_tier"] == "memory" and kill["steps_lost"] <= 1, (name, kill)
    assert set(result["kills"]) == TIER0
    assert not list(tmp_path.glob("goodput-bench-*")), "the bench leaves its checkpoints behind"
    assert _tier0_dirs() <= before, "the bench leaves its tier-0 directories in /dev/shm"
