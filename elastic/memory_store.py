"""`RunStore` in memory: the fake the contract suite holds to etcd's behaviour, for tests that need
a rendezvous, a membership or a view without an etcd process.

Revisions, leases and watches work as etcd's do: every write bumps one revision counter, a key
under a lease goes when the lease is revoked or its TTL passes on the injected clock (checked on
every call, as etcd's own expiry is seen only on the next read or event), and watchers are called
after each change. Handlers in several threads may share one store, as agents share one etcd;
`close()` therefore releases nothing. `unavailable = True` makes every call fail as an unreachable
etcd does.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from core.deadline import Clock
from elastic.errors import EtcdUnavailableError, LeaseGoneError
from elastic.keys import RunKeys
from elastic.run_store import RunRead, WatchCallback


@dataclass(frozen=True)
class Entry:
    key: bytes
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


class MemoryRunStore:
    """One run's keys in memory (see `elastic.run_store.RunStore`)."""

    def __init__(self, keys: RunKeys, *, clock: Clock = time.monotonic) -> None:
        self._keys = keys
        self._clock = clock
        self._lock = threading.Lock()
        self._data: dict[str, Entry] = {}
        self._revision = 1
        self._leases: dict[int, tuple[int, float]] = {}
        """lease id -> (ttl, expires at on the clock)."""
        self._lease_ids = itertools.count(0x1000)
        self._watches: dict[int, WatchCallback] = {}
        self._watch_ids = itertools.count(1)
        self.unavailable = False

    @property
    def keys(self) -> RunKeys:
        return self._keys

    # -- reads ---------------------------------------------------------------------------------

    def read(self, *, deadline: timedelta | None = None) -> RunRead:
        with self._locked() as changed:
            kvs = [e for k, e in sorted(self._data.items()) if k.startswith(self._keys.prefix)]
            revision = self._revision
        self._notify(changed)
        return RunRead(kvs=kvs, revision=revision)

    def get(self, key: str) -> bytes | None:
        with self._locked() as changed:
            entry = self._data.get(key)
        self._notify(changed)
        return None if entry is None else entry.value

    # -- writes --------------------------------------------------------------------------------

    def swap_state(self, doc: str, token: int, *, absent: Sequence[str] = (),
                   puts: Mapping[str, str] | None = None) -> bool:
        with self._locked() as changed:
            current = self._data.get(self._keys.state)
            ok = (current.mod_revision if current else 0) == token and not any(k in self._data for k in absent)
            if ok:
                self._revision += 1
                for key, value in {self._keys.state: doc, **(puts or {})}.items():
                    self._put(key, value, 0)
                changed.append(True)
        self._notify(changed)
        return ok

    def create(self, key: str, value: str, *, lease: int | None = None,
               absent: Sequence[str] = ()) -> tuple[bool, bytes | None]:
        with self._locked() as changed:
            if key in self._data or any(k in self._data for k in absent):
                entry = self._data.get(key)
                result = (False, None if entry is None else entry.value)
            else:
                self._check_lease(lease)
                self._revision += 1
                self._put(key, value, lease or 0)
                changed.append(True)
                result = (True, None)
        self._notify(changed)
        return result

    def publish_store(self, generation: int, record: str, lease: int) -> None:
        with self._locked() as changed:
            self._check_lease(lease)
            self._revision += 1
            self._put(self._keys.store(generation), record, lease)
            changed.append(True)
        self._notify(changed)

    def prune_stores(self, generation: int) -> None:
        with self._locked() as changed:
            stale = [k for k in self._keys.stale_stores(generation) if k in self._data]
            if stale:
                self._revision += 1
                for key in stale:
                    del self._data[key]
                changed.append(True)
        self._notify(changed)

    # -- leases --------------------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        with self._locked() as changed:
            lease = next(self._lease_ids)
            self._leases[lease] = (ttl, self._clock() + ttl)
        self._notify(changed)
        return lease

    def refresh_lease(self, lease: int) -> bool:
        with self._locked() as changed:
            found = self._leases.get(lease)
            if found is not None:
                self._leases[lease] = (found[0], self._clock() + found[0])
        self._notify(changed)
        return found is not None

    def revoke_lease(self, lease: int, *, deadline: timedelta | None = None) -> None:
        with self._locked() as changed:
            if self._leases.pop(lease, None) is not None and self._drop_leased({lease}):
                changed.append(True)
        self._notify(changed)

    # -- watches -------------------------------------------------------------------------------

    def watch(self, on_event: WatchCallback, start_revision: int) -> object:
        with self._locked() as changed:
            handle = next(self._watch_ids)
            self._watches[handle] = on_event
            missed = self._revision >= start_revision  # etcd replays what happened since then
        self._notify(changed)
        if missed:
            on_event(None)
        return handle

    def cancel_watch(self, handle: object) -> None:
        with self._lock:
            self._watches.pop(handle, None)  # type: ignore[call-overload]

    def close(self) -> None:
        pass  # shared by every handler of the test, as one etcd is

    # -- internals -----------------------------------------------------------------------------

    def _locked(self) -> _Locked:
        if self.unavailable:
            raise EtcdUnavailableError("the in-memory run store is marked unavailable (a simulated etcd outage)",
                                       transient=True)
        return _Locked(self)

    def _check_lease(self, lease: int | None) -> None:
        if lease and lease not in self._leases:
            raise LeaseGoneError(f"lease {lease:x} does not exist (it expired or was revoked)")

    def _put(self, key: str, value: str, lease: int) -> None:
        old = self._data.get(key)
        entry = Entry(key.encode(), value.encode(), lease, self._revision, self._revision)
        self._data[key] = replace(entry, create_revision=old.create_revision) if old else entry

    def _drop_leased(self, leases: set[int]) -> bool:
        gone = [k for k, e in self._data.items() if e.lease in leases]
        if gone:
            self._revision += 1
            for key in gone:
                del self._data[key]
        return bool(gone)

    def _expire(self) -> bool:
        now = self._clock()
        expired = {lease for lease, (_, at) in self._leases.items() if at <= now}
        for lease in expired:
            del self._leases[lease]
        return bool(expired) and self._drop_leased(expired)

    def _notify(self, changed: list[bool]) -> None:
        if changed:
            with self._lock:
                watchers = list(self._watches.values())
            for on_event in watchers:  # outside the lock: a watcher may read the store again
                on_event(None)


class _Locked:
    """The store's lock, with expired leases swept first; collects whether anything changed."""

    def __init__(self, store: MemoryRunStore) -> None:
        self._store = store
        self.changed: list[bool] = []

    def __enter__(self) -> list[bool]:
        self._store._lock.acquire()  # noqa: SLF001 - the store's own helper
        if self._store._expire():  # noqa: SLF001
            self.changed.append(True)
        return self.changed

    def __exit__(self, *exc: object) -> None:
        self._store._lock.release()  # noqa: SLF001
