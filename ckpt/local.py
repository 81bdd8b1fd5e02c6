"""Tier 1: the node-local checkpoint directory, as readers see it (ckpt/layout.py names its files).

`LocalTier` lists the committed steps of this run, reads COMMITs, loads a rank directory with
every check, deletes steps and sweeps the scratch of crashed writes. It offers the interface of
ckpt/tiers.py, like `SharedTier` for tier 2, so restore (ckpt/restore.py) and retention
(ckpt/retention.py) treat both alike. Writing is ckpt/writer.py's (and ckpt/persist.py's) job.

A step directory committed by another run (copied in) is never listed, loaded or deleted here;
it is logged once, naming both runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckpt.commit import CommitMarker, parse_commit
from ckpt.durable import discard_tree, remove_quietly, strerror
from ckpt.errors import (
    CheckpointAccessError,
    CheckpointConflictError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from ckpt.identity import RunIdentity, foreign
from ckpt.layout import FETCH_PREFIX, MANIFEST_FILE, TMP_PREFIX, Layout, is_real_dir, list_dir
from ckpt.manifest import Manifest, resolve_file
from ckpt.ranges import LocalRange
from ckpt.reader import load_rank_dir, read_manifest
from ckpt.safe_io import read_regular
from ckpt.tiers import TierName, holds_rank

logger = logging.getLogger(__name__)

_FETCH_MAX_AGE_S = 3600.0
"""A download scratch directory younger than this may belong to a restore in progress."""


class LocalTier:
    """The tier-1 directory of one node (shared by the ranks of that node)."""

    def __init__(self, root: Path, *, read_timeout: float) -> None:
        self.name: TierName = "local"
        self.layout = Layout(root)
        self.identity: RunIdentity | None = None
        """This run's identity here once claimed; until then every readable COMMIT counts."""
        self.unreadable: set[int] = set()
        """Steps whose copy here failed verification at restore (local retention drops them)."""
        self.foreign: dict[int, str] = {}
        """Steps committed by another run (found by the last listing), with that run: never deleted."""
        self.inaccessible: dict[int, CheckpointAccessError] = {}
        """Steps whose COMMIT this process may not read (found by the last listing): never deleted, and a restore
        does not go back past them (ckpt/restore.py)."""
        self._read_timeout = read_timeout

    @property
    def root(self) -> Path:
        return self.layout.root

    # -- listing -------------------------------------------------------------------------

    def committed(self) -> dict[int, CommitMarker]:
        return self._scan()[0]

    def committed_steps(self) -> list[int]:
        """Committed steps of this run, newest first. A step with a damaged COMMIT is skipped; one
        committed by a newer version is listed (loading it says "upgrade")."""
        markers, newer = self._scan()
        return sorted(set(markers) | newer, reverse=True)

    def _scan(self) -> tuple[dict[int, CommitMarker], set[int]]:
        """(this run's committed steps with their markers, steps committed by a newer version)."""
        identity = self.identity
        markers: dict[int, CommitMarker] = {}
        newer: set[int] = set()
        foreign_now: dict[int, str] = {}
        denied: dict[int, CheckpointAccessError] = {}
        for step in self.layout.step_dirs():
            try:
                marker = self.read_commit(step)
            except CheckpointVersionError:
                newer.add(step)
                continue
            except CheckpointAccessError as exc:
                if step not in self.inaccessible:
                    logger.warning("step %d: %s", step, exc)
                denied[step] = exc
                continue
            except CheckpointError as exc:
                logger.warning("ignoring step %d: %s", step, exc)
                continue
            if marker is None:
                continue
            if identity is not None:
                other = foreign(marker, identity, name=identity.name)
                if other is not None:
                    foreign_now[step] = other
                    if step not in self.foreign:
                        logger.warning(
                            "ignoring %s: it was committed by %s, not by this run %s; to start "
                            "from it, use init_from=%s in a new checkpoint directory",
                            self.layout.commit_path(step),
                            other,
                            identity.describe(),
                            self.layout.step_dir(step),
                        )
                    continue
            markers[step] = marker
        if identity is not None:
            self.foreign = foreign_now
        self.inaccessible = denied
        return markers, newer

    def read_commit(self, step: int) -> CommitMarker | None:
        path = self.layout.commit_path(step)
        try:
            data = read_regular(path, timeout=self._read_timeout)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except PermissionError as exc:
            raise CheckpointAccessError(
                f"cannot read {path}: {strerror(exc)}. The step is not damaged, and nothing is removed or restored "
                "in its place: give this job read access to it (its owner or mode) and start again, or move "
                f"{self.layout.step_dir(step)} away to resume from the step before it", path=path) from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {strerror(exc)}", path=path) from exc
        return parse_commit(data, path=path, step=step)

    def require_commit(self, step: int) -> CommitMarker:
        """The COMMIT of `step`, committed by this run; CheckpointNotFoundError/ConflictError else."""
        assert self.identity is not None
        marker = self.read_commit(step)
        other = None if marker is None else foreign(marker, self.identity, name=self.identity.name)
        if other is not None:
            raise CheckpointConflictError(
                f"step {step} in {self.root} was committed by {other}, not by this run "
                f"{self.identity.describe()}; not loading it (start a new run from it with "
                f"init_from={self.layout.step_dir(step)})",
                path=self.layout.commit_path(step),
            )
        if marker is None:
            path = self.layout.commit_path(step)
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self.root} (no {path}); "
                f"committed steps: {self.committed_steps() or 'none'}",
                path=path,
            )
        return marker

    # -- reading a rank (the Tier interface) ------------------------------------------------

    def has_rank(self, step: int, rank: int, marker: CommitMarker) -> bool:
        return holds_rank(marker, rank) and is_real_dir(self.layout.rank_dir(step, rank))

    def ranks_here(self, step: int, marker: CommitMarker) -> list[int]:
        return [r for r in sorted(self.layout.rank_dirs(step)) if self.has_rank(step, r, marker)]

    def describe_rank(self, step: int, rank: int) -> str:
        return str(self.layout.rank_dir(step, rank))

    @contextmanager
    def open_rank(self, step: int, rank: int, *, expected_manifest_sha256: str | None) -> Iterator[Path]:
        yield self.layout.rank_dir(step, rank)  # read in place

    def read_manifest(self, step: int, rank: int, *, expected_sha256: str | None) -> Manifest:
        path = self.layout.rank_dir(step, rank) / MANIFEST_FILE
        return read_manifest(path, expected_sha256=expected_sha256, timeout=self._read_timeout)[0]

    def range_source(self, step: int, rank: int, name: str) -> LocalRange:
        rank_dir = self.layout.rank_dir(step, rank)
        path = resolve_file(rank_dir, name, manifest_path=rank_dir / MANIFEST_FILE)
        return LocalRange(path, timeout=self._read_timeout)

    def load(self, step: int, rank: int, *, pool: Executor | None) -> dict[str, Any]:
        """Load rank `rank` of `step` committed here by this run, checking everything (see
        Checkpointer.load for the errors)."""
        marker = self.require_commit(step)
        rank_dir = self.layout.rank_dir(step, rank)
        if rank >= marker.world_size or not is_real_dir(rank_dir):
            raise CheckpointNotFoundError(
                f"rank {rank} of step {step} is not in {self.layout.step_dir(step)} "
                f"(saved by world size {marker.world_size}); this node did not write it: "
                f"fetch it from the node that did or load another step",
                path=rank_dir,
            )
        expected = None if marker.manifests is None else marker.manifests.get(rank)
        if marker.manifests is not None and expected is None:
            raise CheckpointNotFoundError(
                f"rank {rank} of step {step} is not part of the commit in "
                f"{self.layout.commit_path(step)}; load another step",
                path=rank_dir,
            )
        assert self.identity is not None
        state = load_rank_dir(
            rank_dir,
            step=step,
            rank=rank,
            expected_manifest_sha256=expected,
            pool=pool,
            run=self.identity.name,
            timeout=self._read_timeout,
        )
        logger.info("loaded rank %d of step %d from %s", rank, step, rank_dir)
        return state

    # -- deleting ------------------------------------------------------------------------

    def delete_step(self, step: int) -> None:
        """Remove the step directory at once (renamed away first, ckpt/durable.py); a failure is logged."""
        path = self.layout.step_dir(step)
        try:
            discard_tree(path)
        except OSError as exc:
            logger.warning("could not remove %s: %s", path, exc)

    def sweep_temp(self, committed: Collection[int]) -> None:
        for step in sorted(committed):
            for entry in list_dir(self.layout.step_dir(step)):
                if entry.name.startswith(TMP_PREFIX):
                    logger.info("removing stale %s", entry)
                    remove_quietly(entry)
        for entry in list_dir(self.root):
            if entry.name.startswith(TMP_PREFIX) and not _young_fetch_dir(entry):
                remove_quietly(entry)


def _young_fetch_dir(entry: Path) -> bool:
    if not entry.name.startswith(FETCH_PREFIX):
        return False
    try:
        return time.time() - entry.stat().st_mtime < _FETCH_MAX_AGE_S
    except OSError:
        return False
