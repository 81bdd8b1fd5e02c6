"""Retention: which steps a tier deletes. The decisions are pure functions; `apply_local_retention`
carries them out for tier 1 (rank 0's replicator does it for tier 2, ckpt/replicator.py).

Per tier:
- the newest `keep_last` committed steps stay;
- steps that are multiples of `keep_every` stay forever (when set);
- uncommitted steps older than the newest committed one are leftovers of failed or abandoned
  saves and go; newer uncommitted ones may still be in progress and stay;
- `abandoned` steps go and do not count toward `keep_last`: committed steps this incarnation
  can not use (they failed verification at restore, or they are newer than the first step it
  saved: it went back past them, so they belong to a history it left). Without that rule a
  damaged newer step outranks every fresh save, and keep_last=1 deletes the save at its commit.
- `protected` steps stay whatever the rules above say (abandoned ones too: they are not ours
  to decide about, e.g. another run's step directory). For tier 1 with a shared tier these are
  the steps whose upload is not committed yet (`awaiting_replication`) and will be: the one
  uploading and those tier 2 keeps forever (the newest is within `keep_last`). The local copy is
  kept until the shared copy exists or a newer shared commit supersedes it; older ones are
  superseded in the upload queue and go by the rules above.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from ckpt.errors import CheckpointError, SharedStorageError
from ckpt.local import LocalTier
from ckpt.shared import SharedTier

logger = logging.getLogger(__name__)


def select_deletions(
    *,
    committed: Iterable[int],
    present: Iterable[int],
    keep_last: int,
    keep_every: int | None = None,
    protected: Collection[int] = (),
    abandoned: Collection[int] = (),
) -> list[int]:
    """The steps of `present` (committed or not) to delete, oldest first."""
    dropped = set(abandoned)
    committed_sorted = sorted(set(committed) - dropped, reverse=True)
    committed_set = set(committed_sorted)
    keep = set(committed_sorted[:keep_last])
    newest = committed_sorted[0] if committed_sorted else None
    doomed = []
    for step in sorted(set(present) | committed_set | (dropped & set(committed))):
        if step in protected:
            continue
        if step in dropped:
            doomed.append(step)
            continue
        if step in keep:
            continue
        if keep_every is not None and step in committed_set and step % keep_every == 0:
            continue
        if step in committed_set or (newest is not None and step < newest):
            doomed.append(step)
    return doomed


def abandoned_steps(
    committed: Iterable[int], *, saved: Collection[int], unreadable: Collection[int] = ()
) -> set[int]:
    """The committed steps this incarnation abandoned (see the module docstring): those that
    failed verification, and those newer than its first save that it did not save itself."""
    first = min(saved, default=None)
    return {
        s
        for s in committed
        if s in unreadable and s not in saved or (first is not None and s > first and s not in saved)
    }


def awaiting_replication(
    local: Iterable[int], *, shared_committed: Collection[int], shared_keep_every: int | None,
    uploading: int | None,
) -> set[int]:
    """Local steps whose shared copy is not committed yet and will be: the one `uploading` now (unless a newer
    shared commit superseded it) and those the shared tier keeps forever (multiples of `shared_keep_every`),
    released only once they are committed there themselves.

    Not the others: the replicator supersedes older queued steps by the newest (which keep_last >= 1 keeps),
    and holding every not-uploaded step filled tier 1 in a long outage of tier 2, until the job stopped on a
    full disk.
    """
    newest = max(shared_committed, default=None)
    waiting = set()
    for step in local:
        if step in shared_committed:
            continue
        forever = shared_keep_every is not None and step % shared_keep_every == 0
        if forever or (step == uploading and (newest is None or step > newest)):
            waiting.add(step)
    return waiting


def apply_local_retention(
    local: LocalTier,
    *,
    keep_last: int,
    keep_every: int | None,
    saved: Collection[int],
    shared: SharedTier | None,
    shared_committed: Collection[int] | None = None,
    uploading: int | None = None,
) -> None:
    """Delete tier-1 steps beyond retention, then sweep scratch. With a shared tier, a step whose
    upload is not committed there yet and may still be is kept (`awaiting_replication`; `shared_committed`:
    the shared tier's committed steps if known, else listed here; while it cannot be listed, none)."""
    committed = local.committed_steps()
    if not committed:
        return
    present = list(local.layout.step_dirs())
    abandoned = abandoned_steps(committed, saved=saved, unreadable=local.unreadable)
    protected: set[int] = set(local.foreign) | set(local.inaccessible)  # another run's; or unreadable here, not damaged
    if shared is not None:
        candidates = select_deletions(
            committed=committed, present=present, keep_last=keep_last, keep_every=keep_every, abandoned=abandoned
        )
        releasable = [s for s in candidates if s in committed]
        if releasable:
            if shared_committed is None:
                try:
                    shared_committed = set(shared.committed())
                except (SharedStorageError, CheckpointError) as exc:
                    # Not known: nothing there counts as committed. What may still be uploaded stays (the step
                    # being uploaded, the steps tier 2 keeps forever); waiting instead, a long outage of tier 2
                    # filled tier 1 until the job stopped on a full disk.
                    logger.info("local retention, the shared tier's commits unknown (%s): keeping the steps it "
                                "may still need", exc)
                    shared_committed = set()
            protected |= awaiting_replication(
                set(releasable) - abandoned,
                shared_committed=set(shared_committed),
                shared_keep_every=shared.config.keep_every,
                uploading=uploading,
            )
    doomed = set(
        select_deletions(
            committed=committed,
            present=present,
            keep_last=keep_last,
            keep_every=keep_every,
            protected=protected,
            abandoned=abandoned,
        )
    )
    for step, path in sorted(local.layout.step_dirs().items()):
        if step in doomed:
            logger.log(
                logging.WARNING if step in abandoned else logging.INFO,
                "removing %s step %d (%s)%s",
                "committed" if step in committed else "uncommitted",
                step,
                path,
                ": unreadable, or newer than the step this run restarted from" if step in abandoned else "",
            )
            local.delete_step(step)
    local.sweep_temp(set(committed) - doomed)
