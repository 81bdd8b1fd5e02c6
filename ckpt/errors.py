"""Typed errors of the checkpoint package.

Every message names the file, directory or key at fault and says what to do next.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.exc_chain import chain


class CheckpointError(Exception):
    """Base class of every error raised by `ckpt`.

    `path` is the file or directory at fault, when there is one.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path: Path | None = None if path is None else Path(path)


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, fails its checksum, or holds data that does not parse."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint was written in a format newer than this version of elastic-train reads."""


class CheckpointNotFoundError(CheckpointError):
    """The requested step, or the requested rank of it, is not committed in this directory."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions, ...); nothing partial is visible."""


class CheckpointTimeoutError(CheckpointError):
    """A wait on background checkpoint work passed its deadline; the work goes on."""


class CheckpointSaveError(CheckpointError):
    """Saving cannot go on: `max_failed_saves` saves in a row failed, or another live job took
    over the shared prefix. Stop the job; the message names the directory and the cause."""


class CheckpointConflictError(CheckpointError):
    """A checkpoint directory or shared prefix belongs to another run, or another live job uses
    it; nothing was written. Use another directory, or start from its checkpoints with init_from."""


class CheckpointAccessError(CheckpointError):
    """A checkpoint file or directory this process may not read (permission denied): not damage. Nothing is
    removed, and a restore does not go back past it; fix its owner or mode and start again."""


def permission_denied(exc: BaseException) -> BaseException | None:
    """The permission error (EACCES, EPERM) that `exc` is, or was raised from; None if none is."""
    return next((e for e in chain(exc) if isinstance(e, (PermissionError, CheckpointAccessError))), None)


class SharedStorageError(CheckpointError):
    """Tier 2 (shared storage) failed after bounded retries; training goes on, uploads retry."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A loaded state does not fit the model: keys missing or unexpected, shapes or dtypes differ.

    `missing`, `unexpected` and `mismatched` list the keys.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[str],
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
