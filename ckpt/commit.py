"""The COMMIT marker of a step: its presence is what makes a checkpoint exist.

The same record marks a step complete in tier 1 (`<local_dir>/step_.../COMMIT`, for the ranks
of that directory) and in tier 2 (`<shared>/<run>/step_.../COMMIT`, for every rank). Markers
name the run (its name and uid, see ckpt/identity.py), the generation (incarnation of the job)
and the sha256 of every committed rank's manifest.json: a reader checks the manifest it loads
against it, so a rank directory replaced after the commit is never mixed in. Markers of older
versions (the removed synchronous `commit()`) lack the generation and the digests; they load.

`RankMarker` is tier 2's per-rank record (`<shared>/<run>/step_.../rank_XXXXX.done`): rank 0
commits a step once it found one for every rank (ckpt/shared.py describes the protocol).
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.format import (
    FORMAT_VERSION,
    check_format_version,
    corrupt,
    dumps,
    get_int,
    get_optional_strs,
    get_str,
    loads_object,
)
from core.numbers import decimal

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CommitMarker:
    """Contents of `<step dir>/COMMIT`."""

    step: int
    world_size: int
    format_version: int = FORMAT_VERSION
    generation: str = ""
    run: str = ""
    manifests: Mapping[int, str] | None = None
    """sha256 of each committed rank's manifest.json; None in markers of older versions (every rank
    of the world counts)."""
    run_uid: str = ""
    """The uid of the run (ckpt/identity.py) in the tier it is committed in; "" in markers that
    predate run identity (they name no run, or only its name)."""

    @property
    def legacy(self) -> bool:
        """Whether the marker carries no run identity (written before run identity existed)."""
        return not self.run and not self.run_uid

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
        }
        if self.run:
            obj["run"] = self.run
        if self.run_uid:
            obj["run_uid"] = self.run_uid
        if self.generation:
            obj["generation"] = self.generation
        if self.manifests is not None:
            obj["manifests"] = {str(r): d for r, d in sorted(self.manifests.items())}
        return dumps(obj)


def parse_commit(data: bytes, *, path: Path, step: int) -> CommitMarker:
    """Parse a COMMIT file of step directory `step`. Raises CheckpointCorruptError/VersionError."""
    obj = loads_object(data, path=path, what="COMMIT marker")
    version = check_format_version(obj, path=path)
    found = get_int(obj, "step", path=path)
    if found != step:
        raise corrupt(path, f"COMMIT names step {found} but lies in the directory of step {step}")
    world_size = get_int(obj, "world_size", path=path, minimum=1)
    strings = get_optional_strs(obj, "generation", "run", "run_uid", path=path)
    manifests: dict[int, str] | None = None
    if "manifests" in obj:
        raw = obj["manifests"]
        if not isinstance(raw, dict):
            raise corrupt(path, "key 'manifests' is not an object")
        manifests = {}
        for key, digest in raw.items():
            rank = decimal(key)
            if rank is None or rank >= world_size or str(rank) != key:
                raise corrupt(path, f"manifests key {key[:40]!r} is not a rank below {world_size}")
            if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
                raise corrupt(path, f"manifests entry of rank {key} is {digest!r}, not a sha256")
            manifests[rank] = digest
    return CommitMarker(
        found,
        world_size,
        version,
        strings["generation"],
        strings["run"],
        manifests,
        strings["run_uid"],
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

    def to_bytes(self) -> builtins.bytes:  # `bytes` is a field here
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
