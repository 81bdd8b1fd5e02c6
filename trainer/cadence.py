"""When `Resumable.step_done` persists or snapshots, and its wait for the snapshot before (issue J).

- A persist (tier 1) is due every `persist_every` steps. With tier-0 snapshots between persists, one due while
  the previous tier-1 write still runs is snapshotted instead, and the first step after that write persists:
  the loop does not stall for a disk slower than its cadence. Every rank decides alike (one small all-reduce on
  those steps only): a step commits once every rank has written it.
- A snapshot (tier 0) is due every `save_every` steps. Before it is taken, the one before must be published:
  a kill from there to the next publication then loses one step at most. That wait is bounded (4x the longest of
  the last waits, between 1 s and SNAPSHOT_WAIT), so that a stuck checkpoint helper (its requests time out after
  30 s) costs the loop that bound once per stuck request; a snapshot waited for in vain is not waited for again
  (the writer skips snapshots meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from datetime import timedelta

from ckpt import Checkpointer, PendingSave
from core.events import emit
from trainer.config import ResumeConfig
from trainer.topology import Topology

log = logging.getLogger(__name__)

SNAPSHOT_WAIT = timedelta(seconds=5)
"""The most `step_done` waits for the previous tier-0 snapshot's publication before it takes the next."""
_NO_WAIT = timedelta(0)


class Cadence:
    """See the module. One per Resumable; `persist_owed` is cleared by the persist that pays it."""

    def __init__(self, config: ResumeConfig) -> None:
        self._persist_every = config.persist_interval
        self._snapshot_every = config.snapshot_every
        self.persist_owed = False
        """A persist came due while the previous one was still being written: it goes at the next step."""
        self._stuck: PendingSave | None = None  # waited for in vain
        self._waits: deque[timedelta] = deque(maxlen=8)  # the last waits that ended in time

    def persists(self, step: int, checkpointer: Checkpointer, topology: Topology) -> bool:
        """Whether `step` persists (collective on the steps where a persist is due or owed); a persist owed is
        paid by it."""
        due = step % self._persist_every == 0
        if (due or self.persist_owed) and not self._disk_behind(step, checkpointer, topology):
            self.persist_owed = False
            return True
        return False

    def snapshots(self, step: int, checkpointer: Checkpointer) -> bool:
        """Whether `step`, not persisted, goes to tier 0."""
        return checkpointer.has_tier0 and (step % self._persist_every == 0 or step % self._snapshot_every == 0)

    def _disk_behind(self, step: int, checkpointer: Checkpointer, topology: Topology) -> bool:
        if self._snapshot_every >= self._persist_every:
            return False  # no snapshots between persists (the same on every rank): a persist as before
        busy = int(checkpointer.has_tier0 and checkpointer.persisting)
        try:
            behind = -topology.all_min(-busy) == 1
        except RuntimeError as exc:  # the group is failing (a peer lost): the next step's collective re-forms it
            log.warning("rank %d: could not agree on postponing step %d's persist (%s); persisting it",
                        topology.rank, step, exc)
            return False
        if behind and not self.persist_owed:
            log.info("rank %d: step %d is due on disk while a tier-1 write still runs; it goes to tier 0 now and "
                     "the first step after that write is persisted", topology.rank, step)
            emit("persist_postponed", step=step)
            self.persist_owed = True
        return behind

    def wait_for_previous_snapshot(self, checkpointer: Checkpointer) -> None:
        """Wait, bounded, until the newest snapshot is published (see the module)."""
        newest = checkpointer.newest_snapshot
        given_up = newest is not None and newest is self._stuck
        if checkpointer.snapshot_ready():  # the usual case, every step: no deadline to work out
            if not given_up:
                self._waits.append(_NO_WAIT)
            self._stuck = None
            return
        longest = max(self._waits, default=SNAPSHOT_WAIT / 4)  # no wait measured yet: SNAPSHOT_WAIT
        bound = timedelta(0) if given_up else min(SNAPSHOT_WAIT, max(timedelta(seconds=1), 4 * longest))
        started = time.monotonic()
        if checkpointer.wait_snapshot(bound):
            self._stuck = None
            if not given_up:
                self._waits.append(timedelta(seconds=time.monotonic() - started))
        elif not given_up:
            self._stuck = newest
            log.warning("the tier-0 snapshot of step %s is still being published after %g s (is the node's "
                        "checkpoint helper stuck?): snapshots are skipped until it is done",
                        newest.step if newest is not None else "?", bound.total_seconds())
