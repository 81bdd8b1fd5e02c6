"""Where a node's checkpoint helper sends its tier-0 replicas: a file the agent writes, the helper reads.

    <tier0 dir>/replica_targets.json   {"node": "<this node>", "targets": [{"node", "addr"}, ...], "job": "<run id>"}

elastic-run's agent knows the round (its members in rank order) and each member's replica address (its
membership record's "replica", elastic/rendezvous.py); the helper (ckpt/replica.py) knows neither. The
targets are the members after this node in rank order, wrapping around (a ring), so each node's replicas
land on the next node(s) and every node holds the replicas of the one(s) before it. Written whenever the
round changes (atomically: the helper reads the old list or the new one).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TARGETS_FILE = "replica_targets.json"


@dataclass(frozen=True)
class Target:
    node: str
    addr: str
    """host:port of that node's helper's replica listener."""


def ring_targets(members: tuple[str, ...], me: str, addrs: dict[str, str]) -> list[Target]:
    """The members after `me` in the round's rank order (the ring), those with an address."""
    if me not in members:
        return []
    i = members.index(me)
    ring = members[i + 1:] + members[:i]
    return [Target(n, addrs[n]) for n in ring if addrs.get(n)]


def write_targets(tier0: Path, node: str, targets: list[Target], job: str = "") -> None:
    """`job`: the job's rendezvous run id. Pushes carry it, and a node keeps only its own job's (a stale sender of
    another job, whose old target's port this node's listener now has, would fill its tier 0 with that job's
    state under the same default run name)."""
    doc = {"node": node, "targets": [{"node": t.node, "addr": t.addr} for t in targets], "job": job}
    tmp = tier0 / f".{TARGETS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, tier0 / TARGETS_FILE)


def read_targets(tier0: Path) -> tuple[str, list[Target]]:
    """(this node's id, its targets in ring order); ("", []) before the agent wrote any."""
    try:
        doc = json.loads((tier0 / TARGETS_FILE).read_bytes())
        return str(doc["node"]), [Target(str(t["node"]), str(t["addr"])) for t in doc["targets"]]
    except (OSError, ValueError, KeyError, TypeError):
        return "", []


def read_job(tier0: Path) -> str:
    """The job the agent wrote the targets for; "" before it wrote any (or a file of before jobs were named)."""
    try:
        job = json.loads((tier0 / TARGETS_FILE).read_bytes()).get("job", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return job if isinstance(job, str) else ""
