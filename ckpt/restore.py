"""Restore policy: which committed step a rank loads, whose part, from which tier.

Written once against the tier interface (ckpt/tiers.py), for tier 1 (`LocalTier`), tier 2
(`SharedTier`) and an `init_from` source (a read-only `SharedTier` rooted at another run):

- Candidates are the steps committed in any tier (only `step` if given; none above
  `max_step`), newest first. Tier 2 unlisted (store down) leaves tier 1's; but with no tier-1
  step and an `init_from`, restore raises rather than start over from the other run.
- A rank loads its own part (`ranks_to_try`). A rank that has none (the world grew, or its part
  lives on another node and not in tier 2) loads another rank's part of a replicated (DDP)
  state: one on this node if there is one (after a node loss the survivors' local copies are
  newer than tier 2), else rank 0's.
- Each part is tried in tier 0 first (this node's host memory, ckpt/tier0.py: copied out, so that
  the slot can be rewritten; with the replicas other nodes sent it, ckpt/replica.py, so a lost node's
  parts are there too), then tier 1, then tier 2. A damaged copy is logged, naming the file
  (`skipping checkpoint step N: ...`, event `ckpt_skipped`), remembered in its tier's
  `unreadable` (retention drops it) and the next copy, rank or older step is tried.
  CheckpointVersionError (written by a newer version) is raised, never skipped.
- Only when this run has no checkpoint of its own is `init_from` used (ckpt/init_source.py).

The verified reading of one rank directory is ckpt/reader.py's.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.commit import CommitMarker
from ckpt.config import CheckpointConfig
from ckpt.errors import (
    CheckpointAccessError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    SharedStorageError,
    permission_denied,
)
from ckpt.identity import RunIdentity
from ckpt.init_source import open_source
from ckpt.layout import MANIFEST_FILE, list_dir
from ckpt.local import LocalTier
from ckpt.reader import load_rank_dir
from ckpt.reshard import StepFiles, load_sharded
from ckpt.shared import SharedTier
from ckpt.tier0 import HostTier
from ckpt.tier0 import detach as copy_out
from ckpt.tiers import Copy, Tier, TierName, holds_rank
from core.events import emit

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Restored:
    """A loaded checkpoint."""

    step: int
    state: dict[str, Any]
    rank: int
    """The rank whose part was loaded."""
    own: bool
    """Whether that is the loading rank's own part (False: another rank's part of a replicated
    state; per-rank RNG streams should then start fresh)."""
    tier: TierName
    """"memory" (tier 0), "local" or "shared"."""
    path: str
    """The rank directory (or URL) it was loaded from."""
    init_from: bool = False
    """Whether it came from CheckpointConfig.init_from (another run's checkpoint: a new run
    starts from its state) rather than from this run's own checkpoints."""
    bytes_read: int = 0
    """Bytes of data files read (verified) for this restore; manifests and COMMITs excluded."""


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


def _select(steps: Sequence[int], step: int | None, max_step: int | None) -> list[int]:
    return [s for s in steps if (step is None or s == step) and (max_step is None or s <= max_step)]


