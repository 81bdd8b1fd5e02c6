"""`RunStore`: the small backend the rendezvous, the membership, the view and the admission check
run over: one run's keys (`elastic/keys.py`), leases, and a watch.

Everything in this package that touches etcd goes through this interface, so the protocol code
never speaks etcd's API and one contract suite (tests/integration/test_runstore_contract.py) holds
both implementations to the same behaviour:

- `elastic.etcd_store.EtcdRunStore`: etcd v3 (transactions on mod_revision, leases, prefix watches),
  every call retried on transient failures until a deadline (`elastic.etcd_client`);
- `elastic.memory_store.MemoryRunStore`: an in-memory fake with an injectable clock, for tests.

The round state is compare-and-set on a token: the state key's revision of the last write
(`RunRecords.state_revision`), 0 while the key does not exist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from elastic.keys import RunKeys
from elastic.records import KeyValue

WatchCallback = Callable[[Exception | None], None]
"""Called (from the store's thread) after a change under the run prefix; with an exception when the
watch broke (then the caller re-reads and watches again)."""


class StoredValue(KeyValue, Protocol):
    """A stored key with its metadata (etcd's `KeyValue`)."""

    @property
    def create_revision(self) -> int: ...


@dataclass(frozen=True)
class RunRead:
    """Every key under the run prefix, read at one revision."""

    kvs: Sequence[StoredValue]
    revision: int
    """The store's revision at the time of the read: reads are ordered by it."""


class RunStore(Protocol):
    """One run's keys, leases and watch. A `deadline` bounds the retries of one call (None: the default)."""

    @property
    def keys(self) -> RunKeys:
        """The run's key layout."""
        ...

    def read(self, *, deadline: timedelta | None = None) -> RunRead:
        """A linearizable read of every key under the run prefix."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value of one key, None if it does not exist."""
        ...

    def swap_state(self, doc: str, token: int, *, absent: Sequence[str] = (),
                   puts: Mapping[str, str] | None = None) -> bool:
        """Write the round state `doc` if the state key is still at `token` (0: it must not exist) and
        every key of `absent` is missing; `puts` are written in the same transaction. False: lost the race."""
        ...

    def create(self, key: str, value: str, *, lease: int | None = None,
               absent: Sequence[str] = ()) -> tuple[bool, bytes | None]:
        """Put `key` if neither it nor any key of `absent` exists (under `lease`, if given).

        Returns (True, None) when written; else (False, the current value of `key`, None if missing). Raises
        LeaseGoneError when the store no longer has `lease`."""
        ...

    def grant_lease(self, ttl: int) -> int:
        """A new lease of `ttl` whole seconds; returns its id."""
        ...

    def refresh_lease(self, lease: int) -> bool:
        """Keep `lease` alive for another TTL. False: it expired or was revoked (its keys are gone)."""
        ...

    def revoke_lease(self, lease: int, *, deadline: timedelta | None = None) -> None:
        """End `lease` now and delete its keys. A lease that is already gone is no error."""
        ...

    def publish_store(self, generation: int, record: str, lease: int) -> None:
        """Put round `generation`'s store address under `lease` (it dies with its publisher). Raises
        LeaseGoneError when the store no longer has `lease`."""
        ...

    def prune_stores(self, generation: int) -> None:
        """Delete the store keys of the rounds before `generation` (`RunKeys.stale_stores`)."""
        ...

    def watch(self, on_event: WatchCallback, start_revision: int) -> object:
        """Call `on_event` after every change under the run prefix from `start_revision` on; returns a handle."""
        ...

    def cancel_watch(self, handle: object) -> None:
        ...

    def close(self) -> None:
        """Release the connection. The store is not used after this."""
        ...
