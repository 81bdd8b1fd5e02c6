"""Checkpoints of training state: safetensors data plus a JSON manifest, no pickle.

Public surface: `Checkpointer`, `CheckpointConfig` and the error classes.
"""

from ckpt.checkpointer import Checkpointer
from ckpt.config import CheckpointConfig
from ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CheckpointWriteError,
)

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "CheckpointWriteError",
    "Checkpointer",
]
