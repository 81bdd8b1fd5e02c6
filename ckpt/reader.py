"""Verified reading of one rank directory: checked, zero-copy.

`load_rank_dir` reads a rank's manifest (checked against the COMMIT's sha256 of it, when the
COMMIT has one), maps each data file with a copy-on-write mmap, verifies its size and checksum
over the mapped bytes (in parallel chunks), checks the safetensors header against the manifest,
and returns the state whose tensors view the mapping: no copy is made until the caller copies
(e.g. `load_state_dict`). The mapping stays valid when the file is later deleted.

Which rank directory to read, from which tier, is decided in ckpt/restore.py.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import mmap
import os
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from ckpt.checksum import digest_parts
from ckpt.errors import CheckpointConflictError, CheckpointTimeoutError
from ckpt.format import corrupt
from ckpt.layout import MANIFEST_FILE
from ckpt.manifest import FileEntry, Manifest, parse_manifest, resolve_file
from ckpt.safe_io import open_regular, read_regular, with_deadline
from ckpt.safetensors_io import dtype_name, map_tensors
from ckpt.tree import unflatten

DEFAULT_READ_TIMEOUT = 120.0
"""Seconds one read may take (CheckpointConfig.read_timeout)."""


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
