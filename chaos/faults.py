"""The fault catalog: what each fault does, what it targets, what it needs, and how much it may cost.

A fault is named on the command line as `kind` or `kind@target`:

    kill-worker           SIGKILL the worker of a seeded global rank
    kill-worker@1         ... of global rank 1
    kill-node@last        SIGKILL every process of the node that holds the highest group rank

The target of a worker fault is a global rank, of a node fault a group rank (`last`: the highest
one at injection time), of an etcd fault a member index. Without a target the schedule draws one
from the seed. Targets are roles, not node names: which node holds a rank depends on join order,
so keying faults by rank keeps a seed reproducible.

This module is pure: the injection itself is `chaos.inject`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.numbers import decimal

Target = Literal["worker", "node", "etcd", "none"]


@dataclass(frozen=True, kw_only=True)
class FaultKind:
    name: str
    """The name used in `--faults`."""
    summary: str
    """One line: what the fault does."""
    target: Target
    """What `@target` selects: a worker's global rank, a node's group rank, an etcd member, or nothing."""
    restarts: bool
    """Whether the fault is expected to make the worker group restart (and so to lose steps)."""
    lost_bound: int = 1
    """Steps lost may be up to this many checkpoint intervals."""
    removes_node: bool = False
    """The fault takes a node out of the job for good."""
    adds_node: bool = False
    """The fault brings an extra node into the job."""
    needs_shared_tier: bool = False
    """Only meaningful when the training script writes a shared tier (it has a shared-tier flag)."""


CATALOG: dict[str, FaultKind] = {
    k.name: k
    for k in (
        FaultKind(name="kill-worker", summary="SIGKILL one worker", target="worker", restarts=True),
        FaultKind(name="kill-node", summary="SIGKILL every process of one node (agent and workers)",
                  target="node", restarts=True, removes_node=True),
        FaultKind(name="hang-worker", summary="SIGSTOP one worker; the agent's --hang-timeout must catch it",
                  target="worker", restarts=True),
        FaultKind(name="kill-etcd-member", summary="SIGKILL one member of a 3-member etcd cluster",
                  target="etcd", restarts=False),
        FaultKind(name="restart-etcd", summary="stop every etcd member, wait, start them again on the same data",
                  target="none", restarts=False),
        FaultKind(name="corrupt-checkpoint",
                  summary="SIGKILL a worker of one node so that the group must restore, then flip bytes in "
                          "that node's newest committed checkpoint and in its tier-0 snapshots",
                  target="node", restarts=True, lost_bound=2),
        FaultKind(name="shared-storage-outage", summary="make the shared tier fail for a while, then bring it back",
                  target="none", restarts=False, needs_shared_tier=True),
        FaultKind(name="disk-full", summary="fill one node's tier-1 filesystem for a while, then free it",
                  target="node", restarts=False, needs_shared_tier=True),
        FaultKind(name="kill-ckpt-helper",
                  summary="SIGKILL one node's checkpoint helper process (ckpt/helper.py): training goes on, its "
                          "agent starts a new one",
                  target="node", restarts=False),
        FaultKind(name="add-node", summary="start an extra node (new node id, empty local tier)",
                  target="none", restarts=True, adds_node=True),
        FaultKind(name="partition-node", summary="cut one node off the network (network namespaces, root only)",
                  target="node", restarts=True, removes_node=True),
    )
}
"""Every fault the harness knows, by name."""

# corrupt-checkpoint may lose two intervals on purpose: it destroys the newest checkpoint, so the
# group goes back to the one before it.


@dataclass(frozen=True)
class FaultSpec:
    """One fault as given on the command line."""

    kind: str
    target: int | Literal["last"] | None = None

    def __str__(self) -> str:
        return self.kind if self.target is None else f"{self.kind}@{self.target}"


def parse_faults(text: str) -> tuple[FaultSpec, ...]:
    """Parse `kind[@target],kind[@target],...`. Raises ValueError naming an unknown kind or a bad target."""
    specs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, target_text = item.partition("@")
        if name not in CATALOG:
            raise ValueError(f"unknown fault kind {name!r}; known kinds: {', '.join(CATALOG)}")
        kind = CATALOG[name]
        target: int | Literal["last"] | None = None
        if target_text:
            if kind.target == "none":
                raise ValueError(f"fault {name!r} takes no target, got {item!r}")
            if target_text == "last":
                target = "last"
            elif (rank := decimal(target_text)) is not None:
                target = rank
            else:
                raise ValueError(f"fault target in {item!r} must be a rank number or 'last'")
        specs.append(FaultSpec(name, target))
    return tuple(specs)


def check_feasible(specs: tuple[FaultSpec, ...], *, nodes: int, nproc_per_node: int, etcd_members: int) -> list[str]:
    """Problems that make a fault list impossible for this cluster, each as one sentence (empty: fine).

    Walks the list in order, tracking how many nodes are still in the job.
    """
    problems: list[str] = []
    live = nodes
    etcd_alive = etcd_members
    for i, spec in enumerate(specs):
        kind = CATALOG[spec.kind]
        where = f"fault {i + 1} ({spec})"
        if kind.removes_node and live < 2:
            problems.append(f"{where} needs at least 2 nodes in the job so that one survives, "
                            f"but only {live} would be left by then; add --nodes or an add-node before it")
        if kind.target == "node" and isinstance(spec.target, int) and spec.target >= live:
            problems.append(f"{where}: group rank {spec.target} does not exist with {live} nodes")
        if kind.target == "worker" and isinstance(spec.target, int) and spec.target >= live * nproc_per_node:
            problems.append(f"{where}: global rank {spec.target} does not exist with world size "
                            f"{live * nproc_per_node}")
        if spec.kind == "kill-etcd-member":
            if etcd_members < 3:
                problems.append(f"{where} needs --etcd-members 3: killing the only member of a 1-member etcd "
                                "is an outage, not a member loss (use restart-etcd for that)")
            elif etcd_alive - 1 < etcd_members // 2 + 1:
                problems.append(f"{where} would leave {etcd_alive - 1} of {etcd_members} etcd members: no quorum")
            elif isinstance(spec.target, int) and spec.target >= etcd_members:
                problems.append(f"{where}: etcd member {spec.target} does not exist (members 0..{etcd_members - 1})")
            etcd_alive -= 1
        if kind.removes_node:
            live -= 1
        if kind.adds_node:
            live += 1
    return problems


def max_nodes(specs: tuple[FaultSpec, ...], nodes: int) -> int:
    """The most nodes the job may ever have: the agents' --nnodes maximum."""
    return nodes + sum(1 for s in specs if CATALOG[s.kind].adds_node)
