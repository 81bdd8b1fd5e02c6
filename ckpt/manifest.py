"""The per-rank manifest.json: what a rank wrote, with checksums and the state skeleton."""

from __future__ import annotations

import base64
import binascii
import builtins
import functools
import hashlib
import importlib.metadata
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.checksum import DIGEST_BYTES, READ_ALGORITHMS, Checksum
from ckpt.format import (
    INT64_MAX,
    MANIFEST_VERSION,
    check_format_version,
    corrupt,
    dumps,
    get_int,
    get_object,
    get_optional_strs,
    get_str,
    is_shape,
    loads_object,
)
from ckpt.sharding import ShardInfo, parse_shard_info

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MIN_CHUNK_BYTES = 1 << 12
_MAX_CHUNK_BYTES = 1 << 30
"""The chunk sizes a manifest may give (the writers use 64 KiB and 64 MiB): a reader holds one chunk, and
verifies each with a digest of its own, so a crafted 1-byte or 1-TiB chunk would cost memory without bound."""


@functools.cache
def package_version() -> str:
    """The installed elastic-train version, or "0.0.0" when running from a bare checkout."""
    try:
        return importlib.metadata.version("elastic-train")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True)
class FileEntry:
    """Size and checksum of one data file of a rank.

    `FileEntry(hex, n)` is a format-1 whole-file sha256; the writer records chunked checksums
    (`algorithm`, `chunk_bytes` > 0), see ckpt/checksum.py.
    """

    digest: str
    bytes: int
    algorithm: str = "sha256"
    chunk_bytes: int = 0
    chunk_digests: builtins.bytes = b""
    """The chunk digests in order (sharded states, format 3): their sha256 is `digest`, and they let
    a range read be verified chunk by chunk without reading the whole file (ckpt/ranges.py)."""

    @property
    def checksum(self) -> Checksum:
        return Checksum(self.algorithm, self.chunk_bytes, self.digest)

    @staticmethod
    def of(checksum: Checksum, nbytes: int, chunk_digests: builtins.bytes = b"") -> FileEntry:
        return FileEntry(checksum.digest, nbytes, checksum.algorithm, checksum.chunk_bytes, chunk_digests)

    def to_json(self) -> dict[str, Any]:
        if self.checksum.legacy:
            return {"sha256": self.digest, "bytes": self.bytes}
        checksum: dict[str, Any] = {
            "algorithm": self.algorithm,
            "chunk_bytes": self.chunk_bytes,
            "digest": self.digest,
        }
        if self.chunk_digests:
            checksum["chunks"] = base64.b64encode(self.chunk_digests).decode("ascii")
        return {"bytes": self.bytes, "checksum": checksum}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives and what it is."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None
    """Where its bytes start in the file (format 3, sharded states: read by range)."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything needed to check and rebuild one rank's state of one step."""

    step: int
    rank: int
    world_size: int
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    state: Any
    generation: str = ""
    """Which incarnation of the job wrote it (see Checkpointer); "" when unknown."""
    run: str = ""
    """The run name that wrote it (ckpt/identity.py); "" in manifests that predate run identity."""
    run_uid: str = ""
    """The run's uid in the tier-1 directory it was written to; "" when unknown."""
    shards: dict[str, ShardInfo] = field(default_factory=dict)
    """The DTensor leaves (ckpt/sharding.py), by tensor name; a leaf whose piece this rank wrote is
    also in `tensors` under the same name."""
    format_version: int = 1
    package_version: str = field(default_factory=package_version)

    def to_bytes(self) -> bytes:
        needed = 1 if all(f.checksum.legacy for f in self.files.values()) else 2
        if self.shards or any(f.chunk_digests for f in self.files.values()):
            needed = 3
        obj: dict[str, Any] = {
            "format_version": max(self.format_version, needed),
            "package_version": self.package_version,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
        }
        if self.generation:
            obj["generation"] = self.generation
        if self.run:
            obj["run"] = self.run
        if self.run_uid:
            obj["run_uid"] = self.run_uid
        obj["files"] = {name: f.to_json() for name, f in self.files.items()}
        head = dumps(obj)[:-1]  # the same bytes as dumping the whole object at once, spliced
        shards = b',"shards":' + dumps({n: s.to_json() for n, s in self.shards.items()}) if self.shards else b""
        return head + b',"tensors":' + _tensors_json(self.tensors) + shards + b',"state":' + dumps(self.state) + b"}"


_tensors_cache: tuple[dict[str, TensorEntry], bytes] | None = None
"""The JSON of the last `tensors` dict: the writer passes the same dict while the layout is unchanged,
and hundreds of entries cost milliseconds of GIL per save (a tier-0 snapshot is taken every step)."""


def _tensors_json(tensors: dict[str, TensorEntry]) -> bytes:
    global _tensors_cache
    cached = _tensors_cache
    if cached is not None and cached[0] is tensors:  # held by the cache: its id cannot be reused
        return cached[1]
    data = dumps({name: _tensor_json(t) for name, t in tensors.items()})
    _tensors_cache = (tensors, data)
    return data


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    obj: dict[str, Any] = {"file": t.file, "dtype": t.dtype, "shape": list(t.shape)}
    if t.offset is not None:
        obj["offset"] = t.offset
    return obj


