"""Restore: load a rank directory with checks, zero-copy, and choose which copy to load.

`load_rank_dir` reads a rank's manifest (checked against the COMMIT's sha256 of it, when the
COMMIT has one), maps each data file with a copy-on-write mmap, verifies its size and checksum
over the mapped bytes (in parallel chunks), checks the safetensors header against the manifest,
and returns the state whose tensors view the mapping: no copy is made until the caller copies
(e.g. `load_state_dict`). The mapping stays valid when the file is later deleted.

`ranks_to_try` and the tier order are the restore policy: a rank loads its own part; a rank
that has none (the world grew, or its part lives on another node and not in the shared tier)
loads another rank's part of a replicated (DDP) state: one on this node if there is one (after
a node loss the survivors' local copies are newer than the shared tier), else rank 0's. Each part
is tried in the local tier first, then in the shared one; a damaged copy is logged, naming the
file, and the next copy is tried.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import mmap
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.checksum import digest_parts
from ckpt.commit import CommitMarker
from ckpt.durable import remove_quietly
from ckpt.errors import CheckpointConflictError, CheckpointCorruptError, CheckpointTimeoutError
from ckpt.format import corrupt
from ckpt.layout import MANIFEST_FILE
from ckpt.manifest import FileEntry, Manifest, parse_manifest, resolve_file
from ckpt.safe_io import open_regular, read_regular, with_deadline
from ckpt.safetensors_io import dtype_name, map_tensors
from ckpt.shared import SharedTier
from ckpt.tree import unflatten

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT = 120.0
"""Seconds one read may take (CheckpointConfig.read_timeout)."""


@dataclass(frozen=True)
class Restored:
    """A loaded checkpoint."""

    step: int
    state: dict[str, Any]
    rank: int
    """The rank whose part was loaded."""
    own: bool
    """Whether that is the loading rank's own part (False: rank 0's part of a replicated state;
    per-rank RNG streams should then start fresh)."""
    tier: str
    """"local" or "shared"."""
    path: str
    """The rank directory (or URL) it was loaded from."""
    init_from: bool = False
    """Whether it came from CheckpointConfig.init_from (another run's checkpoint: a new run
    starts from its state) rather than from this run's own checkpoints."""


def ranks_to_try(
    *, rank: int, saved_world_size: int, has_own: bool, replicated: bool, on_this_node: Sequence[int] = ()
) -> list[int]:
    """Whose part `rank` loads from a step saved by `saved_world_size` ranks, in order of preference.

    `on_this_node`: the ranks of that step with a copy in this node's local tier.
    """
    if rank < saved_world_size and has_own:
        return [rank]
    if not replicated:
        return []
    local = sorted(r for r in set(on_this_node) if r < saved_world_size)
    return local + ([0] if 0 not in local else [])


def read_manifest(
    path: Path, *, expected_sha256: str | None, timeout: float = DEFAULT_READ_TIMEOUT
) -> tuple[Manifest, bytes]:
    try:
        data = read_regular(path, timeout=timeout)
    except FileNotFoundError as exc:
        raise corrupt(path, "manifest is missing") from exc
    except OSError as exc:
        raise corrupt(path, f"manifest cannot be read ({exc})") from exc
    check_manifest_digest(data, path=path, expected_sha256=expected_sha256)
    return parse_manifest(data, path=path), data


def check_manifest_digest(data: bytes, *, path: Path, expected_sha256: str | None) -> None:
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise corrupt(
            path,
            "manifest does not match the sha256 its step's COMMIT recorded (replaced after the "
            "commit, or damaged)",
        )


