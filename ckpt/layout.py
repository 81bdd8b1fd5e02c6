"""Names of the directories and files of a checkpoint under the tier-1 root.

    <root>/step_000000000120/
        rank_00000/state.safetensors
        rank_00000/manifest.json
        rank_00001/...
        COMMIT

A rank writes into `step_.../.tmp-rank_00000-<hex>/` and renames it to `rank_00000/`; a
restore from tier 2 downloads into `<root>/.tmp-fetch-<hex>/`.
A step exists only once COMMIT exists. Anything whose name starts with `.tmp-` is
scratch of an unfinished (or crashed) write.
"""

from __future__ import annotations

import errno
import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"
TMP_PREFIX = ".tmp-"
FETCH_PREFIX = ".tmp-fetch-"
"""Scratch directories (under the tier-1 root) that hold a download from tier 2 while it is verified."""

_STEP_DIGITS = 12
_RANK_DIGITS = 5
_STEP_RE = re.compile(rf"step_(\d{{{_STEP_DIGITS},}})")
_RANK_RE = re.compile(rf"rank_(\d{{{_RANK_DIGITS},}})")


def step_dir_name(step: int) -> str:
    return f"step_{step:0{_STEP_DIGITS}d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a step directory name, or None if `name` is not one (or not canonical)."""
    match = _STEP_RE.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:0{_RANK_DIGITS}d}"


def parse_rank_dir_name(name: str) -> int | None:
    """The rank of a rank directory name, or None if `name` is not one (or not canonical)."""
    match = _RANK_RE.fullmatch(name)
    if match is None:
        return None
    rank = int(match.group(1))
    return rank if rank_dir_name(rank) == name else None


def list_dir(path: Path) -> list[Path]:
    """The entries of `path`, sorted; none when it is missing, not a directory, or a symlink loop (logged: one
    crafted entry of a tier is skipped, not the whole restore). Other errors (EIO, ESTALE on NFS) are raised: an
    empty listing would look like no checkpoint, and retention would then delete the real steps."""
    try:
        return sorted(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        logger.warning("cannot list %s (%s); its entries are skipped", path, exc)
        return []


def temp_name(label: str) -> str:
    """A unique scratch name in the same directory as its final target."""
    return f"{TMP_PREFIX}{label}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Layout:
    """Paths of checkpoints under one tier-1 root."""

    root: Path

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def rank_dir(self, step: int, rank: int) -> Path:
        return self.step_dir(step) / rank_dir_name(rank)

    def temp_rank_dir(self, step: int, rank: int) -> Path:
        return self.step_dir(step) / temp_name(rank_dir_name(rank))

    def commit_path(self, step: int) -> Path:
        return self.step_dir(step) / COMMIT_FILE

    def rank_dirs(self, step: int) -> dict[int, Path]:
        """Every published rank directory of `step`; empty if the step directory is missing."""
        found: dict[int, Path] = {}
        for entry in list_dir(self.step_dir(step)):
            rank = parse_rank_dir_name(entry.name)
            if rank is not None and is_real_dir(entry):
                found[rank] = entry
        return found

    def step_dirs(self) -> dict[int, Path]:
        """Every step directory under the root, committed or not; empty if the root is missing."""
        found: dict[int, Path] = {}
        for entry in list_dir(self.root):
            step = parse_step_dir_name(entry.name)
            if step is not None and is_real_dir(entry):
                found[step] = entry
        return found


def is_real_dir(path: Path) -> bool:
    """A directory, not a symlink to one: every checkpoint directory is made here, so a link in its place leads
    reads outside the root (another tree's files taken for this run's step)."""
    return path.is_dir() and not path.is_symlink()
