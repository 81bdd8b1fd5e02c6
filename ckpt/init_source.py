"""`init_from`: start a new run from another run's checkpoint (fine-tuning), read-only.

The source is a path or fsspec URL of either a checkpoint root (a tier-1 directory, or a
shared tier's <url>/<run_name>) whose newest committed step is used, or one step directory
(`.../step_000000000060`) for exactly that step. Tier-1 and tier-2 step directories share
their layout, so one reader (a SharedTier rooted at the source, accepting any run) serves
both. It is used only while this run has no committed checkpoint of its own: as soon as the
run saved one, its restarts resume from their own. Which step and rank of it are loaded is the
restore policy's (ckpt/restore.py), as for this run's own tiers.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from ckpt.config import CheckpointConfig, RetryConfig, SharedConfig
from ckpt.layout import parse_step_dir_name
from ckpt.shared import SharedTier


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
        retry=shared.retry if shared is not None else RetryConfig(),
    )
    tier = SharedTier(
        template,
        root_url=root,
        read_timeout=config.read_timeout.total_seconds(),
        scratch=Path(config.local_dir),  # downloads are verified in tier 1's scratch
    )
    return tier, step
