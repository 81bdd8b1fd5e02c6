"""Pool the rounds of several `bench/goodput_bench.py` runs: one run's median moves by about ±0.6% from run
to run on one H200 (the host's state, the first rounds on a fresh machine), so a target near 0.99 is judged on
all rounds of the same code together.

    python bench/goodput_pool.py bench/results/goodput_cuda_h200_session40_*.json [--code d90da95 ...]

Prints JSON: per variant, each run's median ratio to `none` (paired by round, as the bench's summary), the
pooled median over all rounds, how many rounds reach each target, and the kill figures of every run.
`--code` keeps only the runs whose commit or tree digest is one of those given. `--rename FILE:OLD=NEW` pools
variant OLD of the runs whose file name contains FILE as NEW, where a default changed between runs and the
same setting ran under two names (all of a run's renames apply at once, so two names can swap):

    python bench/goodput_pool.py bench/results/goodput_cuda_h200_session41_*.json \
        --rename device_image:ours_tier0_1_tier1_10=ours_tier0_1_tier1_10_device_image \
        --rename device_image:ours_tier0_1_tier1_10_host_sums=ours_tier0_1_tier1_10
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
    return {**result, "summary": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="goodput_bench.py JSON files")
    p.add_argument("--code", nargs="*", default=None, help="keep runs of these commits or tree digests only")
    p.add_argument("--rename", action="append", default=[], metavar="FILE:OLD=NEW",
                   help="pool variant OLD of the runs whose file name contains FILE as NEW (repeatable)")
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
    json.dump(pooled, sys.stdout, indent=2)
    print()
    return pooled


if __name__ == "__main__":
    main()
