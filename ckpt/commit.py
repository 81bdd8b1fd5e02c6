"""The COMMIT marker of a step: its presence is what makes a checkpoint exist."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt.format import FORMAT_VERSION, check_format_version, corrupt, dumps, get_int, loads_object


@dataclass(frozen=True)
class CommitMarker:
    """Contents of `<step dir>/COMMIT`."""

    step: int
    world_size: int
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "format_version": self.format_version,
                "step": self.step,
                "world_size": self.world_size,
            }
        )


def parse_commit(data: bytes, *, path: Path, step: int) -> CommitMarker:
    """Parse a COMMIT file of step directory `step`. Raises CheckpointCorruptError/VersionError."""
    obj = loads_object(data, path=path, what="COMMIT marker")
    version = check_format_version(obj, path=path)
    found = get_int(obj, "step", path=path)
    if found != step:
        raise corrupt(path, f"COMMIT names step {found} but lies in the directory of step {step}")
    return CommitMarker(found, get_int(obj, "world_size", path=path, minimum=1), version)
