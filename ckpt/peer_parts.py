"""The parts of committed steps this node holds, read to send to another rank, and kept when received.

A sharded state's restore needs, for its new layout, the parts of every rank that saved the step. A node
that joins (or replaces a lost one) holds none of them in its tiers 0 and 1; without a shared tier the group
would agree on no step. trainer/part_transfer.py then sends the missing parts over the process group, from a
rank holding each (its tier 0: its own snapshots and peers' replicas; tier 1), and every rank lacking one keeps
it here as a replica in its tier 0 (ckpt/replica.py's layout, under the node name `group-r<rank>`), verified
against its manifest's checksum before the manifest is written; the agreement then finds the step, and the
restore reads it like any replica (verified again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ckpt.errors import CheckpointNotFoundError
from ckpt.format import corrupt
from ckpt.layout import MANIFEST_FILE, STATE_FILE
from ckpt.manifest import parse_manifest
from ckpt.replica import keep_replica
from ckpt.tiers import Tier


@dataclass(frozen=True)
class Part:
    """One rank's part of a step: its manifest's bytes and its data file's first `nbytes` bytes."""

    manifest: bytes
    state: Path
    nbytes: int


def parts_held(tiers: Sequence[Tier]) -> dict[int, tuple[int, list[int]]]:
    """step -> (the world size that saved it, the ranks whose parts `tiers` hold), for every committed step."""
    found: dict[int, tuple[int, list[int]]] = {}
    for tier in tiers:
        for step, marker in tier.committed().items():
            _, ranks = found.get(step, (marker.world_size, []))
            found[step] = (marker.world_size, sorted(set(ranks) | set(tier.ranks_here(step, marker))))
    return found


@contextmanager
def open_part(tiers: Sequence[Tier], step: int, rank: int) -> Iterator[Part]:
    """Rank `rank`'s part of `step` from the first of `tiers` that holds it (read in place: send it at once)."""
    for tier in tiers:
        marker = tier.committed().get(step)
        if marker is None or not tier.has_rank(step, rank, marker):
            continue
        expected = marker.manifests.get(rank) if marker.manifests else None
        with tier.open_rank(step, rank, expected_manifest_sha256=expected) as path:
            manifest = (path / MANIFEST_FILE).read_bytes()
            entry = parse_manifest(manifest, path=path / MANIFEST_FILE).files.get(STATE_FILE)
            if entry is None:
                raise corrupt(path / MANIFEST_FILE, f"it lists no {STATE_FILE}")
            yield Part(manifest, path / STATE_FILE, entry.bytes)
            return
    raise CheckpointNotFoundError(f"no tier of this node holds rank {rank}'s part of step {step}")


def keep_part(tier0: Path, *, receiver: int, step: int, rank: int, manifest: bytes, size: int,
              fill: Callable[[memoryview], None]) -> Path:
    """Keep rank `rank`'s part of `step`, received by rank `receiver`, in this node's tier 0 (ckpt/replica.py's
    keep_replica: ReplicaError when its bytes do not match the manifest)."""
    return keep_replica(tier0, node=f"group-r{receiver}", rank=rank, step=step, size=size, manifest=manifest,
                        fill=fill, pool=None)