class Restorer:
    """The restore policy of one rank over its tiers."""

    def __init__(
        self,
        local: LocalTier,
        shared: SharedTier | None,
        *,
        rank: int,
        identity: RunIdentity,
        config: CheckpointConfig,
        pool: Callable[[], Executor],
        host: HostTier | None = None,
    ) -> None:
        self.local = local
        self.shared = shared
        self.host = host
        self.rank = rank
        self.identity = identity
        self.config = config
        self._pool = pool
        self._timeout = config.read_timeout.total_seconds()
        self.blocked: CheckpointError | None = None
        """Why the last restore returned None without knowing that nothing newer exists (the shared tier could not
        be listed, a step could not be downloaded, or this process may not read a newer step): starting over, or
        from an older step, would throw that progress away."""

    def available_steps(self) -> list[int]:
        """Steps committed in any tier, newest first (the shared tier only if reachable)."""
        steps = set(self.local.committed_steps())
        if self.host is not None:
            steps |= set(self.host.committed())
        if self.shared is not None:
            try:
                steps |= set(self.shared.committed())
            except (SharedStorageError, CheckpointError) as exc:
                logger.warning("shared tier not listed, restoring from the local tier only: %s", exc)
        return sorted(steps, reverse=True)

    def restore(
        self, *, step: int | None, max_step: int | None, replicated: bool, into: Mapping[str, Any] | None = None,
        detach: bool = True,
    ) -> Restored | None:
        """See Checkpointer.restore."""
        local = set(self.local.committed_steps())
        host = self.host.committed() if self.host is not None else {}
        shared: dict[int, CommitMarker] = {}
        unlisted: CheckpointError | None = None
        if self.shared is not None:
            try:
                shared = self.shared.committed()
            except (SharedStorageError, CheckpointError) as exc:
                unlisted = exc
                logger.warning("shared tier not listed, restoring from the local tier only: %s", exc)
        self.blocked = None
        if unlisted is not None and not (local or host):
            # Starting over (or from init_from) here would throw away this run's progress in the shared tier: the
            # first save of the new start removes the committed steps newer than it (ckpt/retention.py).
            if self.config.init_from is not None:
                raise SharedStorageError(
                    f"cannot tell whether run {self.identity.describe()} has checkpoints of its own: {unlisted}; "
                    f"init_from ({self.config.init_from}) is used only once the shared tier answers. Restart when "
                    "it is reachable") from unlisted
            self.blocked = _Blocked(
                f"cannot tell whether run {self.identity.describe()} has checkpoints in the shared tier: "
                f"{unlisted}; with none in this node's tiers, the run starts from step 0 only once the shared "
                "tier answers. Start the job again when it is reachable")
            self.blocked.__cause__ = unlisted
        denied = dict(self.local.inaccessible)  # listed by committed_steps() above
        candidates = _select(sorted(local | set(shared) | set(host) | set(denied), reverse=True), step, max_step)
        for candidate in candidates:
            copies = []
            if candidate in host:
                assert self.host is not None
                copies.append(Copy(self.host, host[candidate]))
            if candidate in local and (marker := self._local_commit(candidate)) is not None:
                copies.append(Copy(self.local, marker))
            if candidate in shared:
                assert self.shared is not None
                copies.append(Copy(self.shared, shared[candidate]))
            try:
                restored = self._restore_step(candidate, copies, replicated=replicated, init_from=False, into=into,
                                              detach=detach)
            except (_Blocked, CheckpointAccessError) as exc:  # raised only to stop the walk back
                self.blocked = exc
                return None
            if restored is None and candidate in denied:
                # Its COMMIT here may not be read: not damage. An older step would lose it (its re-save replaces it).
                self.blocked = denied[candidate]
                return None
            if restored is None:
                continue
            if any(c.tier.name == restored.tier and c.marker.legacy for c in copies):
                logger.warning(
                    "step %d (%s) carries no run identity (written before it existed); loading it as run %s",
                    candidate,
                    restored.path,
                    self.identity.describe(),
                )
            logger.info(
                "restored step %d (rank %d's part, %s tier) from %s",
                restored.step,
                restored.rank,
                restored.tier,
                restored.path,
            )
            self._report_replicas(restored)
            return restored
        if candidates:
            logger.warning("no intact checkpoint among steps %s", candidates)
        elif self.config.init_from is not None and not (local or shared or host):
            return self._restore_init(step=step, max_step=max_step, replicated=replicated, into=into)
        return None

    def _report_replicas(self, restored: Restored) -> None:
        """Say so when parts of the step were in tier 0 only as a lost node's replica (ckpt/replica.py)."""
        if restored.tier != "memory" or self.host is None:
            return
        ranks = sorted(r for s, r in self.host.replicated if s == restored.step)
        if ranks:
            logger.info("step %d: the parts of ranks %s came from peer nodes' replicas in this node's memory",
                        restored.step, ranks)
            emit("ckpt_replica_restored", step=restored.step, ranks=ranks)

    def _local_commit(self, step: int) -> CommitMarker | None:
        """Tier 1's COMMIT of `step`, read again (a newer version's raises: "upgrade")."""
        try:
            return self.local.read_commit(step)
        except CheckpointVersionError:
            raise
        except CheckpointError as exc:
            logger.warning("ignoring local step %d: %s", step, exc)
            return None

    def _restore_init(
        self, *, step: int | None, max_step: int | None, replicated: bool, into: Mapping[str, Any] | None
    ) -> Restored | None:
        """Load from config.init_from: this run has no checkpoint yet."""
        source, fixed = open_source(self.config)
        try:
            markers = source.committed()
        except CheckpointError as exc:
            raise _init_from_unusable(source.url, f"it cannot be listed ({exc})") from exc
        candidates = sorted(markers, reverse=True)
        if not candidates:  # a mistyped path: starting from random weights without a word would be the worse error
            raise _init_from_unusable(source.url, "it holds no committed checkpoint step")
        if fixed is not None:
            candidates = [s for s in candidates if s == fixed]
            if not candidates:
                raise _init_from_unusable(source.url, f"step {fixed} is not committed there "
                                                      f"(it holds steps {sorted(markers)})")
        for candidate in _select(candidates, step, max_step):
            marker = markers[candidate]
            restored = self._restore_step(
                candidate, [Copy(source, marker)], replicated=replicated, init_from=True, into=into
            )
            if restored is not None:
                logger.info(
                    "starting from another run's checkpoint: step %d (rank %d's part) of %s (run %r)",
                    candidate,
                    restored.rank,
                    source.url,
                    marker.run or "unnamed",
                )
                return restored
        return None

    def _restore_step(
        self,
        step: int,
        copies: Sequence[Copy],
        *,
        replicated: bool,
        init_from: bool,
        into: Mapping[str, Any] | None,
        detach: bool = True,
    ) -> Restored | None:
        """Load `step` from the first intact copy, tiers in the order of `copies`; None if none is."""
        if not copies:
            return None
        nearby = sorted({r for c in copies for r in c.tier.ranks_here(step, c.marker)})
        files = StepFiles(step, copies, run=None if init_from else self.identity.name, pool=self._pool())
        own = any(c.tier.has_rank(step, self.rank, c.marker) for c in copies)
        tried = False
        denied_here: CheckpointAccessError | None = None  # raised once no other copy of the step loads
        for rank in ranks_to_try(
            rank=self.rank,
            saved_world_size=copies[0].marker.world_size,
            has_own=own,
            replicated=replicated,
            on_this_node=nearby,
        ):
            for copy in copies:
                if not copy.tier.has_rank(step, rank, copy.marker):
                    continue
                tried = True
                try:
                    if files.is_sharded(rank):
                        return self._load_sharded(files, step, rank, init_from=init_from, into=into)
                    return self._load(copy, step, rank, init_from=init_from, detach=detach)
                except CheckpointVersionError:
                    raise
                except SharedStorageError as exc:
                    if init_from:
                        self._unusable(copy.tier, step, rank, exc, init_from=True)
                        continue
                    # The store did not answer (or tier 1 had no room for the download): no sign the step is
                    # damaged. Going back to an older one would throw it away (its first save removes the newer):
                    # none is restored here, and the caller decides (Checkpointer.restore raises `blocked`).
                    raise _Blocked(
                        f"step {step} (rank {rank}'s part) could not be read from "
                        f"{copy.tier.describe_rank(step, rank)}: {exc}. Not going back to an older step, whose "
                        "first save would remove this one: start the job again once the store answers and "
                        "tier 1 has room for the download") from exc
                except CheckpointError as exc:
                    denied = permission_denied(exc)
                    if denied is not None and not init_from:
                        # Not damage: another tier's copy may serve; if none does, going back to an older step
                        # would throw this one away, as above.
                        denied_here = denied_here or CheckpointAccessError(
                            f"step {step} (rank {rank}'s part) could not be read from "
                            f"{copy.tier.describe_rank(step, rank)}: {denied}. The step is not damaged, and nothing is "
                            "removed or restored in its place: give this job read access to its files (their owner "
                            "or mode) and start again", path=exc.path)
                        denied_here.__cause__ = exc
                        continue
                    self._unusable(copy.tier, step, rank, exc, init_from=init_from)
                    if files.is_sharded(rank):
                        return None  # every tier was tried, and another part needs the same pieces
        if denied_here is not None:
            raise denied_here
        broken = [c for c in copies if c.marker.manifests == {} or (
            holds_rank(c.marker, self.rank) and not c.tier.has_rank(step, self.rank, c.marker))]
        if not tried and not init_from and broken:  # not a rank whose part is elsewhere: damage, said as such
            reason = (f"its {broken[0].tier.name} COMMIT names no rank, or names rank {self.rank} whose directory "
                      "is not there")
            logger.warning("skipping checkpoint step %d: %s", step, reason)
            emit("ckpt_skipped", step=step, reason=reason, tier=broken[0].tier.name, source_rank=self.rank)
        return None

    def _load_sharded(
        self, files: StepFiles, step: int, rank: int, *, init_from: bool, into: Mapping[str, Any] | None
    ) -> Restored:
        """A sharded step (ckpt/reshard.py): rank `rank`'s part, every sharded leaf resharded into `into`."""
        part = files.manifest(rank)
        assert part is not None  # is_sharded read it
        state = load_sharded(files, part, into=into)
        holder = files.holders(rank)[0]
        return Restored(
            step=step,
            state=state,
            rank=rank,
            own=rank == self.rank,
            tier=holder.tier.name,
            path=holder.tier.describe_rank(step, rank),
            init_from=init_from,
            bytes_read=files.bytes_read,
        )

    def _load(self, copy: Copy, step: int, rank: int, *, init_from: bool, detach: bool = True) -> Restored:
        manifests = copy.marker.manifests
        expected = None if manifests is None else manifests.get(rank)
        with copy.tier.open_rank(step, rank, expected_manifest_sha256=expected) as rank_dir:
            state = load_rank_dir(
                rank_dir,
                step=step,
                rank=rank,
                expected_manifest_sha256=expected,
                pool=self._pool(),
                run=None if init_from else self.identity.name,
                timeout=self._timeout,
            )
            if copy.tier.name == "memory" and detach:
                state = copy_out(state)  # the slot is rewritten by later snapshots
            nbytes = _bytes_read(rank_dir)
        return Restored(
            step=step,
            state=state,
            rank=rank,
            own=rank == self.rank,
            tier=copy.tier.name,
            path=copy.tier.describe_rank(step, rank),
            init_from=init_from,
            bytes_read=nbytes,
        )

    def _unusable(self, tier: Tier, step: int, rank: int, exc: CheckpointError, *, init_from: bool) -> None:
        if init_from:  # another run's: not ours to mark or report
            logger.warning("init_from: skipping step %d rank %d: %s", step, rank, exc)
            return
        tier.unreadable.add(step)
        reason = f"{tier.name} copy of rank {rank} is unusable: {exc}"
        logger.warning("skipping checkpoint step %d: %s", step, reason)
        emit("ckpt_skipped", step=step, reason=reason, tier=tier.name, source_rank=rank)


class _Blocked(SharedStorageError):
    """No step restored for want of the store (Restorer.blocked): a newer step than any this rank can read may
    exist. Raised out of a step's load only to stop the walk back to older steps."""


def _bytes_read(rank_dir: Path) -> int:
    """The bytes of the rank directory's regular files but the manifest (what a restore read, for its metrics).
    Not stat() of every entry: a stray dangling link, or a file removed meanwhile, would fail a verified load."""
    total = 0
    for entry in list_dir(rank_dir):
        try:
            st = entry.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and entry.name != MANIFEST_FILE:
            total += st.st_size
    return total


def _init_from_unusable(url: str, why: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"init_from {url}: {why}; check the path or URL (a run with no checkpoint of its own starts from it), or "
        f"leave init_from out to start from scratch")
