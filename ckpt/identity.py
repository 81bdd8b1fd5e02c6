"""Run identity and the tier-1 directory lock: one run per checkpoint directory, one live job.

A run is named by `CheckpointConfig.run_name` (what the user sees) and a random uid minted the
first time the name is used in a directory, so two runs that both kept the default name are
still told apart (a step directory copied in from another run's directory is refused). The uid
lives in `<local_dir>/RUN.json` and in `<shared>/<run_name>/RUN.json`; a node whose tier 1 is
empty adopts the shared one (a resume on fresh nodes), and an empty shared prefix takes the
uid of the first node's tier 1. Every COMMIT and manifest records the name and the uid of the
tier it is committed in (see ckpt/commit.py). Checkpoints written before identity existed
carry neither and still load (with a warning).

A directory belongs to the run in its RUN.json. A job of another run fails at start while
committed checkpoints of the owner remain (it would otherwise replace them step by step);
once none remain, it takes the directory over, with a log line.

`DirectoryLock` keeps two live jobs out of one tier-1 directory. The ranks of one job on a
node share the directory (local_world_size of them), so the lock is an flock held shared by
every Checkpointer of the job, with `<local_dir>/LOCK` recording who holds it (pid, host,
run name, job, start time). Taking it happens under a short exclusive flock of a guard file:
when nobody holds LOCK (an exclusive flock succeeds) any record in it is stale and is
replaced; when somebody does, the record says whose job it is, and only the same job (and run
name) is admitted. The kernel drops an flock when its process dies, so a crashed job never
leaves the directory locked. flock works on local file systems; on NFS it is emulated with
POSIX locks or not at all, which is one more reason for tier 1 to be node-local.

The job is $TORCHELASTIC_RUN_ID (set by elastic-run and torchrun for every worker of one job;
elastic-run and torchrun --standalone make it unique per launch); a process started without
it is a job of its own.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ckpt.commit import CommitMarker
from ckpt.durable import write_atomic
from ckpt.errors import (
    CheckpointConflictError,
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriteError,
)
from ckpt.format import CORRUPT_ADVICE, dumps, get_str, loads_object
from ckpt.fs_errors import describe
from ckpt.layout import step_dir_name
from ckpt.safe_io import read_regular
from core.deadline import Deadline

logger = logging.getLogger(__name__)

RUN_FILE = "RUN.json"
LOCK_FILE = "LOCK"
_GUARD_FILE = ".LOCK.guard"
_GUARD_TIMEOUT_S = 30.0
_READ_TIMEOUT_S = 30.0


def job_id() -> str:
    """This process's job (see the module docstring)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"torchelastic:{run_id}"
    return f"process:{socket.gethostname()}:{os.getpid()}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class RunIdentity:
    """A run: its name and the uid minted when the name was first used."""

    name: str
    uid: str

    @staticmethod
    def mint(name: str) -> RunIdentity:
        return RunIdentity(name, uuid.uuid4().hex)

    def describe(self) -> str:
        return f"{self.name!r} (uid {self.uid})"

    def to_bytes(self) -> bytes:
        return dumps({"format_version": 1, "run_name": self.name, "run_uid": self.uid, "created": now_iso()})

    @staticmethod
    def parse(data: bytes, *, path: Path) -> RunIdentity:
        obj = loads_object(data, path=path, what="run identity")
        return RunIdentity(get_str(obj, "run_name", path=path), get_str(obj, "run_uid", path=path))


def foreign(marker: CommitMarker, identity: RunIdentity | None, *, name: str) -> str | None:
    """How `marker` names another run than ours, or None (ours, or legacy: no identity).

    With `identity` None (the uid is not known yet), only the name is compared."""
    if marker.run and marker.run != name:
        return f"run {marker.run!r}" + (f" (uid {marker.run_uid})" if marker.run_uid else "")
    if identity is not None and marker.run_uid and marker.run_uid != identity.uid:
        return f"run {marker.run or name!r} (uid {marker.run_uid})"
    return None


