"""Pool the rounds of several `bench/goodput_bench.py` runs: one run's median moves by about ±0.6% from run
to run on one H200 (the host's state, the first rounds on a fresh machine), so a target near 0.99 is judged on
all rounds of the same code together.

    python bench/goodput_pool.py bench/results/goodput_cuda_h200_session40_*.json [--code d90da95 ...]

Prints JSON: per variant, each run's median ratio to `none` (paired by round, as the bench's summary), the
pooled median over all rounds, how many rounds reach each target, and the kill figures of every run.
`--code` keeps only the runs whose commit or tree digest is one of those given. `--rename FILE:OLD=NEW` pools
variant OLD of the runs whose file name contains FILE as NEW, where a default changed between runs and the
same setting ran under two names (all of a run's renames apply at once, so two names can swap).
Per variant it also counts the slow steps (SLOW_OVER or more over their round's median step) and their time over
the median, per round, from the runs' raw step times. `--pair A B` sets two variants that ran in the same rounds
side by side: per round, B's ratio minus A's (both paired with that round's `none`), an A/B test within the noise
between rounds:

    python bench/goodput_pool.py bench/results/goodput_cuda_h200_session41_*.json \
        --rename device_image:ours_tier0_1_tier1_10=ours_tier0_1_tier1_10_device_image \
        --rename device_image:ours_tier0_1_tier1_10_host_sums=ours_tier0_1_tier1_10
    python bench/goodput_pool.py bench/results/goodput_cuda_h200_session43_*.json \
        --pair ours_tier0_1_tier1_10_buffered ours_tier0_1_tier1_10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

TARGET = 0.99
SLOW_OVER = 0.003
"""A step this many seconds or more over its round's median step is slow (also goodput_bench.py's `split_s`)."""


def slow_steps(step_s: list[float]) -> tuple[int, float]:
    """How many of one round's step times are slow, and their time over the median in all (seconds)."""
    if not step_s:
        return 0, 0.0
    median = statistics.median(step_s)
    over = [s - median for s in step_s if s >= median + SLOW_OVER]
    return len(over), sum(over)


