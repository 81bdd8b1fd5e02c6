"""`init_from`: start a new run from another run's checkpoint (fine-tuning), read-only.

The source is a path or fsspec URL of either a checkpoint root (a tier-1 directory, or a
shared tier's <url>/<run_name>) whose newest committed step is used, or one step directory
(`.../step_000000000060`) for exactly that step. Tier-1 and tier-2 step directories share
their layout, so one reader (a SharedTier rooted at the source, accepting any run) serves
both. It is used only while this run has no committed checkpoint of its own: as soon as the
run saved one, its restarts resume from their own.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable

from ckpt.commit import CommitMarker
from ckpt.config import CheckpointConfig, SharedConfig
from ckpt.errors import CheckpointError, CheckpointVersionError
from ckpt.layout import parse_step_dir_name
from ckpt.restore import Restored, ranks_to_try
from ckpt.shared import SharedTier

logger = logging.getLogger(__name__)


def split_source(spec: str) -> tuple[str, int | None]:
    """(the checkpoint root, the step or None) of an init_from value."""
    trimmed = spec.rstrip("/")
    step = parse_step_dir_name(posixpath.basename(trimmed))
    if step is None:
        return trimmed, None
    return posixpath.dirname(trimmed) or "/", step


def open_source(config: CheckpointConfig) -> tuple[SharedTier, int | None]:
    """A reader of config.init_from (storage options and retries of config.shared, if any)."""
    assert config.init_from is not None
    root, step = split_source(config.init_from)
    shared = config.shared
    template = SharedConfig(
        url=root,
        run_name="init",
        storage_options=shared.storage_options if shared is not None else {},
        **({"retry": shared.retry} if shared is not None else {}),
    )
    tier = SharedTier(template, root_url=root, read_timeout=config.read_timeout.total_seconds())
    return tier, step


def restore_from_source(
    tier: SharedTier,
    fixed: int | None,
    *,
    rank: int,
    replicated: bool,
    step: int | None,
    max_step: int | None,
    load: Callable[[SharedTier, int, int, CommitMarker], Restored],
) -> Restored | None:
    """The newest step of the source this rank can load (the fixed one if init_from named it)."""
    try:
        markers = tier.committed()
    except CheckpointError as exc:
        logger.warning("init_from %s not listed: %s", tier.url, exc)
        return None
    candidates = sorted(markers, reverse=True)
    if fixed is not None:
        candidates = [s for s in candidates if s == fixed]
        if not candidates:
            logger.warning("init_from %s: step %d is not committed there", tier.url, fixed)
    if step is not None:
        candidates = [s for s in candidates if s == step]
    if max_step is not None:
        candidates = [s for s in candidates if s <= max_step]
    for candidate in candidates:
        marker = markers[candidate]
        own = rank < marker.world_size and (marker.manifests is None or rank in marker.manifests)
        for source_rank in ranks_to_try(
            rank=rank, saved_world_size=marker.world_size, has_own=own, replicated=replicated
        ):
            try:
                restored = load(tier, candidate, source_rank, marker)
            except CheckpointVersionError:
                raise
            except CheckpointError as exc:
                logger.warning("init_from: skipping step %d rank %d: %s", candidate, source_rank, exc)
                continue
            logger.info(
                "starting from another run's checkpoint: step %d (rank %d's part) of %s (run %r)",
                candidate,
                source_rank,
                tier.url,
                marker.run or "unnamed",
            )
            return restored
    return None

