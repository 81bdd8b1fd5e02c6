"""Directories in shared tmpfs that belong to one process (an agent's tier 0, its workers' progress beats), and
the sweep of those whose owner is gone.

A process killed with SIGKILL cannot remove its directory, so each new one first removes those of owners that no
longer exist. The pid in the name says so only within one PID namespace: agents in containers that share /dev/shm
(docker --ipc=host) see other pid numbers, and one removed a live agent's tier 0. So the owner also holds a lock
on a file in its directory for as long as it lives (released by the kernel when it dies), and a directory whose
lock is held is never removed, whatever its pid says.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from core import procfs
from core.numbers import decimal

OWNER_FILE = ".owner"
_held: list[int] = []
"""Descriptors of the owner files this process holds locked (open until it exits)."""


def make(base: Path, prefix: str) -> str:
    """A fresh directory `<base>/<prefix><pid>-XXXXXXXX` (0700) owned by this process, after removing those of
    owners that are gone."""
    for old in base.glob(f"{prefix}*-*"):
        if _gone(old, decimal(old.name[len(prefix):].split("-")[0])):
            shutil.rmtree(old, ignore_errors=True)
    # Locked under a hidden name, then renamed into place: another owner's sweep never sees it without its lock.
    hidden = tempfile.mkdtemp(prefix=f".{prefix}{os.getpid()}-", dir=base)
    fd = os.open(os.path.join(hidden, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held.append(fd)
    made = os.path.join(base, os.path.basename(hidden)[1:])
    os.rename(hidden, made)
    return made


def _gone(path: Path, pid: int | None) -> bool:
    """Whether the owner of `path` (named after `pid`) is gone: no such process here, and no one holds its lock
    (a directory made before owners locked one goes by its pid alone)."""
    if pid is None or procfs.alive(pid):
        return False
    try:
        fd = os.open(path / OWNER_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # not ours to judge (a link, no permission): left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False  # held: a live owner this namespace cannot see
    finally:
        os.close(fd)
