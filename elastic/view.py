"""A live view of one run's keys in etcd, kept current by a watch.

The rendezvous reads it to decide, waits on it for the next change, and the agent's monitor loop
asks it every 0.1 s whether a peer was lost, without a round trip to etcd. One background thread
holds one prefix watch; every event (a join, a lease expiry or revoke, a state write) triggers a
fresh range read, and a periodic re-read covers a watch that broke silently. When etcd cannot be
reached the view keeps its last snapshot and reports itself degraded. A malformed value is not an
unreachable etcd: `elastic/records.py` parses every value; a bad node or store record is left out
with a warning naming the key, a bad round state is carried in the snapshot (`state_error`) and
raised by `Snapshot.checked_state()` where the rendezvous needs the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from core.deadline import Deadline
from core.events import emit
from elastic import round as protocol
from elastic.errors import EtcdRecordError
from elastic.records import NodeRecord, StoreRecord, parse_run
from elastic.run_store import RunStore

if TYPE_CHECKING:
    from elastic.admission import Admission

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    state: protocol.RoundState | None
    """The round state; None if the key does not exist or is malformed (see `state_error`)."""
    state_revision: int
    """mod_revision of the state key; 0 if it does not exist (compare-and-set guard)."""
    live: frozenset[str]
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    """Registered node id -> its membership record (malformed records are left out)."""
    stores: dict[int, StoreRecord] = field(default_factory=dict)
    """Round generation -> the TCPStore address its rank 0 published."""
    revision: int = 0
    """etcd's revision at the time of the read: snapshots are ordered by it."""
    state_error: EtcdRecordError | None = None
    """Why the state key, which exists, could not be parsed."""

    def checked_state(self) -> protocol.RoundState | None:
        """The round state; raises `EtcdRecordError` naming the key if it is malformed."""
        if self.state_error is not None:
            raise self.state_error
        return self.state


class RunView:
    """Reads and watches `/<prefix>/<run_id>/`; `snapshot()` is never older than the last event."""

    RESYNC = timedelta(seconds=2)

    def __init__(self, store: RunStore, admission: Admission | None = None) -> None:
        self._store = store
        self._admission = admission
        """Checks the join-token proofs of what is read (elastic/admission.py); None: take records as they are."""
        self.keys = store.keys
        self.prefix = store.keys.prefix
        self._warned: set[tuple[str, int]] = set()
        self._cond = threading.Condition()
        self._snapshot: Snapshot | None = None
        self._published_at = 0.0  # time.monotonic() when the read of `_snapshot` ended
        self._dirty = threading.Event()
        self._watch_broken = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.degraded_since: float | None = None
        self.on_change: Callable[[Snapshot], None] | None = None
        """Called (from the reading thread) with each new snapshot."""

    # -- reads ---------------------------------------------------------------------------------

    def read(self, deadline: timedelta | None = None) -> Snapshot:
        """A fresh, linearizable read of the run's keys (also publishes it to waiters)."""
        started = time.monotonic()
        response = self._store.read(deadline=deadline)
        records = parse_run(self.keys, response.kvs)
        if self._admission is not None:
            records = self._admission.admit(records, response.kvs)  # strangers' records become skipped ones
        for bad in (*records.skipped, *filter(None, [records.state_error])):
            self._warn_once(bad)
        revision = response.revision
        snap = Snapshot(records.state, records.state_revision, frozenset(records.nodes), records.nodes, records.stores,
                        revision, records.state_error)
        self._publish(snap, started)
        return snap

    def _warn_once(self, bad: EtcdRecordError) -> None:
        # Once per written value: the view re-reads on every event and every RESYNC.
        if (bad.key, bad.mod_revision) not in self._warned:
            self._warned.add((bad.key, bad.mod_revision))
            ignored = "" if bad.key == self.keys.state else " (ignored)"
            log.warning("view: %s%s", bad, ignored)
            emit("bad_record", prefix=self.prefix, key=bad.key, problem=bad.problem[:200])

    def snapshot(self) -> Snapshot:
        """The latest known snapshot (reads once if the watch has not delivered one yet)."""
        with self._cond:
            snap = self._snapshot
        return snap if snap is not None else self.read()

    def wait_changed(self, seen: Snapshot, until: Deadline) -> bool:
        """Block until the published snapshot's content differs from `seen`, or `until` passes."""
        with self._cond:
            while _content(self._snapshot) == _content(seen):
                if until.expired():
                    return False
                self._cond.wait(until.remaining())
            return True

    def _publish(self, snap: Snapshot, started: float) -> None:
        """Publish the snapshot of a read begun at `started` (time.monotonic())."""
        with self._cond:
            if self._snapshot is not None and snap.revision < self._snapshot.revision:
                if started <= self._published_at:
                    return  # a concurrent read finished later with older data: keep the newer one
                # Begun after the newer one was read, and older: etcd went back (its data reset or restored from a
                # backup). Its revisions count from there on, so take it, and watch from its revision.
                log.warning("view: etcd's revision went back from %d to %d (its data was reset or restored?); "
                            "following it", self._snapshot.revision, snap.revision)
                self._watch_broken = True
                self._dirty.set()
            changed = _content(self._snapshot) != _content(snap)
            self._snapshot = snap
            self._published_at = time.monotonic()
            if changed:
                self._cond.notify_all()
        if changed and self.on_change is not None:
            try:
                self.on_change(snap)
            except Exception:  # noqa: BLE001 - a subscriber's failure must not stop the view
                log.warning("view: on_change subscriber failed", exc_info=True)

    # -- the watch thread ----------------------------------------------------------------------

    def start(self) -> RunView:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"elastic-view{self.prefix}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        watch_id = None
        while not self._stop.is_set():
            try:
                snap = self.read(deadline=timedelta(seconds=2))
                if self.degraded_since is not None:
                    seconds = round(time.monotonic() - self.degraded_since, 2)
                    emit("degraded", prefix=self.prefix, degraded=False, seconds=seconds)
                    self.degraded_since = None
                if self._watch_broken:
                    self._cancel(watch_id)
                    watch_id = None
                    self._watch_broken = False
                if watch_id is None:
                    watch_id = self._store.watch(self._on_event, start_revision=snap.revision + 1)
            except Exception as exc:  # noqa: BLE001 - thread boundary: stay degraded, retry
                if self.degraded_since is None:
                    self.degraded_since = time.monotonic()
                    log.warning("view: etcd unreachable; degraded mode: workers keep training on the last known "
                                "membership (%s)", exc)
                    emit("degraded", prefix=self.prefix, degraded=True, error=str(exc)[:200])
                self._cancel(watch_id)
                watch_id = None
            self._dirty.wait(self.RESYNC.total_seconds())
            self._dirty.clear()
        self._cancel(watch_id)

    def _on_event(self, error: Exception | None) -> None:
        if error is not None:
            log.debug("view: watch broke: %s", error)
            self._watch_broken = True
        self._dirty.set()

    def _cancel(self, watch_id: object) -> None:
        if watch_id is not None:
            try:
                self._store.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001 - a broken watch needs no cancelling
                log.debug("view: cancel_watch failed", exc_info=True)


def _content(snap: Snapshot | None) -> tuple[object, ...] | None:
    """What a snapshot says, without the read revision (which moves on every read)."""
    if snap is None:
        return None
    error = snap.state_error and str(snap.state_error)  # exceptions compare by identity; their text does not
    return (snap.state, snap.state_revision, snap.live, snap.nodes, snap.stores, error)
