"""Configuration of the checkpointer: one frozen dataclass per component.

CheckpointConfig            tier 0 (host memory), tier 1 (local dir), snapshot mode, busy policy, checksum
  shared: SharedConfig      tier 2 (any fsspec URL), run scoping, retention
    retry: RetryConfig      bounded exponential backoff with jitter (tenacity)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from ckpt.checksum import ALGORITHMS
from core.tier0_dir import ENV as TIER0_ENV

MODES = ("staged", "overlapped")

BUSY_POLICIES = ("wait", "skip")
DEFAULT_RUN_NAME = "default"
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

    run_name: str | None = None
    """Run-scoped prefix under `url`: checkpoints go to <url>/<run_name>/; two runs never mix.
    None (default): CheckpointConfig.run_name. Letters, digits, '.', '_' and '-'."""

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

    owner_heartbeat: timedelta = timedelta(seconds=10)
    """Rank 0 refreshes <url>/<run_name>/OWNER.json this often; another job's record that does
    not change for 3 of these is stale and taken over (see ckpt/owner.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, (str, os.PathLike)) or not os.fspath(self.url):
            raise ValueError(f"shared.url must be a non-empty URL or path, got {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        if self.run_name is not None:
            check_run_name("shared.run_name", self.run_name)
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
        _check_duration("shared.owner_heartbeat", self.owner_heartbeat)

    @property
    def run(self) -> str:
        """The run name (set by CheckpointConfig when left None)."""
        assert self.run_name is not None, "SharedConfig.run_name is set by CheckpointConfig"
        return self.run_name


def check_run_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not _RUN_NAME_RE.fullmatch(value):
        raise ValueError(
            f"{name} must be 1-128 letters, digits, '.', '_' or '-' (not starting "
            f"with '.', '_' or '-'), got {value!r}"
        )


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

    run_name: str = DEFAULT_RUN_NAME
    """The run's identity, recorded in every COMMIT and manifest; restore refuses another run's
    checkpoints and a directory holding another run's is refused at start (see ckpt/identity.py).
    Left at "default" while shared.run_name is set, it takes shared.run_name."""

    init_from: str | None = None
    """Path or fsspec URL of another run's checkpoints to start from when this run has none of
    its own (fine-tuning): a tier root (its newest committed step) or one step_... directory."""

    max_failed_saves: int | None = 3
    """After this many failed saves in a row, save_async()/check() raise CheckpointSaveError
    naming the directory and the cause (None: never; failures are only logged)."""

    read_timeout: timedelta = timedelta(minutes=2)
    """Deadline of one read of a checkpoint file (a hung disk or mount): a COMMIT or manifest
    read, or one chunk of a data file's verification; past it the copy counts as unreadable."""

    tier0_dir: str | None = None
    """Tier 0: a directory in host shared memory (tmpfs, e.g. under /dev/shm) that belongs to this
    node, not to the worker, so a snapshot there outlives the worker that wrote it (ckpt/tier0.py).
    None: `$ELASTIC_TIER0_DIR`, which elastic-run's agent sets for its workers (a private directory
    it creates at start and removes at exit); "" (or neither set): no tier 0, every save goes to disk.
    Costs `tier0_slots` x this rank's state bytes of host memory (two slots, so a crash mid-copy always
    leaves the previous snapshot whole)."""

    tier0_slots: int = 2
    """Slots per rank in tier 0 (at least 2). With a snapshot every step and tier 1 every N, a tier-1 write
    reads one slot for a while (1.2 GB: ~0.3-0.4 s on an H200 host) and the other holds the newest snapshot,
    so the snapshots of those steps are skipped (11-15 of 90 in bench/goodput_bench.py); a killed worker then
    loses 2-3 steps, not 1. A third slot lets snapshots go on during the write, at 1.5x the memory."""

    tier0_helper: bool = True
    """Let the node's checkpoint helper process (ckpt/helper.py; elastic-run's agent starts one with the
    tier-0 directory) checksum and publish this rank's tier-0 snapshots, write its tier-1 steps and upload
    their files to tier 2, off the training process. Without a helper, or when it does not answer, the
    writer and replicator threads do it. The helper uploads with the agent's environment (credentials from
    the environment must be the workers' too) and `shared.storage_options` when they are JSON."""

    device_image: bool = False
    """Stage each tier-0 snapshot of CUDA state through one image of its file on the GPU (ckpt/device_image.py):
    one gather on the GPU, the checksum summed there, one copy to the host, so the host only receives the bytes.
    Costs 1 x the rank's state bytes of GPU memory and ~1 ms of GPU time per snapshot of 1.2 GB. Off by
    default: on one H200 it did not beat the per-tensor copies and the helper's host checksum (0.9832 against
    0.9899 of the no-checkpoint throughput, bench/results/goodput_cuda_h200_session41_device_image.json). It
    is for hosts whose CPU, not the GPU, bounds the step."""

    replicas: int = 1
    """Peer replicas of tier 0: every `replica_every` steps the node's helper copies a snapshot it published
    to this many other nodes (the next ones of the round, a ring), over TCP (ckpt/replica.py), so that a lost
    node's newest state is still in some node's memory. 0: none. `trainer` turns it off for a replicated
    (DDP) state: that is whole on every rank, so any surviving node's own snapshot serves. Each node
    holds, for every rank whose replicas it keeps, 2 x that rank's state bytes (two slots), and its helper a
    1 x copy of each of its own ranks' states being sent. Needs elastic-run's helper (with the etcd-v3
    rendezvous)."""

    replica_every: int = 10
    """The step cadence of the peer replica (a snapshot of a step that is a multiple of it is replicated)."""

    def __post_init__(self) -> None:
        local_dir = self.local_dir
        if not isinstance(local_dir, (str, os.PathLike)):
            raise ValueError(
                f"local_dir must be a path, got {local_dir!r} ({type(local_dir).__name__})"
            )
        local_dir = os.fspath(local_dir)
        if not isinstance(local_dir, str) or not local_dir:
            raise ValueError(f"local_dir must be a non-empty path, got {self.local_dir!r}")
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", local_dir):  # it was written to ./s3:/bucket/... on the local disk
            raise ValueError(f"local_dir must be a node-local directory, got the URL {local_dir!r}: give a local path "
                             f"(fast storage, NVMe), and the store as shared=SharedConfig(url={local_dir!r})")
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
        check_run_name("run_name", self.run_name)
        if self.shared is not None:
            shared_name = self.shared.run_name
            if shared_name is None:
                object.__setattr__(self, "shared", replace(self.shared, run_name=self.run_name))
            elif self.run_name == DEFAULT_RUN_NAME:
                object.__setattr__(self, "run_name", shared_name)
            elif shared_name != self.run_name:
                raise ValueError(
                    f"run_name {self.run_name!r} and shared.run_name {shared_name!r} differ; "
                    f"set one of them (shared.run_name defaults to run_name)"
                )
        if self.init_from is not None:
            if not isinstance(self.init_from, (str, os.PathLike)) or not os.fspath(self.init_from):
                raise ValueError(f"init_from must be a non-empty path or URL, got {self.init_from!r}")
            object.__setattr__(self, "init_from", os.fspath(self.init_from))
        _check_int("max_failed_saves", self.max_failed_saves, minimum=1, optional=True)
        _check_duration("read_timeout", self.read_timeout)
        _check_int("replicas", self.replicas, minimum=0)
        _check_int("replica_every", self.replica_every, minimum=1)
        if isinstance(self.tier0_slots, bool) or not isinstance(self.tier0_slots, int) or self.tier0_slots < 2:
            raise ValueError(f"tier0_slots must be an int >= 2 (one slot may be mid-copy while another holds "
                             f"the newest snapshot), got {self.tier0_slots!r}")
        if not isinstance(self.tier0_helper, bool):
            raise ValueError(f"tier0_helper must be True or False, got {self.tier0_helper!r}")
        if not isinstance(self.device_image, bool):
            raise ValueError(f"device_image must be True or False, got {self.device_image!r}")
        if self.tier0_dir is not None:
            if not isinstance(self.tier0_dir, (str, os.PathLike)):
                raise ValueError(f"tier0_dir must be a path, \"\" or None, got {self.tier0_dir!r}")
            object.__setattr__(self, "tier0_dir", os.fspath(self.tier0_dir))

    @property
    def tier0_root(self) -> str | None:
        """The tier-0 directory in use: `tier0_dir`, else $ELASTIC_TIER0_DIR; None when tier 0 is off."""
        found = self.tier0_dir if self.tier0_dir is not None else os.environ.get(TIER0_ENV, "")
        return found or None

    @property
    def hash_threads(self) -> int:
        """The number of hashing threads `checksum_threads` stands for."""
        return self.checksum_threads or min(4, os.cpu_count() or 1)