def read_identity(root: Path) -> RunIdentity | None:
    """The identity in `<root>/RUN.json`; None if there is none or it is damaged (logged)."""
    path = root / RUN_FILE
    try:
        return RunIdentity.parse(read_regular(path, timeout=_READ_TIMEOUT_S), path=path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, CheckpointError) as exc:
        # Not a step's file: the step-directory advice of a corrupt record does not apply.
        logger.warning("ignoring %s: %s; the run's identity is taken from its steps' COMMITs", path,
                       str(exc).removesuffix(CORRUPT_ADVICE))
        return None


def claim_directory(
    root: Path,
    name: str,
    *,
    committed: Callable[[], Mapping[int, CommitMarker]],
    shared_uid: str | None,
) -> RunIdentity:
    """This run's identity in tier-1 directory `root` (held under DirectoryLock).

    Raises CheckpointConflictError when `root` holds committed checkpoints of another run.
    `committed()` lists the committed steps of `root` with their markers; `shared_uid` is the
    uid in the shared tier, adopted by an empty directory.
    """
    existing = read_identity(root)
    markers = committed()
    if existing is not None and existing.name == name:
        return existing
    if existing is not None:
        blocking = {s: m for s, m in markers.items() if m.run != name}
        if blocking:
            raise _conflict(root, name, f"run {existing.describe()}", blocking)
        logger.info(
            "%s belonged to run %s, which has no committed checkpoint left there; run %r "
            "takes the directory over",
            root,
            existing.describe(),
            name,
        )
    else:
        others = {s: m for s, m in markers.items() if m.run and m.run != name}
        if others:
            newest = others[max(others)]
            other = f"run {newest.run!r}" + (f" (uid {newest.run_uid})" if newest.run_uid else "")
            raise _conflict(root, name, other, others)
        ours = [markers[s] for s in sorted(markers, reverse=True) if markers[s].run_uid]
        if ours:
            identity = RunIdentity(name, ours[0].run_uid)
            _write(root, identity)
            logger.warning("%s had no %s; recovered run %s from its COMMITs", root, RUN_FILE, identity.describe())
            return identity
        if markers:
            logger.warning(
                "the checkpoints in %s (steps %s) predate run identity; run %r adopts them",
                root,
                sorted(markers),
                name,
            )
    identity = RunIdentity(name, shared_uid) if shared_uid else RunIdentity.mint(name)
    _write(root, identity)
    return identity


def _write(root: Path, identity: RunIdentity) -> None:
    try:
        write_atomic(root / RUN_FILE, identity.to_bytes())
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot write {root / RUN_FILE}: {describe(exc, root)}", path=root / RUN_FILE
        ) from exc


def _conflict(root: Path, name: str, other: str, steps: Mapping[int, CommitMarker]) -> CheckpointConflictError:
    shown = sorted(steps, reverse=True)
    listed = ", ".join(map(str, shown[:5])) + (f" (+{len(shown) - 5} more)" if len(shown) > 5 else "")
    return CheckpointConflictError(
        f"{root} holds committed checkpoints of {other} (steps {listed}); this is run {name!r}, "
        f"and a run never replaces another run's checkpoints. Use another checkpoint directory "
        f"for run {name!r}; to start it from those checkpoints, also set "
        f"init_from={root / step_dir_name(shown[0])}",
        path=root,
    )


