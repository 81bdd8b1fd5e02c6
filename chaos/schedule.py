"""The fault plan: at which step each fault fires and whom it hits, drawn from `--seed`.

Pure and deterministic: the same faults, steps, checkpoint interval, cluster shape and seed give the
same plan, so a failing chaos run can be replayed exactly.

Faults fire in the order given. The steps between the first checkpoint and the end are cut into
one equal slot per fault, and each fault fires at a step drawn inside its slot. A fault fires only
once the job has recovered from the previous one, at the first step at or past its `at_step`.
`corrupt-checkpoint` is drawn a little after a checkpoint step (never on one), so that the newest
checkpoint is committed and the next save is still a few steps away when the node's worker is killed
(the bytes are flipped once it is gone), and more than a checkpoint interval before the end, so that a
restore still follows it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from chaos.faults import CATALOG, FaultSpec

LASTING = ("restart-etcd", "shared-storage-outage", "disk-full")
"""Faults that last `hold_s` seconds before they are healed."""
MIN_HOLD_S, MAX_HOLD_S = 2.0, 4.0


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    index: int
    """Position in the plan, from 0."""
    kind: str
    """A name from the catalog."""
    at_step: int
    """Fire at the first step at or past this one, once the previous fault has recovered."""
    target: int | Literal["last"] | None
    """Global rank (worker faults), group rank (node faults), member index (etcd); None: no target."""
    hold_s: float = 0.0
    """For faults that last a while (outages, a full disk, etcd down): how long, in seconds."""


def plan(
    specs: tuple[FaultSpec, ...],
    *,
    steps: int,
    ckpt_every: int,
    seed: int,
    nodes: int,
    nproc_per_node: int,
    etcd_members: int = 1,
) -> tuple[PlannedFault, ...]:
    """The seeded plan for `specs`. Raises ValueError when there are not enough steps for the faults."""
    if not specs:
        return ()
    first, last = ckpt_every + 1, steps - 2
    width = (last - first + 1) // len(specs)
    if width < 1:
        raise ValueError(
            f"--steps {steps} leaves no room for {len(specs)} faults after the first checkpoint at step "
            f"{ckpt_every}; use at least --steps {ckpt_every + 2 + len(specs)}"
        )
    rng = random.Random(seed)
    live, members = nodes, list(range(etcd_members))
    out = []
    for i, spec in enumerate(specs):
        kind = CATALOG[spec.kind]
        lo, hi = first + i * width, first + (i + 1) * width - 1
        candidates = list(range(lo, hi + 1))
        if spec.kind == "corrupt-checkpoint":
            good = [s for s in candidates if 1 <= s % ckpt_every <= max(1, ckpt_every // 2)]
            # A checkpoint interval and more before the end: a fast job runs a few steps past the step the fault
            # saw before its workers are stopped, and one that had committed its last step by then restored
            # nothing (soak seed 1609: planned at 56 of 60, step 60 damaged after the job's end).
            roomy = [s for s in good if s <= steps - ckpt_every - 2]
            candidates = roomy or good or candidates
        elif spec.kind == "disk-full":
            # Healed before the job's last save: a run whose last save failed does not exit 0 (trainer), and this
            # fault's invariant allows no restart.
            candidates = [s for s in candidates if s <= steps - 2 * ckpt_every - 2] or candidates
        at_step = rng.choice(candidates)
        target = spec.target
        if target is None:
            if kind.target == "worker":
                target = rng.randrange(live * nproc_per_node)
            elif kind.target == "node":
                target = rng.randrange(live)
            elif kind.target == "etcd":
                target = rng.choice(members)
        if kind.target == "etcd" and isinstance(target, int) and target in members:
            members.remove(target)
        hold_s = round(rng.uniform(MIN_HOLD_S, MAX_HOLD_S), 2) if spec.kind in LASTING else 0.0
        out.append(PlannedFault(index=i, kind=spec.kind, at_step=at_step, target=target, hold_s=hold_s))
        if kind.removes_node:
            live -= 1
        if kind.adds_node:
            live += 1
    return tuple(out)


def describe_target(pf: PlannedFault) -> str:
    """Whom a planned fault hits, in words (before it fires and the target is known by name)."""
    kind = CATALOG[pf.kind].target
    if kind == "worker":
        return f"global rank {pf.target}"
    if kind == "node":
        return f"group rank {pf.target}"
    if kind == "etcd":
        return f"etcd member m{pf.target}"
    return ""
