"""The on-disk format version and strict parsing of its JSON records (manifest, COMMIT)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeGuard

from ckpt.errors import CheckpointCorruptError, CheckpointVersionError

FORMAT_VERSION = 1
"""Version of the COMMIT markers (tier 1 and tier 2) written by this code; readers accept this or older.

Version 1 markers may carry the optional keys "generation", "run" and "manifests" (added for
the asynchronous checkpointer); readers that predate them ignore them.
"""

MANIFEST_VERSION = 3
"""Newest manifest version this code reads. A manifest is written as version 1 when every file
has a whole-file sha256 (the original format), as version 2 when a file carries a chunked
checksum (`{"bytes", "checksum": {"algorithm", "chunk_bytes", "digest"}}`), so that an older
reader says "upgrade" instead of "corrupt". Version 3 (sharded states, ckpt/sharding.py) adds a
"shards" record, tensor "offset"s and the files' chunk digests ("checksum": {..., "chunks"}), so
that a rank can read and verify only the byte ranges it needs."""


INT64_MAX = 2**63 - 1
"""The largest int a record may hold: steps, sizes and offsets become torch or C integers of 64 bits."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf: the writer never writes one (dumps refuses it)
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_object(data: bytes, *, path: Path, what: str) -> dict[str, Any]:
    """Parse strict JSON (no NaN/Infinity literals) that must be an object."""
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(
            f"{path}: {what} is not valid JSON ({exc}); the file is damaged: "
            f"delete its checkpoint step directory and restore an earlier step",
            path=path,
        ) from exc
    if not isinstance(obj, dict):
        raise corrupt(path, f"{what} is a JSON {type(obj).__name__}, expected an object")
    return obj


CORRUPT_ADVICE = "; the file is damaged: delete its checkpoint step directory and restore an earlier step"
"""What `corrupt` tells to do: right for a step's files, not for a file outside the steps (RUN.json)."""


def corrupt(path: Path, problem: str) -> CheckpointCorruptError:
    """A CheckpointCorruptError naming `path`, with the standard advice."""
    return CheckpointCorruptError(f"{path}: {problem}{CORRUPT_ADVICE}", path=path)


def check_format_version(obj: dict[str, Any], *, path: Path, newest: int = FORMAT_VERSION) -> int:
    """The record's format_version; raises if it is missing, malformed or newer than `newest`."""
    version = obj.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise corrupt(path, f"format_version is {version!r}, expected a positive int")
    if version > newest:
        raise CheckpointVersionError(
            f"{path}: format_version {version} was written by a newer elastic-train "
            f"(this one reads up to {newest}); upgrade elastic-train to load it",
            path=path,
        )
    return version


def get_int(obj: dict[str, Any], key: str, *, path: Path, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise corrupt(path, f"key {key!r} is {short_repr(value)}, expected an int from {minimum} to {maximum}")
    return value


def is_shape(value: Any) -> TypeGuard[list[int]]:
    """Whether `value` is a tensor shape a record may hold: a list of ints >= 0 whose product fits in an int64
    (torch.empty of a larger one raises a TypeError, not a refusal)."""
    if not isinstance(value, list) or not all(type(d) is int and 0 <= d <= INT64_MAX for d in value):
        return False
    return 0 in value or math.prod(value) <= INT64_MAX


def short_repr(value: Any) -> str:
    """`value` for a message: a crafted one may be a number of thousands of digits."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def get_str(obj: dict[str, Any], key: str, *, path: Path) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise corrupt(path, f"key {key!r} is {value!r}, expected a string")
    return value


def get_optional_strs(obj: dict[str, Any], *keys: str, path: Path) -> dict[str, str]:
    """The values of optional string keys ("" when absent)."""
    found = {}
    for key in keys:
        value = obj.get(key, "")
        if not isinstance(value, str):
            raise corrupt(path, f"key {key!r} is {value!r}, expected a string")
        found[key] = value
    return found


def get_object(obj: dict[str, Any], key: str, *, path: Path) -> dict[str, Any]:
    value = obj.get(key)
    if not isinstance(value, dict):
        raise corrupt(path, f"key {key!r} is {type(value).__name__}, expected an object")
    return value


def dumps(obj: Any) -> bytes:
    """Compact, strict JSON (raises on NaN/Infinity), key order preserved."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()
