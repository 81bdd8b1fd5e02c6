"""Checkpoints of training state: safetensors data plus a JSON manifest, no pickle.

Two tiers: a node-local directory (tier 1, "local") written in the background from a host
snapshot, and any fsspec URL (tier 2, "shared") replicated in the background, each committed by a
marker written last. `Checkpointer` (ckpt/checkpointer.py) is a facade over the parts; its
docstring maps them.

Public surface: `Checkpointer` (with `PendingSave`, `Restored`, `SaveMetrics`, `TierName`), its configs
(`CheckpointConfig`, `SharedConfig`, `RetryConfig`), `check_compatible` and the error classes.
"""

from ckpt.checkpointer import Checkpointer, PendingSave
from ckpt.compat import check_compatible
from ckpt.config import CheckpointConfig, RetryConfig, SharedConfig
from ckpt.errors import (
    CheckpointAccessError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    CheckpointVersionError,
    CheckpointWriteError,
    SharedStorageError,
)
from ckpt.metrics import SaveMetrics
from ckpt.reshard import ShardMissingError
from ckpt.restore import Restored
from ckpt.sharding import ShardMismatchError
from ckpt.tiers import TierName

__all__ = [
    "CheckpointAccessError",
    "CheckpointConfig",
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "CheckpointVersionError",
    "CheckpointWriteError",
    "Checkpointer",
    "PendingSave",
    "Restored",
    "RetryConfig",
    "SaveMetrics",
    "SharedConfig",
    "ShardMismatchError",
    "ShardMissingError",
    "SharedStorageError",
    "TierName",
    "check_compatible",
]