def load_rank_dir(
    rank_dir: Path,
    *,
    step: int,
    rank: int,
    expected_manifest_sha256: str | None = None,
    pool: Executor | None = None,
    run: str | None = None,
    timeout: float = DEFAULT_READ_TIMEOUT,
) -> dict[str, Any]:
    """Load and verify the rank directory `rank_dir` of `step`. Raises CheckpointCorruptError
    (naming the file), CheckpointVersionError, CheckpointTimeoutError (a read passed `timeout`
    s), or CheckpointConflictError when the manifest names a run other than `run`."""
    manifest_path = rank_dir / MANIFEST_FILE
    manifest, _ = read_manifest(
        manifest_path, expected_sha256=expected_manifest_sha256, timeout=timeout
    )
    if (manifest.step, manifest.rank) != (step, rank):
        raise corrupt(
            manifest_path,
            f"manifest describes step {manifest.step} rank {manifest.rank}, "
            f"expected step {step} rank {rank}",
        )
    if run is not None and manifest.run and manifest.run != run:
        raise CheckpointConflictError(
            f"{manifest_path} was written by run {manifest.run!r}, this is run {run!r}; "
            f"not loading it (start from it with init_from)",
            path=manifest_path,
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in manifest.files.items():
        path = resolve_file(rank_dir, name, manifest_path=manifest_path)
        file_tensors = map_verified(path, entry, pool=pool, timeout=timeout)
        expected = {n: t for n, t in manifest.tensors.items() if t.file == name}
        if set(file_tensors) != set(expected):
            raise corrupt(path, f"its tensors differ from those listed in {manifest_path}")
        for tname, tensor in file_tensors.items():
            want = expected[tname]
            if dtype_name(tensor.dtype) != want.dtype or tuple(tensor.shape) != want.shape:
                raise corrupt(
                    path,
                    f"tensor {tname!r} is {tensor.dtype}{list(tensor.shape)}, "
                    f"{manifest_path} says {want.dtype}{list(want.shape)}",
                )
        tensors.update(file_tensors)
    try:
        state = unflatten(manifest.state, tensors)
    except (ValueError, RecursionError) as exc:
        raise corrupt(manifest_path, f"its 'state' cannot be rebuilt: {exc}") from exc
    if not isinstance(state, dict):
        raise corrupt(manifest_path, f"its 'state' is a {type(state).__name__}, not a dict")
    return state


def map_verified(
    path: Path, entry: FileEntry, *, pool: Executor | None, timeout: float = DEFAULT_READ_TIMEOUT
) -> dict[str, torch.Tensor]:
    """Map `path` copy-on-write, check its size and checksum, and return its tensors (zero-copy).

    Only a regular file is opened (a FIFO or device is refused unopened); each checksum chunk
    must be read and hashed within `timeout` s of the previous one."""

    def open_and_map() -> mmap.mmap:
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if size != entry.bytes:
                raise corrupt(
                    path, f"file is {size} bytes, the manifest says {entry.bytes} (truncated?)"
                )
            if size == 0:
                raise corrupt(path, "file is empty")
            return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)

    try:
        mapped = with_deadline(open_and_map, timeout=timeout, what="open", path=path)
    except FileNotFoundError as exc:
        raise corrupt(path, "file listed in the manifest is missing") from exc
    except OSError as exc:
        raise corrupt(path, f"file cannot be read ({exc})") from exc
    view = memoryview(mapped)

    def digest() -> str:
        return digest_parts(
            [view],
            algorithm=entry.algorithm,
            chunk_bytes=entry.chunk_bytes,
            pool=pool,
            chunk_timeout=timeout,
        ).digest

    try:
        if pool is None or entry.chunk_bytes == 0 or len(view) <= entry.chunk_bytes:
            found = with_deadline(digest, timeout=timeout, what="checksum", path=path)
        else:
            found = digest()
    except concurrent.futures.TimeoutError as exc:
        raise CheckpointTimeoutError(
            f"reading {path} for its checksum made no progress within {timeout:.0f}s (a hung "
            f"disk or mount?); this copy is skipped",
            path=path,
        ) from exc
    except OSError as exc:
        raise corrupt(path, f"file cannot be read ({exc})") from exc
    finally:
        view.release()
    if found != entry.digest:
        raise corrupt(
            path,
            f"{entry.checksum.describe()} does not match the manifest (bit rot or a partial write)",
        )
    return map_tensors(mapped, path=path)


FETCH_PREFIX = ".tmp-fetch-"
"""Scratch directories (under the tier-1 root) that hold a download while it is verified."""


def load_from_tier(
    tier: SharedTier,
    step: int,
    rank: int,
    marker: CommitMarker,
    *,
    own_rank: int,
    fetch_root: Path,
    pool: Executor | None,
    run: str | None,
    timeout: float = DEFAULT_READ_TIMEOUT,
    init_from: bool = False,
) -> Restored:
    """Load rank `rank` of committed `step` from a shared tier (or an init_from source): in
    place on a mounted path, else downloaded into a scratch directory under `fetch_root`."""
    expected = None if marker.manifests is None else marker.manifests.get(rank)
    where = tier.describe(tier.rank_path(step, rank))
    own = rank == own_rank

    def load(rank_dir: Path) -> dict[str, Any]:
        return load_rank_dir(
            rank_dir,
            step=step,
            rank=rank,
            expected_manifest_sha256=expected,
            pool=pool,
            run=run,
            timeout=timeout,
        )

    if tier.is_local:
        state = load(tier.local_path(step, rank, MANIFEST_FILE).parent)
        return Restored(step, state, rank, own, "shared", where, init_from)
    data = tier.read_file(step, rank, MANIFEST_FILE)
    manifest_url = Path(f"{where}/{MANIFEST_FILE}")
    if data is None:
        raise CheckpointCorruptError(
            f"{manifest_url}: manifest is missing although step {step} is committed; "
            f"restore an earlier step",
            path=manifest_url,
        )
    check_manifest_digest(data, path=manifest_url, expected_sha256=expected)
    manifest = parse_manifest(data, path=manifest_url)
    fetch_root.mkdir(parents=True, exist_ok=True)
    fetch = fetch_root / f"{FETCH_PREFIX}{uuid.uuid4().hex}"
    fetch.mkdir()
    try:
        (fetch / MANIFEST_FILE).write_bytes(data)
        for name in manifest.files:
            if "/" in name or name in ("", ".", "..", MANIFEST_FILE):
                continue  # load_rank_dir rejects it, naming the manifest
            tier.download(step, rank, name, fetch / name)
        logger.info("downloaded rank %d of step %d from %s", rank, step, where)
        state = load(fetch)
    finally:
        remove_quietly(fetch)  # the loaded tensors keep their mappings
    return Restored(step, state, rank, own, "shared", where, init_from)
