"""The interface both checkpoint tiers offer to restore and retention: `LocalTier` (tier 1, the
node-local directory, ckpt/local.py) and `SharedTier` (tier 2, any fsspec URL, ckpt/shared.py).

A tier lists its committed steps, reads a step's COMMIT, says whether it holds a rank's files of
a step, opens them as a local directory for the verified reader (ckpt/reader.py), deletes a step
and sweeps the scratch of crashed writes. What to load from which tier, in which order, is
decided once, against this interface, in ckpt/restore.py.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from ckpt.commit import CommitMarker
from ckpt.manifest import Manifest
from ckpt.ranges import RangeSource

TierName = Literal["memory", "local", "shared"]
"""Tier 0 is "memory", tier 1 "local", tier 2 "shared": the names in Restored.tier, logs and events."""


def holds_rank(marker: CommitMarker | None, rank: int) -> bool:
    """Whether the COMMIT `marker` lists rank `rank` (markers without digests list every rank of
    their world)."""
    if marker is None or rank >= marker.world_size:
        return False
    return marker.manifests is None or rank in marker.manifests


class Tier(Protocol):
    """One tier of one run, as restore and retention see it."""

    name: TierName
    unreadable: set[int]
    """Steps of this tier whose copy failed verification at restore (see ckpt/retention.py)."""

    def committed(self) -> dict[int, CommitMarker]:
        """This run's committed steps with their COMMIT markers (damaged ones are logged, left out)."""
        ...

    def read_commit(self, step: int) -> CommitMarker | None:
        """The COMMIT of `step`, None if it has none. Raises CheckpointError (damaged) or
        CheckpointVersionError (written by a newer version)."""
        ...

    def has_rank(self, step: int, rank: int, marker: CommitMarker) -> bool:
        """Whether this tier holds rank `rank`'s files of `step`, committed by `marker`."""
        ...

    def ranks_here(self, step: int, marker: CommitMarker) -> list[int]:
        """The ranks of `step` whose files lie on this node (loaded without a download), ascending;
        bounded by what is on disk, never by the (possibly crafted) world size of the COMMIT."""
        ...

    def open_rank(
        self, step: int, rank: int, *, expected_manifest_sha256: str | None
    ) -> AbstractContextManager[Path]:
        """A local directory holding rank `rank`'s files of `step` while the context is open
        (the rank directory itself, or a verified download that is removed afterwards)."""
        ...

    def read_manifest(self, step: int, rank: int, *, expected_sha256: str | None) -> Manifest:
        """Rank `rank`'s manifest of `step`, checked against the COMMIT's sha256 of it. Raises
        CheckpointCorruptError / CheckpointVersionError naming it."""
        ...

    def range_source(self, step: int, rank: int, name: str) -> RangeSource:
        """Range reads of rank `rank`'s data file `name` of `step` (unverified: see ckpt/ranges.py);
        its reads raise CheckpointError (missing, timed out, tier 2 failing)."""
        ...

    def describe_rank(self, step: int, rank: int) -> str:
        """Where rank `rank` of `step` lies, for messages and Restored.path."""
        ...

    def delete_step(self, step: int) -> None:
        """Delete `step` so that readers never see part of it."""
        ...

    def sweep_temp(self, committed: Collection[int]) -> None:
        """Remove scratch left by crashed writes: inside the `committed` steps (never inside a
        step that may still be written) and at the root."""
        ...


@dataclass(frozen=True)
class Copy:
    """One tier's commit of one step."""

    tier: Tier
    marker: CommitMarker
