"""Reading checkpoint files that may be crafted or sit on a hung mount: regular files only, each
read bounded in size and in time.

- A FIFO, socket or device in place of a checkpoint file would block open() or read() for ever
  (or have side effects: opening some devices does something). `os.stat` is checked for S_ISREG
  before anything is opened, and the file is then opened O_NONBLOCK and checked again with
  fstat, so a swap between the two checks cannot slip a FIFO in either.
- A read of a hung disk or network mount blocks in the kernel; `with_deadline` runs it on a
  daemon thread and gives up waiting after the deadline (the thread stays blocked, harmlessly).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ckpt.errors import CheckpointTimeoutError, CheckpointWriteError
from ckpt.format import corrupt

T = TypeVar("T")

MAX_RECORD_BYTES = 256 << 20
"""Largest JSON record (COMMIT, manifest, marker) read; a manifest of a huge state stays far below."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: Path) -> os.stat_result:
    """stat `path` (without opening it) and raise CheckpointCorruptError unless it is a regular
    file, not a link to one: a checkpoint's files are all written here, so a link in place of one leads
    reads outside its directory. FileNotFoundError passes through."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise corrupt(path, f"it is {_kind(st.st_mode)}, not a regular file")
    return st


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file `path` (see the module docstring)."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise corrupt(path, f"it is {_kind(st.st_mode)}, not a regular file")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_own_file(path: Path) -> int:
    """A read-write descriptor of the regular file `path` this process writes (a tier-0 slot's, a replica's),
    created if missing. What someone left in its place is removed first: a symlink is not written through
    (to a file outside tier 0) and a FIFO is not opened (it has no pages to map)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)  # a directory raises here: refused, not written into
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced again between the two calls
        os.close(fd)
        raise CheckpointWriteError(f"{path} is not a regular file (something replaced it as it was made); remove "
                                   "it", path=path)
    return fd


class StillRunning(TimeoutError):
    """`run_within`: the call had not returned by its deadline (its thread is left running)."""


def run_within(fn: Callable[[], T], timeout: float, *, name: str, late: str) -> T:
    """`fn` on a daemon thread named `name`, waited for `timeout` s; StillRunning(`late`) if it has not returned
    (nothing can stop a blocked system or client call: its thread is left behind)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # thread boundary: handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise StillRunning(late)
    if error:
        raise error[0]
    return result[0]


def with_deadline(fn: Callable[[], T], *, timeout: float, what: str, path: Path) -> T:
    """Run `fn` on a daemon thread; raise CheckpointTimeoutError naming `path` after `timeout` s."""
    late = f"{what} of {path} did not finish within {timeout:.0f}s (a hung disk or mount?); this copy is skipped"
    try:
        return run_within(fn, timeout, name="ckpt-read", late=late)
    except StillRunning:
        raise CheckpointTimeoutError(late, path=path) from None


def read_regular(path: Path, *, timeout: float, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
    """The whole content of the regular file `path`, at most `max_bytes`, read within `timeout` s.

    FileNotFoundError/NotADirectoryError pass through (the file is not there); a non-regular or
    oversized file raises CheckpointCorruptError, a hung read CheckpointTimeoutError.
    """

    def read() -> bytes:
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise corrupt(path, f"it is {size} bytes, more than the {max_bytes} a record may be")
            chunks = []
            remaining = max_bytes + 1
            while remaining > 0:
                chunk = os.read(fd, min(remaining, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                remaining -= len(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise corrupt(path, f"it grew past the {max_bytes} bytes a record may be while read")
        return data

    return with_deadline(read, timeout=timeout, what="read", path=path)
