"""Configuration of the checkpointer: one frozen dataclass per component.

CheckpointConfig            tier 1 (local dir), snapshot mode, busy policy, checksum
  shared: SharedConfig      tier 2 (any fsspec URL), run scoping, retention
    retry: RetryConfig      bounded exponential backoff with jitter (tenacity)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ckpt.checksum import ALGORITHMS

MODES = ("staged", "overlapped")
BUSY_POLICIES = ("wait", "skip")
_RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _check_int(name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_duration(name: str, value: object, *, allow_zero: bool = False) -> None:
    if not isinstance(value, timedelta):
        raise ValueError(f"{name} must be a datetime.timedelta, got {value!r}")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero):
        raise ValueError(f"{name} must be positive, got {value}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    """Bounded retries of one tier-2 operation: exponential backoff with jitter (tenacity)."""

    attempts: int = 6
    """Tries of one operation (upload of a file, a marker, a listing) before it counts as failed."""

    initial: timedelta = timedelta(seconds=0.5)
    """First backoff; each further one doubles, up to `maximum`."""

    maximum: timedelta = timedelta(seconds=30)
    """Largest backoff between two tries; also the pause before a failed upload is tried again."""

    jitter: timedelta = timedelta(seconds=1)
    """Random extra backoff, up to this much, so that ranks do not retry in lockstep."""

    deadline: timedelta = timedelta(minutes=5)
    """One operation gives up after this long, whatever `attempts` says."""

    def __post_init__(self) -> None:
        _check_int("retry.attempts", self.attempts, minimum=1)
        _check_duration("retry.initial", self.initial)
        _check_duration("retry.maximum", self.maximum)
        _check_duration("retry.jitter", self.jitter, allow_zero=True)
        _check_duration("retry.deadline", self.deadline)
        if self.maximum < self.initial:
            raise ValueError(
                f"retry.maximum ({self.maximum}) must be >= retry.initial ({self.initial})"
            )


@dataclass(frozen=True, kw_only=True)
class SharedConfig:
    """Tier 2: committed tier-1 checkpoints replicated to shared storage in the background."""

    url: str
    """fsspec URL of the shared root: a mounted path, "s3://bucket/prefix", "gs://...", ..."""

    run_name: str
    """Run-scoped prefix under `url`: checkpoints go to <url>/<run_name>/; two runs never mix.
    Letters, digits, '.', '_' and '-'; the same value on every rank and on every restart."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the fsspec file system, e.g. {"endpoint_url": ..., "key": ..., "secret": ...}."""

    keep_last: int = 3
    """Committed checkpoints kept in the shared tier; older ones are deleted after a commit."""

    keep_every: int | None = None
    """Steps that are multiples of this are kept in the shared tier forever (None: none are)."""

    retry: RetryConfig = field(default_factory=RetryConfig)
    """Retries of each upload, download, listing and marker write."""

    commit_timeout: timedelta = timedelta(minutes=10)
    """How long rank 0 waits for every rank's upload of a step before it gives that step up."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, (str, os.PathLike)) or not os.fspath(self.url):
            raise ValueError(f"shared.url must be a non-empty URL or path, got {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        if not isinstance(self.run_name, str) or not _RUN_NAME_RE.fullmatch(self.run_name):
            raise ValueError(
                f"shared.run_name must be 1-128 letters, digits, '.', '_' or '-' (not starting "
                f"with '.', '_' or '-'), got {self.run_name!r}"
            )
        if not isinstance(self.storage_options, Mapping):
            raise ValueError(
                f"shared.storage_options must be a mapping, got {type(self.storage_options).__name__}"
            )
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        _check_int("shared.keep_last", self.keep_last, minimum=1)
        _check_int("shared.keep_every", self.keep_every, minimum=1, optional=True)
        if not isinstance(self.retry, RetryConfig):
            raise ValueError(f"shared.retry must be a RetryConfig, got {self.retry!r}")
        _check_duration("shared.commit_timeout", self.commit_timeout)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints live, how many are kept, and how saving overlaps training."""

    local_dir: str
    """Tier-1 root: a node-local directory (NVMe); a PathLike is accepted and stored as str."""

    keep_last: int = 3
    """Number of committed checkpoints kept in `local_dir`; older ones are deleted on commit
    (with a shared tier, only once they are committed there, or superseded by a newer one)."""

    keep_every: int | None = None
    """Steps that are multiples of this are never deleted from `local_dir` (None: none are)."""

    mode: str = "staged"
    """save_async(): "staged" returns once the host copy is consistent; "overlapped" returns at
    once and the loop calls wait_staged() before it mutates the state (before optimizer.step)."""

    if_busy: str = "wait"
    """A save_async() while the previous save still persists: "wait" for it (up to
    `busy_timeout`, then skip), or "skip" this save at once. Either way nothing is corrupted."""

    busy_timeout: timedelta = timedelta(minutes=10)
    """Longest wait of save_async() for the previous save under if_busy="wait"."""

    stage_timeout: timedelta = timedelta(minutes=5)
    """Longest wait for the device-to-host copy of one save (a stuck GPU); past it the save
    fails with CheckpointTimeoutError and training is told."""

    checksum: str = "sha256"
    """Per-chunk checksum algorithm of new files: "sha256" or "crc32" (see ckpt/checksum.py)."""

    checksum_threads: int = 0
    """Threads that hash in parallel while writing and verifying; 0: min(4, CPU count)."""

    shared: SharedConfig | None = None
    """Tier 2, or None for a local tier only."""

    def __post_init__(self) -> None:
        local_dir = self.local_dir
        if not isinstance(local_dir, (str, os.PathLike)):
            raise ValueError(
                f"local_dir must be a path, got {local_dir!r} ({type(local_dir).__name__})"
            )
        local_dir = os.fspath(local_dir)
        if not isinstance(local_dir, str) or not local_dir:
            raise ValueError(f"local_dir must be a non-empty path, got {self.local_dir!r}")
        object.__setattr__(self, "local_dir", local_dir)
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int):
            raise ValueError(f"keep_last must be an int >= 1, got {self.keep_last!r}")
        if self.keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (at least the newest checkpoint is kept), got {self.keep_last}"
            )
        _check_int("keep_every", self.keep_every, minimum=1, optional=True)
        _check_choice("mode", self.mode, MODES)
        _check_choice("if_busy", self.if_busy, BUSY_POLICIES)
        _check_duration("busy_timeout", self.busy_timeout, allow_zero=True)
        _check_duration("stage_timeout", self.stage_timeout)
        _check_choice("checksum", self.checksum, ALGORITHMS)
        _check_int("checksum_threads", self.checksum_threads, minimum=0)
        if self.shared is not None and not isinstance(self.shared, SharedConfig):
            raise ValueError(f"shared must be a SharedConfig or None, got {self.shared!r}")

    @property
    def hash_threads(self) -> int:
        """The number of hashing threads `checksum_threads` stands for."""
        return self.checksum_threads or min(4, os.cpu_count() or 1)
