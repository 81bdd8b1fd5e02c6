"""Crash-safe file-system primitives: fsync'd writes, atomic renames, tree removal."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from ckpt.layout import temp_name

logger = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory; their renames are durable anyway.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` (which must not exist), write `data` and fsync it."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically: readers see the old file or the whole new one."""
    _replace(path, lambda tmp: write_new_file(tmp, data))


def copy_atomic(source: Path, path: Path) -> None:
    """Replace `path` with a copy of the file `source`, atomically and fsynced, as write_atomic does."""
    def copy(tmp: Path) -> None:
        with open(source, "rb") as src, open(tmp, "xb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
            dst.flush()
            os.fsync(dst.fileno())

    _replace(path, copy)


def _replace(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(temp_name(path.name))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the fully written directory `tmp` to `final`, replacing a leftover `final`."""
    if final.exists() or final.is_symlink():
        logger.warning("replacing %s left by an earlier attempt", final)
        discard_tree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def discard_tree(path: Path) -> None:
    """Remove `path` so that it vanishes at once: rename it to a scratch name, then delete it.

    A crash midway leaves only a `.tmp-` entry, never a half-deleted `path`.
    """
    doomed = path.with_name(temp_name("del-" + path.name))
    os.rename(path, doomed)
    fsync_dir(path.parent)
    remove_quietly(doomed)


def remove_quietly(path: Path) -> None:
    """Delete a file or tree, logging (not raising) what could not be removed."""

    if path.is_dir() and not path.is_symlink():
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_log_removal_error)
        else:
            shutil.rmtree(path, onerror=lambda f, n, ei: _log_removal_error(f, n, ei[1]))
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            _log_removal_error(None, str(path), exc)


def _log_removal_error(func: object, name: str, exc: BaseException) -> None:
    if isinstance(exc, FileNotFoundError):
        return  # already gone: another local rank's sweep of scratch removed it first
    logger.warning("could not remove %s: %s", name, exc)


def strerror(exc: OSError) -> str:
    """ "No space left on device (ENOSPC)" for an OSError with an errno, else str(exc)."""
    if exc.errno is not None:
        return f"{os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc)