def parse_manifest(data: bytes, *, path: Path) -> Manifest:
    """Parse and validate a manifest. Raises CheckpointCorruptError / CheckpointVersionError."""
    obj = loads_object(data, path=path, what="manifest")
    version = check_format_version(obj, path=path, newest=MANIFEST_VERSION)
    world_size = get_int(obj, "world_size", path=path, minimum=1)
    rank = get_int(obj, "rank", path=path)
    if rank >= world_size:
        raise corrupt(path, f"rank {rank} is not below world_size {world_size}")
    if "state" not in obj:
        raise corrupt(path, "key 'state' is missing")

    files: dict[str, FileEntry] = {}
    for name, entry in get_object(obj, "files", path=path).items():
        check_file_name(name, path=path)
        files[name] = _parse_file_entry(name, entry, path=path, version=version)

    tensors: dict[str, TensorEntry] = {}
    for name, entry in get_object(obj, "tensors", path=path).items():
        if not isinstance(entry, dict):
            raise corrupt(path, f"tensors entry {name!r} is not an object")
        file = entry.get("file")
        if not isinstance(file, str) or file not in files:
            raise corrupt(path, f"tensor {name!r} refers to file {file!r}, not listed in 'files'")
        shape = entry.get("shape")
        if not is_shape(shape):
            raise corrupt(path, f"tensor {name!r} has invalid shape {shape!r}")
        offset = entry.get("offset")
        if offset is not None and not (type(offset) is int and 0 <= offset <= INT64_MAX):
            raise corrupt(path, f"tensor {name!r} has invalid offset {offset!r}")
        tensors[name] = TensorEntry(file, get_str(entry, "dtype", path=path), tuple(shape), offset)

    shards = _parse_shards(obj, tensors, path=path)
    optional = get_optional_strs(obj, "generation", "run", "run_uid", path=path)
    return Manifest(
        format_version=version,
        **optional,
        package_version=get_str(obj, "package_version", path=path),
        step=get_int(obj, "step", path=path),
        rank=rank,
        world_size=world_size,
        files=files,
        tensors=tensors,
        shards=shards,
        state=obj["state"],
    )


def _parse_shards(obj: dict[str, Any], tensors: dict[str, TensorEntry], *, path: Path) -> dict[str, ShardInfo]:
    shards: dict[str, ShardInfo] = {}
    for name, entry in (get_object(obj, "shards", path=path) if "shards" in obj else {}).items():
        info = shards[name] = parse_shard_info(name, entry, path=path)
        stored = tensors.get(name)
        if info.piece is None:
            if stored is not None:
                raise corrupt(path, f"sharded tensor {name!r} is stored but its piece is not described")
            continue
        if stored is None or stored.offset is None:
            raise corrupt(path, f"the piece of sharded tensor {name!r} is not stored (or has no offset)")
        if stored.shape != info.piece.sizes or stored.dtype != info.dtype:
            raise corrupt(
                path,
                f"sharded tensor {name!r}: its piece is {info.dtype}{list(info.piece.sizes)} but the stored "
                f"tensor is {stored.dtype}{list(stored.shape)}",
            )
    return shards


def _parse_file_entry(name: str, entry: object, *, path: Path, version: int) -> FileEntry:
    if not isinstance(entry, dict):
        raise corrupt(path, f"files entry {name!r} is not an object")
    nbytes = get_int(entry, "bytes", path=path)
    if "checksum" not in entry or version < 2:
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
            raise corrupt(path, f"files entry {name!r} has invalid sha256 {sha!r}")
        return FileEntry(sha, nbytes)
    checksum = entry["checksum"]
    if not isinstance(checksum, dict):
        raise corrupt(path, f"files entry {name!r} has a checksum that is not an object")
    algorithm = checksum.get("algorithm")
    if algorithm not in READ_ALGORITHMS:
        raise corrupt(
            path,
            f"files entry {name!r} has checksum algorithm {algorithm!r}; this version knows "
            f"{', '.join(READ_ALGORITHMS)}",
        )
    chunk_bytes = get_int(checksum, "chunk_bytes", path=path, minimum=_MIN_CHUNK_BYTES, maximum=_MAX_CHUNK_BYTES)
    digest = checksum.get("digest")
    if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        raise corrupt(path, f"files entry {name!r} has invalid digest {digest!r}")
    chunks = b""
    if "chunks" in checksum:
        chunks = _parse_chunks(name, checksum["chunks"], entry=FileEntry(digest, nbytes, algorithm, chunk_bytes),
                               path=path)
    return FileEntry(digest, nbytes, algorithm, chunk_bytes, chunks)


def _parse_chunks(name: str, value: object, *, entry: FileEntry, path: Path) -> bytes:
    """The chunk digests of a files entry: as many as the file has chunks, and hashing to its digest."""
    if not isinstance(value, str):
        raise corrupt(path, f"files entry {name!r} has chunks {type(value).__name__}, expected base64")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise corrupt(path, f"files entry {name!r} has malformed chunk digests ({exc})") from exc
    count = max(1, -(-entry.bytes // entry.chunk_bytes))
    if len(raw) != count * DIGEST_BYTES[entry.algorithm]:
        raise corrupt(path, f"files entry {name!r} has {len(raw)} bytes of chunk digests for {count} chunks")
    if hashlib.sha256(raw).hexdigest() != entry.digest:
        raise corrupt(path, f"files entry {name!r} has chunk digests that do not hash to its digest")
    return raw


def check_file_name(name: str, *, path: Path) -> None:
    """Reject a file entry that is not a plain name inside the rank directory."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        raise corrupt(
            path, f"file entry {name!r} is not a plain file name inside the rank directory"
        )


def resolve_file(rank_dir: Path, name: str, *, manifest_path: Path) -> Path:
    """The path of data file `name`, refusing names and symlinks that lead outside `rank_dir`."""
    check_file_name(name, path=manifest_path)
    candidate = rank_dir / name
    real_dir = os.path.realpath(rank_dir)
    real = os.path.realpath(candidate)
    if os.path.dirname(real) != real_dir:
        raise corrupt(
            manifest_path,
            f"file entry {name!r} resolves to {real}, outside the rank directory {rank_dir}",
        )
    return candidate
