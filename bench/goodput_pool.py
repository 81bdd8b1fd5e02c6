"""Pool the rounds of several `bench/goodput_bench.py` runs: one run's median moves by about ±0.6% from run
to run on one H200 (the host's state, the first rounds on a fresh machine), so a target near 0.99 is judged on
all rounds of the same code together.

    python bench/goodput_pool.py bench/results/goodput_cuda_h200_session40_*.json [--code d90da95 ...]

Prints JSON: per variant, each run's median ratio to `none` (paired by round, as the bench's summary), the
pooled median over all rounds, how many rounds reach each target, and the kill figures of every run.
`--code` keeps only the runs whose commit or tree digest is one of those given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

TARGET = 0.99


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
    return {"variants": out, "kills": kills}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="goodput_bench.py JSON files")
    p.add_argument("--code", nargs="*", default=None, help="keep runs of these commits or tree digests only")
    args = p.parse_args(argv)
    loaded = []
    for path in args.results:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            p.error(f"{path}: not a goodput_bench.py result ({exc})")
        code = result.get("code") or {}
        if args.code is not None and not {code.get("commit"), code.get("tree_digest")} & set(args.code):
            continue
        loaded.append((path.name, result))
    if not loaded:
        p.error("no run left to pool (check --code)")
    pooled = pool(loaded)
    json.dump(pooled, sys.stdout, indent=2)
    print()
    return pooled


if __name__ == "__main__":
    main()
