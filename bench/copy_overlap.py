"""What a snapshot's device-to-host copies cost the training stream's kernels (issue J), from a torch.profiler
Chrome trace of `bench/goodput_bench.py` ($GOODPUT_TRACE=<dir>, written as <dir>/<run>.trace.json[.gz]).

    python bench/copy_overlap.py ours-s1-p10-r0-756.trace.json.gz [--baseline none-s10-p0-r0-547.trace.json.gz]

The training stream is the stream with the most kernels; the copy streams are the others that ran memcpys.
Each kernel of the training stream is "in" a copy window when it overlaps one. Per kernel name, the time its
runs inside the windows took beyond that name's mean outside them is the copies' cost to it. Prints JSON: the
traced steps, the copy windows (count, time, bytes and GB/s, start and end in each step), the training stream's
busy time per step, the cost in total and per step, and the names that pay most (the aten op that launched
them, runs in the windows, mean us outside and inside). `--baseline` (the same loop without snapshots) adds its
busy time per step and its means per name.

Traced steps are slowed by the profiler (the CPU launches kernels later): compare a traced run with a traced
run, and read the cost per kernel, not the step time.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict[str, Any]]:
    """The complete ("X") events of a Chrome trace, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def _stream(e: dict[str, Any]) -> tuple[Any, Any]:
    return e.get("pid"), e.get("tid")


def _merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _steps(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Each traced step's span: its longest "ProfilerStep#k" event (the profiler marks a step on more than one
    thread, and some of those marks are empty)."""
    longest: dict[str, dict[str, Any]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if name.startswith("ProfilerStep") and e["dur"] > longest.get(name, {"dur": -1})["dur"]:
            longest[name] = e
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in longest.values())


def _launched_by(events: list[dict[str, Any]]) -> dict[Any, str]:
    """The aten op of each external id (the CPU op whose launch a kernel carries)."""
    ops: dict[Any, str] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e.get("args", {}).get("External id"), e["name"])
    return ops


def training_stream(events: list[dict[str, Any]]) -> tuple[Any, Any]:
    kernels = Counter(_stream(e) for e in events if e.get("cat") == "kernel")
    if not kernels:
        raise SystemExit("no GPU kernels in the trace: was it taken on a CUDA device with ProfilerActivity.CUDA?")
    return kernels.most_common(1)[0][0]


def _means(kernels: list[dict[str, Any]]) -> dict[str, float]:
    runs: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        runs[e["name"]].append(e["dur"])
    return {name: sum(d) / len(d) for name, d in runs.items()}


def analyse(events: list[dict[str, Any]], *, top: int = 10) -> tuple[dict[str, Any], dict[str, float]]:
    """(the figures the module prints, each training-stream kernel name's mean duration in us)."""
    train = training_stream(events)
    on_train = [e for e in events if e.get("cat") in GPU_CATS and _stream(e) == train]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and _stream(e) != train]
    windows = _merged([(e["ts"], e["ts"] + e["dur"]) for e in copies])
    starts = [w[0] for w in windows]

    def in_window(e: dict[str, Any]) -> bool:
        i = bisect.bisect_right(starts, e["ts"] + e["dur"]) - 1
        return i >= 0 and windows[i][1] > e["ts"]

    inside: dict[str, list[float]] = defaultdict(list)
    outside: dict[str, list[float]] = defaultdict(list)
    first_op: dict[str, Any] = {}
    for e in on_train:
        (inside if in_window(e) else outside)[e["name"]].append(e["dur"])
        first_op.setdefault(e["name"], e.get("args", {}).get("External id"))
    ops = _launched_by(events)
    costs: list[dict[str, Any]] = []
    for name, runs in inside.items():
        if not outside.get(name):
            continue  # only ever ran beside the copies: nothing to compare with
        mean_out = sum(outside[name]) / len(outside[name])
        costs.append({"extra_us": round(sum(runs) - len(runs) * mean_out, 1), "name": name,
                      "op": ops.get(first_op[name]), "runs_in": len(runs), "mean_out_us": round(mean_out, 1),
                      "mean_in_us": round(sum(runs) / len(runs), 1)})
    costs.sort(key=lambda c: -c["extra_us"])
    steps = _steps(events)
    n = max(len(steps), 1)
    copy_us = sum(e["dur"] for e in copies)
    copy_bytes = sum(e.get("args", {}).get("bytes", 0) for e in copies)
    extra_ms = sum(c["extra_us"] for c in costs) / 1e3
    per_step = []
    for begin, end in steps:
        mine = [w for w in windows if begin <= w[0] < end]
        if mine:
            per_step.append({"from_ms": round((mine[0][0] - begin) / 1e3, 1),
                             "to_ms": round((mine[-1][1] - begin) / 1e3, 1)})
    return {
        "traced_steps": len(steps),
        "training_stream": list(train),
        "training_busy_ms_per_step": round(sum(e["dur"] for e in on_train) / 1e3 / n, 3),
        "copies": {"count": len(copies), "streams": sorted({str(_stream(e)) for e in copies}),
                   "busy_ms_per_step": round(copy_us / 1e3 / n, 3),
                   "gb_per_s": round(copy_bytes / copy_us / 1e3, 1) if copy_us else None,
                   "window_in_step": per_step},
        "cost_ms": round(extra_ms, 3),
        "cost_ms_per_step": round(extra_ms / n, 3),
        "most": costs[:top],
    }, _means(on_train)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a run with snapshots (its copies on a side stream)")
    p.add_argument("--baseline", type=Path, default=None, help="the same loop without snapshots")
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    result, _ = analyse(load(args.trace), top=args.top)
    result["trace"] = str(args.trace)
    if args.baseline is not None:
        base, base_means = analyse(load(args.baseline), top=0)
        result["baseline"] = {"trace": str(args.baseline),
                              "training_busy_ms_per_step": base["training_busy_ms_per_step"]}
        for cost in result["most"]:
            mean = base_means.get(cost["name"])
            cost["baseline_mean_us"] = None if mean is None else round(mean, 1)
    for cost in result["most"]:
        cost["name"] = cost["name"][:160]  # C++ template names run to thousands of characters
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
