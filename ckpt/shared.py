"""Tier 2: the shared store (any fsspec URL) and its layout, with bounded retries on every call.

    <url>/<run_name>/step_000000000120/rank_00000/state.safetensors
    <url>/<run_name>/step_000000000120/rank_00000/manifest.json
    <url>/<run_name>/step_000000000120/rank_00000.done     per-rank marker, after its files
    <url>/<run_name>/step_000000000120/COMMIT              written last, by rank 0

Commit protocol (no collectives; the store is the only channel between ranks):
1. each rank uploads its data files, then its manifest.json, then its `rank_XXXXX.done` marker
   (run, generation, world size, sha256 of the manifest);
2. rank 0 polls the step directory, with a deadline, until it holds a marker of the same run,
   generation and world size for every rank, then writes COMMIT (listing each rank's manifest
   sha256);
3. readers consider a step only if COMMIT exists and names their run, and check every manifest
   they load against it. A partial upload is therefore never read.

Small objects are written atomically: by temp file + rename on a mounted path, and by a single
PUT (which S3 and GCS make visible whole) on object stores.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from ckpt.commit import CommitMarker, parse_commit
from ckpt.config import RetryConfig, SharedConfig
from ckpt.durable import fsync_dir
from ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointVersionError,
    SharedStorageError,
)
from ckpt.format import (
    FORMAT_VERSION,
    check_format_version,
    corrupt,
    dumps,
    get_int,
    get_str,
    loads_object,
)
from ckpt.layout import COMMIT_FILE, parse_step_dir_name, rank_dir_name, step_dir_name, temp_name

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MARKER_RE = re.compile(r"rank_(\d{5,})\.done")

_PERMANENT = (
    CheckpointError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    TypeError,
    ValueError,
)


@dataclass(frozen=True)
class RankMarker:
    """`rank_XXXXX.done`: rank `rank` finished uploading its files of `step`."""

    step: int
    rank: int
    world_size: int
    run: str
    generation: str
    manifest_sha256: str
    bytes: int

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "run": self.run,
                "generation": self.generation,
                "manifest_sha256": self.manifest_sha256,
                "bytes": self.bytes,
            }
        )


def parse_marker(data: bytes, *, path: Path) -> RankMarker:
    obj = loads_object(data, path=path, what="rank marker")
    check_format_version(obj, path=path)
    world_size = get_int(obj, "world_size", path=path, minimum=1)
    rank = get_int(obj, "rank", path=path)
    if rank >= world_size:
        raise corrupt(path, f"rank {rank} is not below world_size {world_size}")
    sha = get_str(obj, "manifest_sha256", path=path)
    if not _SHA256_RE.fullmatch(sha):
        raise corrupt(path, f"manifest_sha256 {sha!r} is not a sha256")
    return RankMarker(
        step=get_int(obj, "step", path=path),
        rank=rank,
        world_size=world_size,
        run=get_str(obj, "run", path=path),
        generation=get_str(obj, "generation", path=path),
        manifest_sha256=sha,
        bytes=get_int(obj, "bytes", path=path),
    )


def _transient(exc: BaseException) -> bool:
    return not isinstance(exc, _PERMANENT)


class SharedTier:
    """One run's directory in the shared store. Every call retries (bounded) and raises
    SharedStorageError once its retries are spent; FileNotFoundError means "not there"."""

    def __init__(self, config: SharedConfig, *, stop: threading.Event | None = None) -> None:
        self.config = config
        self.run_name = config.run_name
        try:
            fs, base = fsspec.core.url_to_fs(config.url, **config.storage_options)
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(
                f"shared.url {config.url!r} cannot be opened with fsspec ({exc}); install the "
                f"file system's package (s3fs for s3://) and check shared.storage_options"
            ) from exc
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root = posixpath.join(base.rstrip("/") or "/", config.run_name)
        self.url = f"{config.url.rstrip('/')}/{config.run_name}"
        self._stop = stop or threading.Event()

    # -- paths ---------------------------------------------------------------------------

    def step_path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def rank_path(self, step: int, rank: int) -> str:
        return f"{self.step_path(step)}/{rank_dir_name(rank)}"

    def marker_path(self, step: int, rank: int) -> str:
        return f"{self.step_path(step)}/{rank_dir_name(rank)}.done"

    def commit_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{COMMIT_FILE}"

    def describe(self, path: str) -> str:
        """`path` as a URL for messages."""
        return self.url + path[len(self.root) :] if path.startswith(self.root) else path

    # -- retries -------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` with bounded retries; raise SharedStorageError once they are spent."""
        retry: RetryConfig = self.config.retry
        retrying = Retrying(
            stop=(
                stop_after_attempt(retry.attempts)
                | stop_after_delay(retry.deadline.total_seconds())
                | (lambda _state: self._stop.is_set())
            ),
            wait=wait_exponential(
                multiplier=retry.initial.total_seconds(), max=retry.maximum.total_seconds()
            )
            + wait_random(0, retry.jitter.total_seconds()),
            retry=retry_if_exception(_transient),
            sleep=self._sleep,
            before_sleep=lambda state: _log_retry(what, self.url, state),
            reraise=True,
        )
        try:
            return retrying(fn, *args, **kwargs)
        except (CheckpointError, FileNotFoundError):
            raise
        except Exception as exc:
            raise SharedStorageError(
                f"{what} at {self.url} failed ({type(exc).__name__}: {exc}); retried up to "
                f"{retry.attempts} times within {retry.deadline}. Training goes on and the upload "
                f"is tried again later; check that the store is reachable and the credentials "
                f"in shared.storage_options",
            ) from exc

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    # -- primitives ----------------------------------------------------------------------

    def _put_bytes(self, path: str, data: bytes) -> None:
        if self.is_local:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(temp_name(target.name))
            try:
                with open(tmp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(target.parent)
        else:
            self.fs.pipe_file(path, data)

    def _cat(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _put_file(self, local: Path, path: str) -> None:
        size = local.stat().st_size
        if self.is_local:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(local, "rb") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            fsync_dir(target.parent)
        else:
            self.fs.put_file(str(local), path)
        found = self.fs.size(path)
        if found != size:
            raise OSError(f"{self.describe(path)} is {found} bytes after upload, expected {size}")

    def _ls(self, path: str) -> list[str]:
        if not self.is_local:
            self.fs.invalidate_cache(path)
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def _rm(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    # -- operations ----------------------------------------------------------------------

    def upload_file(self, local: Path, step: int, rank: int, name: str) -> None:
        path = f"{self.rank_path(step, rank)}/{name}"
        self.call(f"upload of {local} to {self.describe(path)}", self._put_file, local, path)

    def write_marker(self, marker: RankMarker) -> None:
        path = self.marker_path(marker.step, marker.rank)
        self.call(f"write of {self.describe(path)}", self._put_bytes, path, marker.to_bytes())

    def read_markers(self, step: int) -> dict[int, RankMarker]:
        """The valid rank markers of `step` (damaged ones are logged and skipped)."""
        step_path = self.step_path(step)
        names = self.call(f"listing of {self.describe(step_path)}", self._ls, step_path)
        markers = {}
        for name in names:
            if _MARKER_RE.fullmatch(name) is None:
                continue
            path = f"{step_path}/{name}"
            data = self.call(f"read of {self.describe(path)}", self._cat, path)
            if data is None:
                continue
            try:
                marker = parse_marker(data, path=Path(self.describe(path)))
            except CheckpointCorruptError as exc:
                logger.warning("ignoring %s", exc)
                continue
            markers[marker.rank] = marker
        return markers

    def read_commit(self, step: int) -> CommitMarker | None:
        """The COMMIT of `step`, None if there is none. Raises CheckpointCorruptError/VersionError."""
        path = self.commit_path(step)
        data = self.call(f"read of {self.describe(path)}", self._cat, path)
        if data is None:
            return None
        return parse_commit(data, path=Path(self.describe(path)), step=step)

    def write_commit(self, marker: CommitMarker) -> None:
        path = self.commit_path(marker.step)
        self.call(f"write of {self.describe(path)}", self._put_bytes, path, marker.to_bytes())

    def uncommit(self, step: int) -> None:
        path = self.commit_path(step)
        self.call(f"removal of {self.describe(path)}", self._rm, path)

    def steps(self) -> list[int]:
        """Every step directory of this run, committed or not."""
        names = self.call(f"listing of {self.url}", self._ls, self.root)
        return sorted(s for n in names if (s := parse_step_dir_name(n)) is not None)

    def committed(self, steps: list[int] | None = None) -> dict[int, CommitMarker]:
        """The committed steps of this run (of `steps`, default all) with their markers."""
        found = {}
        for step in self.steps() if steps is None else steps:
            try:
                marker = self.read_commit(step)
            except CheckpointVersionError as exc:
                logger.error("ignoring shared step %d: %s", step, exc)
                continue
            except CheckpointCorruptError as exc:
                logger.warning("ignoring shared step %d: %s", step, exc)
                continue
            if marker is None:
                continue
            if marker.run and marker.run != self.run_name:
                logger.warning(
                    "ignoring %s: it was committed by run %r, not %r",
                    self.describe(self.commit_path(step)),
                    marker.run,
                    self.run_name,
                )
                continue
            found[step] = marker
        return found

    def delete_step(self, step: int) -> None:
        """Delete a step: its COMMIT first, so it vanishes for readers before its files do."""
        self.uncommit(step)
        path = self.step_path(step)
        self.call(f"removal of {self.describe(path)}", self._rm, path)

    def read_file(self, step: int, rank: int, name: str) -> bytes | None:
        path = f"{self.rank_path(step, rank)}/{name}"
        return self.call(f"read of {self.describe(path)}", self._cat, path)

    def local_path(self, step: int, rank: int, name: str) -> Path:
        """Where a file lies on a mounted shared path (is_local only)."""
        assert self.is_local
        return Path(f"{self.rank_path(step, rank)}/{name}")

    def download(self, step: int, rank: int, name: str, dest: Path) -> None:
        path = f"{self.rank_path(step, rank)}/{name}"
        self.call(f"download of {self.describe(path)}", self.fs.get_file, path, str(dest))


def _log_retry(what: str, url: str, state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    logger.warning(
        "%s at %s failed (try %d: %s: %s); retrying in %.2fs",
        what,
        url,
        state.attempt_number,
        type(exc).__name__,
        exc,
        wait,
    )