def pool(results: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    variants: dict[str, dict[str, Any]] = {}
    kills: dict[str, list[dict[str, Any]]] = {}
    for name, result in results:
        summary = result.get("summary", {})
        for variant, figures in summary.items():
            if variant in ("targets", "kills") or not isinstance(figures, dict) or "skipped" in figures:
                continue
            rounds = figures.get("ratio_to_none_per_round") or []
            entry = variants.setdefault(variant, {"runs": {}, "rounds": []})
            entry["runs"][name] = figures.get("ratio_to_none_median")
            entry["rounds"] += rounds
        for variant, figures in (summary.get("kills") or {}).items():
            kills.setdefault(variant, []).append({"run": name, **figures})
        for variant in summary:
            if variant in variants:
                variants[variant].setdefault("slow", []).extend(round_slow_steps(result, variant))
    out: dict[str, Any] = {}
    for variant, entry in variants.items():
        rounds = entry["rounds"]
        out[variant] = {
            "run_medians": entry["runs"],
            "rounds": len(rounds),
            "pooled_median": round(statistics.median(rounds), 4) if rounds else None,
            f"rounds_at_or_over_{TARGET}": sum(1 for r in rounds if r >= TARGET),
            "runs_at_or_over": sum(1 for m in entry["runs"].values() if m is not None and m >= TARGET),
        }
        if entry.get("slow"):
            slow = entry["slow"]
            out[variant]["slow_steps_per_round"] = round(statistics.fmean(n for n, _ in slow), 2)
            out[variant]["slow_ms_per_round"] = round(statistics.fmean(t for _, t in slow) * 1e3, 1)
            out[variant]["rounds_with_step_times"] = len(slow)
    return {"variants": out, "kills": kills}


def round_slow_steps(result: dict[str, Any], variant: str) -> list[tuple[int, float]]:
    """`slow_steps` of each of the variant's rounds that the summary pairs with `none` (the first ones: a round
    cut short by --time-budget has no `none` beside it) and that kept its step times."""
    paired = len((result.get("summary", {}).get(variant) or {}).get("ratio_to_none_per_round") or [])
    rounds = ((result.get("variants") or {}).get(variant) or {}).get("rounds", [])[:paired]
    return [slow_steps(r["raw"]["step_s"]) for r in rounds if (r.get("raw") or {}).get("step_s")]


def pair(results: list[tuple[str, dict[str, Any]]], a: str, b: str) -> dict[str, Any]:
    """Variant `b` against `a` round by round, in the runs that ran both: b's ratio to `none` minus a's."""
    per_run: dict[str, list[float]] = {}
    slow: dict[str, list[tuple[int, float]]] = {a: [], b: []}
    for name, result in results:
        summary = result.get("summary", {})
        rounds_a = (summary.get(a) or {}).get("ratio_to_none_per_round")
        rounds_b = (summary.get(b) or {}).get("ratio_to_none_per_round")
        if rounds_a and rounds_b:
            per_run[name] = [round(y - x, 4) for x, y in zip(rounds_a, rounds_b, strict=False)]
            n = len(per_run[name])
            slow[a] += round_slow_steps(result, a)[:n]
            slow[b] += round_slow_steps(result, b)[:n]
    diffs = [d for run in per_run.values() for d in run]
    if not diffs:
        return {"a": a, "b": b, "rounds": 0, "note": f"no run has both {a!r} and {b!r}"}
    return {"a": a, "b": b, "rounds": len(diffs), "b_minus_a_per_run": per_run,
            "median": round(statistics.median(diffs), 4), "min": min(diffs), "max": max(diffs),
            "rounds_b_ahead": sum(1 for d in diffs if d > 0),
            "slow_steps_per_round": {v: round(statistics.fmean(n for n, _ in r), 2) for v, r in slow.items() if r},
            "slow_ms_per_round": {v: round(statistics.fmean(t for _, t in r) * 1e3, 1) for v, r in slow.items() if r}}


def parse_rename(spec: str) -> tuple[str, str, str]:
    """FILE:OLD=NEW as (FILE, OLD, NEW); ValueError naming the flag when it is not that."""
    where, sep, names = spec.partition(":")
    old, eq, new = names.partition("=")
    if not (sep and eq and where and old and new):
        raise ValueError(f"--rename {spec!r}: expected FILE:OLD=NEW (a part of the file name, the variant's name "
                         f"in that run, the name to pool it under)")
    return where, old, new


def renamed(result: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`result` with its summary's variants (and kills) renamed by `names`, all at once."""
    summary: dict[str, Any] = {}
    for key, value in result.get("summary", {}).items():
        if key == "kills" and isinstance(value, dict):
            summary[key] = {names.get(k, k): v for k, v in value.items()}
        else:
            summary[key if key == "targets" else names.get(key, key)] = value
    ran = {names.get(k, k): v for k, v in (result.get("variants") or {}).items()}
    return {**result, "summary": summary, "variants": ran}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="goodput_bench.py JSON files")
    p.add_argument("--code", nargs="*", default=None, help="keep runs of these commits or tree digests only")
    p.add_argument("--rename", action="append", default=[], metavar="FILE:OLD=NEW",
                   help="pool variant OLD of the runs whose file name contains FILE as NEW (repeatable)")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"),
                   help="B's ratio minus A's, round by round, in the runs that ran both (repeatable)")
    args = p.parse_args(argv)
    try:
        renames = [parse_rename(spec) for spec in args.rename]
    except ValueError as exc:
        p.error(str(exc))
    loaded = []
    for path in args.results:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            p.error(f"{path}: not a goodput_bench.py result ({exc})")
        code = result.get("code") or {}
        if args.code is not None and not {code.get("commit"), code.get("tree_digest")} & set(args.code):
            continue
        names = {o: n for where, o, n in renames if where in path.name}
        loaded.append((path.name, renamed(result, names) if names else result))
    if not loaded:
        p.error("no run left to pool (check --code)")
    pooled = pool(loaded)
    if args.pair:
        pooled["pairs"] = [pair(loaded, a, b) for a, b in args.pair]
    json.dump(pooled, sys.stdout, indent=2)
    print()
    return pooled


if __name__ == "__main__":
    main()
