"""Retention: which steps a tier deletes. Pure decisions; the tiers do the deleting.

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
  the steps whose upload is not committed yet (`awaiting_replication`): the local copy is kept
  until the shared copy exists or a newer shared commit supersedes it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


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
    local: Iterable[int], *, shared_committed: Collection[int], shared_keep_every: int | None
) -> set[int]:
    """Local steps whose shared copy is not committed and not superseded by a newer shared commit.

    A step the shared tier keeps forever (a multiple of `shared_keep_every`) is only released
    once it is itself committed there.
    """
    newest = max(shared_committed, default=None)
    waiting = set()
    for step in local:
        if step in shared_committed:
            continue
        forever = shared_keep_every is not None and step % shared_keep_every == 0
        if forever or newest is None or step > newest:
            waiting.add(step)
    return waiting
