"""Configuration of the checkpointer."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints live and how many are kept."""

    local_dir: str
    """Tier-1 root: a node-local directory (NVMe); a PathLike is accepted and stored as str."""

    keep_last: int = 3
    """Number of committed checkpoints kept in `local_dir`; older ones are deleted on commit."""

    def __post_init__(self) -> None:
        local_dir = self.local_dir
        if not isinstance(local_dir, (str, os.PathLike)):
            raise ValueError(
                f"local_dir must be a path, got {local_dir!r} ({type(local_dir).__name__})"
            )
        local_dir = os.fspath(local_dir)
        if not isinstance(local_dir, str) or not local_dir:
            raise ValueError(f"local_dir must be a non-empty path, got {self.local_dir!r}")
        object.__setattr__(self, "local_dir", local_dir)
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int):
            raise ValueError(f"keep_last must be an int >= 1, got {self.keep_last!r}")
        if self.keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (at least the newest checkpoint is kept), got {self.keep_last}"
            )