@dataclass(frozen=True)
class LockRecord:
    """Who holds `<local_dir>/LOCK`."""

    pid: int
    host: str
    run_name: str
    job: str
    started: str

    def to_bytes(self) -> bytes:
        return dumps(self.__dict__)

    @staticmethod
    def parse(data: bytes) -> LockRecord | None:
        try:
            obj: Any = loads_object(data, path=Path(LOCK_FILE), what="lock record")
            pid = obj["pid"]
            if type(pid) is not int or not 0 < pid < 1 << 31:  # a pid is a C int (os.kill of a larger one overflows)
                return None
            return LockRecord(pid, str(obj["host"]), str(obj["run_name"]), str(obj["job"]), str(obj["started"]))
        except (CheckpointError, KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, run {self.run_name!r}, job {self.job}, since {self.started}"


class DirectoryLock:
    """A shared flock on `<root>/LOCK`, admitting only Checkpointers of one job and run name."""

    def __init__(self, root: Path, fd: int, record: LockRecord) -> None:
        self.root = root
        self.record = record
        self._fd: int | None = fd

    @staticmethod
    def acquire(
        root: Path, *, run_name: str, job: str, under_guard: Callable[[], object] | None = None
    ) -> DirectoryLock:
        """Lock `root` (created if missing) for this job. Raises CheckpointConflictError naming
        the other job when another live job holds it, CheckpointWriteError when `root` cannot
        be a directory (the message says what to do).

        `under_guard()` runs once the lock is taken and before the guard is released: the local
        ranks of one job share the lock, so anything they must not do at the same time (reading
        or minting the run identity in RUN.json) belongs there. Keep it local and short: other
        ranks wait for it on the guard."""
        if root.exists() and not root.is_dir():
            raise CheckpointWriteError(
                f"{root} is a regular file, not a directory, so it cannot hold checkpoints: "
                f"move it away or choose another checkpoint directory",
                path=root,
            )
        try:
            root.mkdir(parents=True, exist_ok=True)
            guard = _open_file(root / _GUARD_FILE)
        except OSError as exc:
            raise CheckpointWriteError(
                f"cannot use {root} as the checkpoint directory: {describe(exc, root)}", path=root
            ) from exc
        try:
            _flock_with_deadline(guard, root)
            fd = _open_file(root / LOCK_FILE)
            try:
                lock = DirectoryLock._take(root, fd, run_name=run_name, job=job)
                if under_guard is not None:
                    under_guard()
                return lock
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            raise CheckpointWriteError(
                f"cannot lock {root / LOCK_FILE}: {describe(exc, root)}", path=root
            ) from exc
        finally:
            os.close(guard)  # releases the guard

    @staticmethod
    def _take(root: Path, fd: int, *, run_name: str, job: str) -> DirectoryLock:
        mine = LockRecord(os.getpid(), socket.gethostname(), run_name, job, now_iso())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = LockRecord.parse(os.pread(fd, 1 << 16, 0))
            if held is None or held.job != job or held.run_name != run_name:
                who = held.describe() if held is not None else "a process whose record is unreadable"
                raise CheckpointConflictError(
                    f"{root} is in use by another live job ({who}); two jobs must not write one "
                    f"checkpoint directory. Use another directory for this run ({run_name!r}), "
                    f"or stop that job first",
                    path=root,
                ) from None
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # same job: share it
            return DirectoryLock(root, fd, held)
        previous = LockRecord.parse(os.pread(fd, 1 << 16, 0))
        if previous is not None and previous.job != job:
            logger.info("%s: taking over the lock of a job that has ended (%s)", root, previous.describe())
        data = mine.to_bytes()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_SH)  # downgrade; safe: contenders wait on the guard
        return DirectoryLock(root, fd, mine)

    def held(self) -> bool:
        """Whether `<root>/LOCK` is still the file this lock holds (not deleted or replaced, e.g. with the whole
        directory while the job ran: then nothing keeps another job out of the directory)."""
        if self._fd is None:
            return False
        try:
            now, mine = os.stat(self.root / LOCK_FILE, follow_symlinks=False), os.fstat(self._fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Release the lock (idempotent); the record stays, stale, for the next job to replace."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _open_file(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EEXIST, "exists and is not a regular file", str(path))
    return fd


def _flock_with_deadline(fd: int, root: Path) -> None:
    deadline = Deadline.after(_GUARD_TIMEOUT_S)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if deadline.expired():
                raise CheckpointTimeoutError(
                    f"{root / _GUARD_FILE} stayed locked for {_GUARD_TIMEOUT_S:.0f}s; is a "
                    f"process hung while opening this checkpoint directory?",
                    path=root,
                ) from None
            time.sleep(0.02)
