"""`ResumeConfig`: when `Resumable` saves, and the checkpointer's own configuration, whole.

Two cadences: `save_every` snapshots into tier 0 (the node's host memory, under elastic-run; see
ckpt/tier0.py), `persist_every` writes to tier 1 (disk) and from there tier 2; a persisted step is in
tier 0 too. With a tier 0, a persist that comes due while the disk still writes the one before waits for
the first step after that write (it goes to tier 0 meanwhile) instead of stalling the loop.
Either given alone sets both (so `save_every=N` keeps its earlier meaning, a checkpoint on
disk every N steps); left out, both are 10. Snapshots between the persisted steps need both:
`save_every=1, persist_every=10`. They are not the default: on one H200 a snapshot every step costs 1-2%
of the GPT example's throughput (0.981-0.994 of no checkpoint; the default 0.989-1.001:
bench/goodput_bench.py, 2026-12-02). Memory: tier 0 keeps two copies of each rank's state in the node's
/dev/shm, three when `ResumeConfig.at` is given snapshots between persists (`tier0_slots`, so that the
snapshots go on while a tier-1 write reads a slot). Without a tier 0 (no elastic-run, or tier0_dir=""),
only persisted steps are saved.

The checkpointer's options are not renamed here: `ResumeConfig.ckpt` is a `ckpt.CheckpointConfig`,
so every one of them (snapshot `mode` including "overlapped", `if_busy`, `checksum`, `keep_every`,
the shared tier with its retention and retries, `init_from`, `max_failed_saves`) is reachable.
The common case is one call:

    ResumeConfig.at("/nvme/ckpt", save_every=100, shared_url="s3://bucket/ckpt", run_name="job-42")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from ckpt import CheckpointConfig, SharedConfig

DEFAULT_PERSIST_EVERY = 10
"""Both cadences when neither is given."""


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    ckpt: CheckpointConfig
    """Where checkpoints go and how they are written (ckpt/config.py)."""
    save_every: int | None = None
    """Snapshot after every N-th completed step into tier 0 (host memory); see the module docstring
    for the default. The last step is persisted at `Resumable.teardown`."""
    persist_every: int | None = None
    """Persist every N-th completed step to tier 1 (and tier 2); see the module docstring."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (e.g. the sequence length), for the `elastic_train_tokens_*` metrics; None: the job
    reports samples only."""
    defer_snapshots: bool = True
    """Finish a tier-0 snapshot's or a persist's bookkeeping and copies once the next forward is queued instead
    of in `step_done`, where a loop that waits for the device each step leaves it idle (trainer/deferred.py;
    where nothing but the optimizer changes the saved tensors between steps). False: all of it in `step_done`."""

    def __post_init__(self) -> None:
        if not isinstance(self.ckpt, CheckpointConfig):
            raise ValueError(f"ResumeConfig.ckpt must be a ckpt.CheckpointConfig, got {type(self.ckpt).__name__}; "
                             "ResumeConfig.at(ckpt_dir, save_every=...) builds one")
        if not isinstance(self.defer_snapshots, bool):
            raise ValueError(f"defer_snapshots must be a bool, got {self.defer_snapshots!r}")
        for name in ("save_every", "persist_every", "tokens_per_sample"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        save, persist = self.save_every, self.persist_every
        if save is None:
            save = persist = persist if persist is not None else DEFAULT_PERSIST_EVERY
        elif persist is None:
            persist = save  # the earlier meaning of save_every alone: a checkpoint on disk every N steps
        object.__setattr__(self, "save_every", save)
        object.__setattr__(self, "persist_every", persist)

    @property
    def snapshot_every(self) -> int:
        """`save_every`, resolved (an int)."""
        assert self.save_every is not None
        return self.save_every

    @property
    def persist_interval(self) -> int:
        """`persist_every`, resolved (an int)."""
        assert self.persist_every is not None
        return self.persist_every

    @property
    def ckpt_dir(self) -> str:
        """Tier 1: the node-local checkpoint directory."""
        return self.ckpt.local_dir

    @classmethod
    def at(cls, ckpt_dir: str | os.PathLike[str], *, save_every: int | None = None, persist_every: int | None = None,
           shared_url: str | None = None, tokens_per_sample: int | None = None, **options: Any) -> ResumeConfig:
        """Checkpoints in `ckpt_dir` every `persist_every` steps and snapshots in tier 0 every `save_every`
        (module docstring: the defaults); with `shared_url` (any fsspec URL) also in a shared tier
        (SharedConfig defaults; pass `shared=SharedConfig(...)` for its options instead). `tokens_per_sample`
        turns on the tokens-per-second metrics.

        `options` are CheckpointConfig fields: run_name, keep_last, keep_every, mode (here "overlapped"
        unless given), if_busy, checksum, init_from, max_failed_saves, tier0_dir, ..."""
        if not isinstance(ckpt_dir, (str, os.PathLike)):
            raise TypeError(f"ResumeConfig.at: ckpt_dir must be a path (a node-local directory), got {ckpt_dir!r}")
        known = {f.name for f in fields(CheckpointConfig)} - {"local_dir"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"ResumeConfig.at: {', '.join(unknown)} is not a CheckpointConfig option; "
                            f"the options are {', '.join(sorted(known))}")
        # Resumable waits for a save's copy before the optimizer next changes the state (its hooks), so the
        # copy may overlap the next forward and backward: a snapshot every step then costs ~nothing.
        options.setdefault("mode", "overlapped")
        if _snapshots_between_persists(save_every, persist_every):
            # A tier-1 write reads one slot for a while and the newest snapshot holds another: with two slots the
            # snapshots of those steps are skipped (12-33 a run of 100 steps on an H200, a killed worker then
            # loses 2-3 steps); a third slot keeps them (1 skipped), at 1.5x the tier-0 memory.
            options.setdefault("tier0_slots", 3)
        if shared_url is not None:
            if options.get("shared") is not None:
                raise ValueError("ResumeConfig.at: pass shared_url or shared=SharedConfig(...), not both")
            options["shared"] = SharedConfig(url=shared_url)
        return cls(ckpt=CheckpointConfig(local_dir=os.fspath(ckpt_dir), **options), save_every=save_every,
                   persist_every=persist_every, tokens_per_sample=tokens_per_sample)


def _snapshots_between_persists(save_every: int | None, persist_every: int | None) -> bool:
    """Whether ResumeConfig(save_every=, persist_every=) snapshots into tier 0 on steps it does not persist."""
    return save_every is not None and persist_every is not None and save_every < persist_every
