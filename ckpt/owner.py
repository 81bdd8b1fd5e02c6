"""The owner record of a shared prefix: one live job per `<url>/<run_name>/`.

Object stores have no locks, so the job that writes a prefix says so in
`<url>/<run_name>/OWNER.json` (job, host, pid, run, start time and a beat counter), refreshed
by rank 0 every `shared.owner_heartbeat`. Clocks of different hosts are never compared: a
record is live while its beat changes. At start every rank reads it:

- none, or one of its own job: go on (rank 0 writes its own);
- another job's, from a pid that no longer exists on this host: stale, taken over;
- another job's whose beat changes within 3 heartbeats: CheckpointConflictError naming it;
- another job's whose beat stands still for 3 heartbeats: stale (the job ended or crashed
  without removing it), taken over with a log line.

A job that closes cleanly removes its record. While a job runs, rank 0's heartbeat also reads
the record: another job's record there means two jobs started at the same moment (or one took
over from a job it wrongly thought dead); the heartbeat then fences this job: its saves raise
CheckpointSaveError, naming the other job, and nothing more is uploaded.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ckpt.errors import CheckpointConflictError, CheckpointError, SharedStorageError
from ckpt.format import dumps, get_int, get_str, loads_object
from ckpt.identity import RunIdentity, job_id, now_iso
from ckpt.shared import SharedTier

logger = logging.getLogger(__name__)

OWNER_FILE = "OWNER.json"
STALE_BEATS = 3


@dataclass(frozen=True)
class OwnerRecord:
    job: str
    host: str
    pid: int
    run_name: str
    started: str
    beat: int = 0

    def to_bytes(self) -> bytes:
        return dumps({**self.__dict__, "format_version": 1, "written": now_iso()})

    @staticmethod
    def parse(data: bytes, *, path: Path) -> OwnerRecord:
        obj = loads_object(data, path=path, what="owner record")
        return OwnerRecord(
            job=get_str(obj, "job", path=path),
            host=get_str(obj, "host", path=path),
            pid=get_int(obj, "pid", path=path),
            run_name=get_str(obj, "run_name", path=path),
            started=get_str(obj, "started", path=path),
            beat=get_int(obj, "beat", path=path),
        )

    def describe(self) -> str:
        return f"job {self.job}, pid {self.pid} on {self.host}, run {self.run_name!r}, since {self.started}"

    def dead_here(self) -> bool:
        """Whether the record's process is known to be gone (it ran on this host)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class SharedOwner:
    """Claims the shared prefix at start and (rank 0) keeps the claim fresh until close()."""

    def __init__(
        self,
        *,
        read: Callable[[], bytes | None],
        write: Callable[[bytes], None],
        remove: Callable[[], None],
        where: str,
        job: str,
        run_name: str,
        interval: float,
        writer: bool,
        stop: threading.Event,
    ) -> None:
        self._read, self._write, self._remove = read, write, remove
        self.where = where
        self.me = OwnerRecord(job, socket.gethostname(), os.getpid(), run_name, now_iso())
        self._interval = interval
        self._writer = writer
        self._stop = stop
        self._thread: threading.Thread | None = None
        self.claimed = False
        self.fence: CheckpointConflictError | None = None
        """Set when another live job was found writing the prefix; saves then stop."""
        self.on_fence: Callable[[CheckpointConflictError], None] | None = None
        """Called with the fence once it is set (the tier stops uploading)."""

    def _current(self) -> OwnerRecord | None:
        data = self._read()
        if data is None:
            return None
        try:
            return OwnerRecord.parse(data, path=Path(self.where))
        except CheckpointError as exc:
            logger.warning("ignoring a damaged owner record: %s", exc)
            return None

    def claim(self) -> None:
        """Check the record (see the module docstring), then (rank 0) write ours and start the
        heartbeat. Raises CheckpointConflictError, or SharedStorageError when unreachable."""
        first = self._current()
        if first is not None and first.job != self.me.job and not first.dead_here():
            self._wait_until_stale(first)
        self.claimed = True
        if self._writer:
            self._write(self.me.to_bytes())
            self._thread = threading.Thread(target=self._beat, name="ckpt-owner", daemon=True)
            self._thread.start()

    def _wait_until_stale(self, first: OwnerRecord) -> None:
        logger.info(
            "%s names another job (%s); checking for %.0fs whether it is alive",
            self.where,
            first.describe(),
            STALE_BEATS * self._interval,
        )
        for _ in range(STALE_BEATS * 4):
            if self._stop.wait(self._interval / 4):
                return
            now = self._current()
            if now is None or now.job == self.me.job:
                return  # released, or taken by our own rank 0
            if now != first:
                raise CheckpointConflictError(
                    f"{self.where}: another live job writes this shared prefix ({now.describe()}); "
                    f"two jobs must not share one shared url and run_name. Give this run another "
                    f"run_name (or shared url), or stop that job first",
                    path=self.where,
                )
        logger.warning("%s: taking over from %s, whose heartbeat stopped", self.where, first.describe())

    def _beat(self) -> None:
        record = self.me
        while not self._stop.wait(self._interval):
            try:
                now = self._current()
                if now is not None and now.job != self.me.job:
                    self.fence = CheckpointConflictError(
                        f"{self.where}: another job took over this shared prefix while this job "
                        f"ran ({now.describe()}); this job stops saving. Give one of the jobs "
                        f"another run_name or shared url",
                        path=self.where,
                    )
                    logger.error("%s", self.fence)
                    if self.on_fence is not None:
                        self.on_fence(self.fence)
                    return
                record = replace(record, beat=record.beat + 1)
                self._write(record.to_bytes())
            except SharedStorageError as exc:
                logger.warning("owner heartbeat of %s failed: %s", self.where, exc)
            except Exception:  # thread boundary: keep beating
                logger.exception("owner heartbeat of %s failed", self.where)

    def close(self) -> None:
        """Stop the heartbeat; rank 0 removes the record if it is still ours."""
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        thread.join(30.0)
        if self.fence is not None:
            return
        try:
            now = self._current()
            if now is not None and now.job == self.me.job and now.pid == self.me.pid:
                self._remove()
        except (SharedStorageError, CheckpointError) as exc:
            logger.warning("could not remove %s: %s", self.where, exc)


def claim_shared_prefix(
    shared: SharedTier, identity: RunIdentity, *, run_name: str, writer: bool, stop: threading.Event
) -> SharedOwner:
    """Claim `shared`'s prefix for this job (OWNER.json) and this run (RUN.json), at start.

    A conflict (another live job) raises CheckpointConflictError. An unreachable store is logged
    and the claim is tried again before the tier's first use (`shared.pending_claim`); a conflict
    found then fences the tier, so saves stop.
    """
    shared.writes_identity = writer
    io = shared.object_io(OWNER_FILE)
    owner = SharedOwner(
        read=io.read,
        write=io.write,
        remove=io.remove,
        where=io.where,
        job=job_id(),
        run_name=run_name,
        interval=shared.config.owner_heartbeat.total_seconds(),
        writer=writer,
        stop=stop,
    )

    def fence(exc: CheckpointConflictError) -> None:
        shared.fence = exc

    owner.on_fence = fence

    def claim() -> None:
        if not owner.claimed:
            try:
                owner.claim()
            except CheckpointConflictError as exc:
                fence(exc)  # found later, from the replicator: saves stop
                raise
        shared.claim_identity(identity)

    shared.pending_claim = claim
    try:
        claim()
    except SharedStorageError as exc:
        logger.warning(
            "shared tier %s not claimed at start (%s); tried again before its first use", shared.url, exc
        )
    return owner
