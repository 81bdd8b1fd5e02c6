"""Tier 2: the shared store (any fsspec URL) and its layout, with bounded retries on every call.

    <url>/<run_name>/step_000000000120/rank_00000/state.safetensors
    <url>/<run_name>/step_000000000120/rank_00000/manifest.json
    <url>/<run_name>/step_000000000120/rank_00000.done     per-rank marker, after its files
    <url>/<run_name>/step_000000000120/COMMIT              written last, by rank 0
    <url>/<run_name>/RUN.json                              the run's uid (ckpt/identity.py)
    <url>/<run_name>/OWNER.json                            the live job (ckpt/owner.py)

Commit protocol (no collectives; the store is the only channel between ranks):
1. each rank uploads its data files, then its manifest.json, then its `rank_XXXXX.done` marker
   (run, generation, world size, sha256 of the manifest);
2. rank 0 polls the step directory, with a deadline, until it holds a marker of the same run,
   generation and world size for every rank, then writes COMMIT (listing each rank's manifest
   sha256);
3. readers consider a step only if COMMIT exists and names their run (name and uid, when it
   names them), and check every manifest they load against it. A partial upload is therefore never read.

Small objects are written atomically: by temp file + rename on a mounted path, and by a single
PUT (which S3 and GCS make visible whole) on object stores.

`SharedTier` offers the tier interface of ckpt/tiers.py (as `LocalTier` does for tier 1), used by
the restore policy (ckpt/restore.py); uploads and tier-2 commits are the Replicator's
(ckpt/replicator.py); the retries, ckpt/retry.py's; the rank marker, ckpt/commit.py's.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from ckpt.commit import CommitMarker, RankMarker, parse_commit, parse_marker
from ckpt.config import SharedConfig
from ckpt.durable import copy_atomic, remove_quietly, write_atomic
from ckpt.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointVersionError,
    SharedStorageError,
)
from ckpt.helper import HelperClient, HelperError, HelperRequestFailed
from ckpt.identity import RUN_FILE, RunIdentity, foreign
from ckpt.layout import (
    COMMIT_FILE,
    FETCH_PREFIX,
    MANIFEST_FILE,
    parse_step_dir_name,
    rank_dir_name,
    step_dir_name,
)
from ckpt.manifest import Manifest, check_file_name, parse_manifest
from ckpt.ranges import LocalRange, RangeSource, RemoteRange
from ckpt.reader import check_manifest_digest
from ckpt.retry import call_with_retries
from ckpt.safe_io import read_regular
from ckpt.tiers import TierName, holds_rank

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MARKER_RE = re.compile(r"rank_(\d{5,})\.done")


def put_file(fs: AbstractFileSystem, local: Path, path: str, *, describe: Callable[[str], str] = str) -> None:
    """Put the file `local` at `path` of `fs` (a local file system: written and fsynced) and check its size
    there. The worker's replicator (SharedTier) and the node's helper process both upload with it."""
    size = local.stat().st_size
    if isinstance(fs, LocalFileSystem):
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a helper that answered too late may still write the same file (worker and helper
        # both upload it then); renamed over, never written in place, a reader never sees it half-written.
        copy_atomic(local, target)
    else:
        fs.put_file(str(local), path)
    found = fs.size(path)
    if found != size:
        raise OSError(f"{describe(path)} is {found} bytes after upload, expected {size}")


def upload_timeout(nbytes: int) -> float:
    """Seconds the node's helper gets for one file's upload before the worker uploads it itself: 2 minutes, and
    more for a file that takes longer at 20 MiB/s."""
    return max(120.0, nbytes / (20 << 20))


def _as_json(options: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        return json.loads(json.dumps(dict(options)))
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ObjectIO:
    """The calls on one small object of the prefix, and its URL (for messages)."""

    read: Callable[[], bytes | None]
    write: Callable[[bytes], None]
    remove: Callable[[], None]
    where: str


class SharedTier:
    """One run's directory in the shared store. Every call retries (bounded) and raises
    SharedStorageError once its retries are spent; FileNotFoundError means "not there"."""

    def __init__(
        self,
        config: SharedConfig,
        *,
        stop: threading.Event | None = None,
        root_url: str | None = None,
        read_timeout: float = 120.0,
        scratch: Path | None = None,
    ) -> None:
        """`root_url`: read the checkpoints right under this URL instead of <url>/<run_name>
        (another run's, for init_from; its COMMITs may name any run). `scratch`: the directory
        (the tier-1 root) where a rank's files are downloaded to be verified and loaded."""
        self.name: TierName = "shared"
        self.unreadable: set[int] = set()
        """Steps whose copy here failed verification at restore (shared retention drops them)."""
        self.config = config
        self.scratch = scratch
        self.run_name = config.run
        self.identity: RunIdentity | None = None
        """This run's identity in the shared tier, once claimed (see claim_identity)."""
        self.writes_identity = True
        """Whether this rank may write RUN.json (rank 0 only, see claim_identity)."""
        self.any_run = root_url is not None
        self.fence: CheckpointConflictError | None = None
        """Set when another live job writes the prefix (ckpt/owner.py): nothing more is uploaded."""
        self._read_timeout = read_timeout
        self._warned: set[int] = set()
        self.foreign_steps: set[int] = set()
        """Steps committed by another run, found by the last committed(); never deleted here."""
        self.pending_claim: Callable[[], None] | None = None
        """Claims the identity (and ownership) when the store was unreachable at start."""
        url = config.url if root_url is None else root_url
        try:
            fs, base = fsspec.core.url_to_fs(url, **config.storage_options)
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(
                f"{'init_from' if root_url else 'shared.url'} {url!r} cannot be opened with fsspec "
                f"({exc}); install the file system's package (s3fs for s3://) and check "
                f"the storage options"
            ) from exc
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        if root_url is None and self.is_local and os.path.exists(base) and not os.path.isdir(base):
            # Not transient: every upload would fail and be retried for the whole run, and close wait for them.
            raise ValueError(f"shared.url {url!r} is a file, not a directory; point it at a directory (or a bucket)")
        if root_url is None:
            self.root = posixpath.join(base.rstrip("/") or "/", self.run_name)
            self.url = f"{url.rstrip('/')}/{self.run_name}"
        else:
            self.root = base.rstrip("/") or "/"
            self.url = url.rstrip("/")
        self._stop = stop or threading.Event()
        self.helper: HelperClient | None = None
        """The node's checkpoint helper, when it runs: it uploads the files (ckpt/helper.py, "upload")."""
        self._helper_options = _as_json(config.storage_options)
        """The storage options as the helper gets them (None: not JSON, e.g. a credentials object: no helper)."""

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

    def call(self, what: str, fn: Callable[..., T], *args: Any, bounded: bool = True, **kwargs: Any) -> T:
        """Run `fn` with bounded retries (ckpt/retry.py); raise SharedStorageError once they are spent.
        `bounded`=False for a whole file's transfer: its one try is not cut at the deadline."""
        return call_with_retries(what, self.url, self.config.retry, self._stop, fn, *args, bounded=bounded, **kwargs)

    # -- primitives ----------------------------------------------------------------------

    def _inside(self, path: str) -> None:
        """On a mounted path, refuse a path that leads out of the run's prefix (a symbolic link in its tree, e.g.
        a step directory): reads took another tree's files for this run's, and retention removed files there.
        Tier 1 refuses such links too (ckpt/layout.py, is_real_dir). Object stores have no links."""
        if not self.is_local or self.any_run:  # an init_from source: read only, and a curated tree of links is fine
            return
        root, real = Path(self.root).resolve(), Path(path).resolve()
        if real != root and root not in real.parents:
            raise CheckpointCorruptError(
                f"{path} leads out of {self.root} (to {real}: a symbolic link in the tree?); not following it. "
                "Remove the link, or move what it points to back in its place", path=Path(path))

    def _put_bytes(self, path: str, data: bytes) -> None:
        if self.is_local:
            self._inside(path)
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, data)
        else:
            try:
                self.fs.pipe_file(path, data)
            except FileNotFoundError as exc:  # a write: what is missing is the bucket (or container) itself
                raise SharedStorageError(
                    f"{self.describe(path)}: the store says it does not exist ({exc}): create the bucket, or fix "
                    "shared.url") from exc

    def _cat(self, path: str) -> bytes | None:
        try:
            if self.is_local:  # a FIFO or device there must not block us (ckpt/safe_io.py)
                self._inside(path)
                return read_regular(Path(path), timeout=self._read_timeout)
            return self.fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _put_file(self, local: Path, path: str, step: int) -> None:
        self._inside(path)
        helper, failed = self.helper, None
        if helper is not None and self._helper_options is not None and helper.available():
            try:  # the bytes move in the node's helper process, not beside the training thread
                helper.upload(local=local, url=self.config.url, storage_options=self._helper_options, path=path,
                              step=step, timeout=upload_timeout(local.stat().st_size))
                return
            except HelperRequestFailed as exc:
                failed = exc  # it tried: this thread tries too, and whether that works tells the two apart
            except HelperError:
                pass  # the helper is gone or hangs: this thread uploads, as without one (it logged why)
        try:
            put_file(self.fs, local, path, describe=self.describe)
        except FileNotFoundError as exc:
            if not local.is_file():
                raise  # the local copy is gone: nothing to upload (the replicator gives this step up)
            raise SharedStorageError(
                f"{self.describe(path)}: the store says it does not exist ({exc}): was the bucket deleted? Create "
                "it again, or fix shared.url; the upload is tried again") from exc
        if failed is not None:
            logger.warning("the node's checkpoint helper could not upload %s (%s) but this worker could: this worker "
                           "uploads tier 2 itself from now on (does the agent's environment lack the store's "
                           "credentials?)", self.describe(path), failed)
            self._helper_options = None

    def _ls(self, path: str) -> list[str]:
        self._inside(path)
        if not self.is_local:
            self.fs.invalidate_cache(path)
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def _rm(self, path: str) -> None:
        self._inside(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    # -- operations ----------------------------------------------------------------------

    def upload_file(self, local: Path, step: int, rank: int, name: str) -> None:
        path = f"{self.rank_path(step, rank)}/{name}"
        self.call(f"upload of {local} to {self.describe(path)}", self._put_file, local, path, step, bounded=False)

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
        # Unbounded: a removal left running past its deadline could land after the step is committed again.
        self.call(f"removal of {self.describe(path)}", self._rm, path, bounded=False)

    def steps(self) -> list[int]:
        """Every step directory of this run, committed or not."""
        names = self.call(f"listing of {self.url}", self._ls, self.root)
        return sorted(s for n in names if (s := parse_step_dir_name(n)) is not None)

    # -- identity ------------------------------------------------------------------------

    def read_identity(self) -> RunIdentity | None:
        """The run identity in <prefix>/RUN.json, None if there is none (damaged: logged)."""
        path = f"{self.root}/{RUN_FILE}"
        data = self.call(f"read of {self.describe(path)}", self._cat, path)
        if data is None:
            return None
        try:
            return RunIdentity.parse(data, path=Path(self.describe(path)))
        except CheckpointCorruptError as exc:
            logger.warning("ignoring %s", exc)
            return None

    def claim_identity(self, candidate: RunIdentity) -> RunIdentity | None:
        """This run's identity here: the one in RUN.json, else (rank 0, `writes_identity`)
        `candidate`, written there.

        Only one rank writes: when every rank wrote its own node's uid, the last write won while
        rank 0, which commits, could have read back another, and its COMMITs then named a uid
        RUN.json did not hold (every later restore ignored them). The other ranks read; until
        rank 0 wrote, their identity here is None (COMMITs are then checked by run name only,
        and it is read again at each use, see ensure_identity).
        """
        found = self.read_identity()
        if (found is None or found.name != self.run_name) and self.writes_identity:
            path = f"{self.root}/{RUN_FILE}"
            self.call(f"write of {self.describe(path)}", self._put_bytes, path, candidate.to_bytes())
            found = candidate
        elif found is not None and found.name != self.run_name:
            found = None
        if found is not None and found.uid != candidate.uid:
            logger.info(
                "run %r has uid %s in %s and %s in its tier-1 directory (minted apart); each "
                "tier checks its own",
                self.run_name,
                found.uid,
                self.url,
                candidate.uid,
            )
        self.identity = found
        return found

    def ensure_identity(self) -> None:
        """Claim the run identity now if that could not be done at start; raises
        SharedStorageError while the store stays unreachable (rank 0: while it is not written)."""
        if self.identity is not None or self.any_run:
            return
        if self.pending_claim is not None:
            self.pending_claim()
        if self.identity is None and self.writes_identity:
            raise SharedStorageError(
                f"the run identity in {self.url} is not known yet (the store was unreachable); "
                f"the shared tier is used once it is"
            )

    def object_io(self, name: str) -> ObjectIO:
        """Read, write and remove <prefix>/`name` (with retries), e.g. OWNER.json (ckpt/owner.py)."""
        path = f"{self.root}/{name}"
        where = self.describe(path)
        return ObjectIO(
            read=lambda: self.call(f"read of {where}", self._cat, path),
            write=lambda data: self.call(f"write of {where}", self._put_bytes, path, data),
            remove=lambda: self.call(f"removal of {where}", self._rm, path),
            where=where,
        )

    def committed(self, steps: list[int] | None = None) -> dict[int, CommitMarker]:
        """The committed steps of this run (of `steps`, default all) with their markers.

        Steps committed by another run (a step directory copied in) are logged and left out;
        so is everything while the run's identity here is unknown (store unreachable at start).
        """
        self.ensure_identity()
        found = {}
        foreign_steps = set()
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
            other = None if self.any_run else foreign(marker, self.identity, name=self.run_name)
            if other is not None:
                assert self.identity is not None
                foreign_steps.add(step)
                if step in self._warned:
                    continue
                self._warned.add(step)
                logger.warning(
                    "ignoring %s: it was committed by %s, not by this run %s",
                    self.describe(self.commit_path(step)),
                    other,
                    self.identity.describe(),
                )
                continue
            found[step] = marker
        if steps is None:
            self.foreign_steps = foreign_steps
        else:
            self.foreign_steps |= foreign_steps
        return found

    def delete_step(self, step: int) -> None:
        """Delete a step: its COMMIT first, so it vanishes for readers before its files do."""
        self.uncommit(step)
        path = self.step_path(step)
        self.call(f"removal of {self.describe(path)}", self._rm, path, bounded=False)

    # -- reading a rank (the Tier interface, ckpt/tiers.py) ---------------------------

    def has_rank(self, step: int, rank: int, marker: CommitMarker) -> bool:
        return holds_rank(marker, rank)  # not listed: the COMMIT says which ranks uploaded

    def ranks_here(self, step: int, marker: CommitMarker) -> list[int]:
        return []  # nothing of the shared store lies on this node alone

    def describe_rank(self, step: int, rank: int) -> str:
        return self.describe(self.rank_path(step, rank))

    @contextmanager
    def open_rank(self, step: int, rank: int, *, expected_manifest_sha256: str | None) -> Iterator[Path]:
        """The rank directory in place on a mounted path; else its manifest is read and checked
        against the COMMIT, then its files are downloaded into a scratch directory under
        `scratch`, removed when the context closes (loaded tensors keep their mappings)."""
        if self.is_local:
            self._inside(self.rank_path(step, rank))
            yield Path(self.rank_path(step, rank))
            return
        data, manifest = self._manifest(step, rank, expected_manifest_sha256)
        where = self.describe_rank(step, rank)
        assert self.scratch is not None, "a SharedTier that downloads needs a scratch directory"
        self.scratch.mkdir(parents=True, exist_ok=True)
        fetch = self.scratch / f"{FETCH_PREFIX}{uuid.uuid4().hex}"
        fetch.mkdir()
        try:
            (fetch / MANIFEST_FILE).write_bytes(data)
            for name in manifest.files:
                if "/" in name or name in ("", ".", "..", MANIFEST_FILE):
                    continue  # the reader rejects it, naming the manifest
                source = f"{self.rank_path(step, rank)}/{name}"
                try:
                    self.call(f"download of {self.describe(source)}", self.fs.get_file, source, str(fetch / name),
                              bounded=False)
                except FileNotFoundError as exc:  # the store answered: the file is not there (damage, not outage)
                    raise CheckpointCorruptError(
                        f"{self.describe(source)}: missing although step {step} is committed; restore an earlier "
                        "step", path=Path(self.describe(source))) from exc
            logger.info("downloaded rank %d of step %d from %s", rank, step, where)
            yield fetch
        finally:
            remove_quietly(fetch)

    def _manifest(self, step: int, rank: int, expected_sha256: str | None) -> tuple[bytes, Manifest]:
        path = f"{self.rank_path(step, rank)}/{MANIFEST_FILE}"
        data = self.call(f"read of {self.describe(path)}", self._cat, path)
        manifest_url = Path(self.describe(path))
        if data is None:
            raise CheckpointCorruptError(
                f"{manifest_url}: manifest is missing although step {step} is committed; "
                f"restore an earlier step",
                path=manifest_url,
            )
        check_manifest_digest(data, path=manifest_url, expected_sha256=expected_sha256)
        return data, parse_manifest(data, path=manifest_url)

    def read_manifest(self, step: int, rank: int, *, expected_sha256: str | None) -> Manifest:
        return self._manifest(step, rank, expected_sha256)[1]

    def range_source(self, step: int, rank: int, name: str) -> RangeSource:
        path = f"{self.rank_path(step, rank)}/{name}"
        check_file_name(name, path=Path(self.describe(f"{self.rank_path(step, rank)}/{MANIFEST_FILE}")))
        if self.is_local:
            self._inside(path)
            return LocalRange(Path(path), timeout=self._read_timeout)
        what = f"range read of {self.describe(path)}"
        return RemoteRange(
            lambda start, end: self.call(what, self.fs.cat_file, path, start=start, end=end),
            where=Path(self.describe(path)),
            timeout=self.config.retry.deadline.total_seconds() + self._read_timeout,
        )

    def sweep_temp(self, committed: Collection[int]) -> None:
        """Nothing to sweep: objects are written whole by one PUT, and the temp file of a write on
        a mounted path is removed by that write. Downloads are swept with tier 1's scratch."""
