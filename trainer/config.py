"""`ResumeConfig`: when `Resumable` saves, and the checkpointer's own configuration, whole.

The checkpointer's options are not renamed here: `ResumeConfig.ckpt` is a `ckpt.CheckpointConfig`,
so every one of them (snapshot `mode` including "overlapped", `if_busy`, `checksum`, `keep_every`,
the shared tier with its retention and retries, `init_from`, `max_failed_saves`) is reachable.
The common case is one call:

    ResumeConfig.at("/nvme/ckpt", save_every=100, shared_url="s3://bucket/ckpt", run_name="job-42")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from ckpt import CheckpointConfig, SharedConfig


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    ckpt: CheckpointConfig
    """Where checkpoints go and how they are written (ckpt/config.py)."""
    save_every: int
    """Save after every N-th completed step (and the last step, at `Resumable.teardown`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ckpt, CheckpointConfig):
            raise ValueError(f"ResumeConfig.ckpt must be a ckpt.CheckpointConfig, got {type(self.ckpt).__name__}; "
                             "ResumeConfig.at(ckpt_dir, save_every=...) builds one")
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every <= 0:
            raise ValueError(f"save_every must be a positive int, got {self.save_every!r}")

    @property
    def ckpt_dir(self) -> str:
        """Tier 1: the node-local checkpoint directory."""
        return self.ckpt.local_dir

    @classmethod
    def at(cls, ckpt_dir: str | os.PathLike[str], *, save_every: int, shared_url: str | None = None,
           **options: Any) -> ResumeConfig:
        """Checkpoints in `ckpt_dir` every `save_every` steps; with `shared_url` (any fsspec URL) also in
        a shared tier (SharedConfig defaults; pass `shared=SharedConfig(...)` for its options instead).

        `options` are CheckpointConfig fields: run_name, keep_last, keep_every, mode, if_busy, checksum,
        init_from, max_failed_saves, ..."""
        known = {f.name for f in fields(CheckpointConfig)} - {"local_dir"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"ResumeConfig.at: {', '.join(unknown)} is not a CheckpointConfig option; "
                            f"the options are {', '.join(sorted(known))}")
        if shared_url is not None:
            if options.get("shared") is not None:
                raise ValueError("ResumeConfig.at: pass shared_url or shared=SharedConfig(...), not both")
            options["shared"] = SharedConfig(url=shared_url)
        return cls(ckpt=CheckpointConfig(local_dir=os.fspath(ckpt_dir), **options), save_every=save_every)
