"""bench/copy_overlap.py: what a snapshot's copies on a side stream cost the training stream's kernels, from a
torch.profiler Chrome trace (synthetic here: this host has no GPU to trace)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def kernel(name: str, ts: float, dur: float, *, tid: int = 7, cat: str = "kernel", ext: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": ext, **args}}


def trace(with_copy: bool) -> list[dict]:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "pid": 1, "tid": 1, "ts": 0, "dur": 1,
         "args": {"External id": 1}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000,
         "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 2, "ts": 0, "dur": 0,
         "args": {}},  # the same step marked on another thread, empty: not a second step
        # "add" runs 10 us outside the copies and 30 us beside them; "mm" is unaffected
        kernel("add", 0, 10), kernel("add", 20, 10), kernel("add", 100, 30), kernel("add", 140, 30),
        kernel("mm", 50, 40, ext=2), kernel("mm", 175, 40, ext=2),  # the second in the window's tail
        kernel("only_beside", 180, 5, ext=3),  # never ran outside a window: nothing to compare it with
        kernel("Memcpy HtoD", 400, 10, cat="gpu_memcpy", bytes=100),  # the loop's own copy, on its stream
    ]
    if with_copy:
        events += [kernel("Memcpy DtoH", 95, 50, tid=20, cat="gpu_memcpy", bytes=50_000),
                   kernel("Memcpy DtoH", 145, 45, tid=20, cat="gpu_memcpy", bytes=50_000)]
    return events


def run(tmp_path: Path, *extra: str) -> dict:
    ours = tmp_path / "ours.trace.json.gz"
    with gzip.open(ours, "wt") as f:
        json.dump({"traceEvents": trace(True)}, f)
    base = tmp_path / "none.trace.json"
    base.write_text(json.dumps(trace(False)))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "copy_overlap.py"), str(ours), "--baseline",
                          str(base), *extra], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_kernels_slowed_beside_the_copies_are_costed_against_their_own_runs_outside(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result["traced_steps"] == 1
    assert result["training_stream"] == [0, 7]
    assert result["copies"]["count"] == 2 and result["copies"]["streams"] == ["(0, 20)"]
    assert result["copies"]["gb_per_s"] == pytest.approx(100_000 / 95 / 1e3, abs=0.1)
    assert result["copies"]["window_in_step"] == [{"from_ms": 0.1, "to_ms": 0.2}]  # one merged window, 95-190 us
    add = result["most"][0]
    assert (add["name"], add["op"], add["runs_in"], add["mean_out_us"], add["mean_in_us"]) == ("add", "aten::add_", 2,
                                                                                                 10.0, 30.0)
    assert add["extra_us"] == 40.0 and add["baseline_mean_us"] == 20.0  # the baseline's four runs: 10, 10, 30, 30
    assert result["cost_ms"] == 0.04 and result["cost_ms_per_step"] == 0.04  # "mm" costs nothing, "only_beside" out
    assert [c["name"] for c in result["most"]] == ["add", "mm"]
    assert result["baseline"]["training_busy_ms_per_step"] == result["training_busy_ms_per_step"] == 0.175


def test_a_trace_without_kernels_says_how_to_take_one(tmp_path: Path) -> None:
    path = tmp_path / "cpu.trace.json"
    path.write_text(json.dumps({"traceEvents": [e for e in trace(False) if e["cat"] not in ("kernel", "gpu_memcpy")]}))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "copy_overlap.py"), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "ProfilerActivity.CUDA" in done.stderr
