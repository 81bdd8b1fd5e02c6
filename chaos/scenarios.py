"""Named presets for `elastic-chaos run --scenario NAME`. Flags given explicitly override a preset.

smoke   2 nodes x 1 worker, 40 steps: kill-worker, corrupt-checkpoint, kill-node@last. Under a minute
        on 2 idle cores; `make test` runs it. Losing the rank-0 node instead
        (`--faults kill-worker,corrupt-checkpoint,kill-node@0`) passes too: the survivor restores
        from the part its own local tier holds.
mixed   3 nodes x 1 worker, 60 steps: kill-node, kill-worker, hang-worker, corrupt-checkpoint, with
        seeded targets. The acceptance run of the chaos issue; try several seeds.
soak    `mixed` repeated `--runs N` times (default 50) with seeds seed, seed+1, ...; one reference
        run serves them all. Writes soak.json and soak.md with the pass rate and per-fault timings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chaos.faults import parse_faults


@dataclass(frozen=True)
class Scenario:
    name: str
    settings: dict[str, Any]
    """ChaosConfig fields."""
    runs: int = 1
    """Default number of runs (soak)."""


SCENARIOS: dict[str, Scenario] = {
    "smoke": Scenario("smoke", {
        "nodes": 2, "nproc_per_node": 1, "steps": 40, "ckpt_every": 5, "seed": 0,
        "faults": parse_faults("kill-worker,corrupt-checkpoint,kill-node@last"),
        "timeout_s": 120.0, "recovery_timeout_s": 60.0,
    }),
    "mixed": Scenario("mixed", {
        "nodes": 3, "nproc_per_node": 1, "steps": 60, "ckpt_every": 5,
        "faults": parse_faults("kill-node,kill-worker,hang-worker,corrupt-checkpoint"),
        "timeout_s": 300.0, "recovery_timeout_s": 90.0,
    }),
    "soak": Scenario("soak", {
        "nodes": 3, "nproc_per_node": 1, "steps": 60, "ckpt_every": 5,
        "faults": parse_faults("kill-node,kill-worker,hang-worker,corrupt-checkpoint"),
        "timeout_s": 300.0, "recovery_timeout_s": 90.0,
    }, runs=50),
}
