"""`RunStore` on etcd v3: transactions on mod_revision, leases, one prefix watch.

The only module of the package that speaks the python-etcd3 API (besides `etcd_client.py`, which
connects). Every call goes through `EtcdClient.call`: transient failures are retried until a
deadline, then `EtcdUnavailableError` names the endpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from elastic.errors import LeaseGoneError
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.keys import RunKeys
from elastic.run_store import RunRead, WatchCallback

T = TypeVar("T")


class EtcdRunStore:
    """One run's keys on an etcd v3 cluster (see `elastic.run_store.RunStore`)."""

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self.client = client
        self._keys = keys

    @classmethod
    def connect(cls, config: EtcdClientConfig, keys: RunKeys) -> EtcdRunStore:
        return cls(EtcdClient(config), keys)

    @property
    def keys(self) -> RunKeys:
        return self._keys

    def read(self, *, deadline: timedelta | None = None) -> RunRead:
        raw, prefix = self.client.raw, self._keys.prefix
        response = self.client.call(lambda: raw.get_prefix_response(prefix), what=f"read {prefix}", deadline=deadline)
        return RunRead(kvs=list(response.kvs), revision=int(response.header.revision))

    def get(self, key: str) -> bytes | None:
        raw = self.client.raw
        value, _ = self.client.call(lambda: raw.get(key), what=f"read {key}")
        return None if value is None else bytes(value)

    def swap_state(self, doc: str, token: int, *, absent: Sequence[str] = (),
                   puts: Mapping[str, str] | None = None) -> bool:
        raw, key = self.client.raw, self._keys.state
        txn = raw.transactions
        guard = txn.version(key) == 0 if token == 0 else txn.mod(key) == token
        compare = [guard, *(txn.version(k) == 0 for k in absent)]
        success = [txn.put(key, doc), *(txn.put(k, v) for k, v in (puts or {}).items())]
        ok, _ = self.client.call(lambda: raw.transaction(compare=compare, success=success, failure=[]),
                                 what=f"update {key}")
        return bool(ok)

    def create(self, key: str, value: str, *, lease: int | None = None,
               absent: Sequence[str] = ()) -> tuple[bool, bytes | None]:
        raw = self.client.raw
        txn = raw.transactions
        compare = [txn.version(k) == 0 for k in (key, *absent)]
        put = txn.put(key, value, lease=lease) if lease else txn.put(key, value)
        ok, responses = self._under_lease(
            lambda: raw.transaction(compare=compare, success=[put], failure=[txn.get(key)]), lease,
            what=f"create {key}")
        if ok:
            return True, None
        found = responses[0] if responses else []
        return False, (bytes(found[0][0]) if found else None)

    def grant_lease(self, ttl: int) -> int:
        raw = self.client.raw
        lease = self.client.call(lambda: raw.lease(ttl), what=f"grant a {ttl}s lease")
        return int(lease.id)

    def refresh_lease(self, lease: int) -> bool:
        # One keep-alive round trip, not retried: the caller refreshes again within the TTL.
        raw = self.client.raw
        responses = self.client.once(lambda: list(raw.refresh_lease(lease)), what=f"refresh lease {lease:x}")
        return bool(responses) and responses[0].TTL > 0

    def revoke_lease(self, lease: int, *, deadline: timedelta | None = None) -> None:
        raw = self.client.raw
        try:
            self.client.call(lambda: raw.revoke_lease(lease), what=f"revoke lease {lease:x}", deadline=deadline)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it expired or was revoked already
                raise

    def publish_store(self, generation: int, record: str, lease: int) -> None:
        raw, key = self.client.raw, self._keys.store(generation)
        self._under_lease(lambda: raw.put(key, record, lease=lease), lease, what=f"publish {key}")

    def _under_lease(self, fn: Callable[[], T], lease: int | None, *, what: str) -> T:
        """`fn`, a write under `lease`, through `client.call`; LeaseGoneError when etcd no longer has the lease."""
        try:
            return self.client.call(fn, what=what)
        except grpc.RpcError as exc:
            if lease and exc.code() == grpc.StatusCode.NOT_FOUND:  # "requested lease not found"
                raise LeaseGoneError(f"etcd no longer has lease {lease:x} to {what} under") from exc
            raise

    def prune_stores(self, generation: int) -> None:
        raw = self.client.raw
        stale = [raw.transactions.delete(key) for key in self._keys.stale_stores(generation)]
        if stale:
            self.client.call(lambda: raw.transaction(compare=[], success=stale, failure=[]),
                             what="prune old store keys")

    def watch(self, on_event: WatchCallback, start_revision: int) -> object:
        def callback(response: Any) -> None:
            on_event(response if isinstance(response, Exception) else None)

        raw = self.client.raw
        return raw.add_watch_prefix_callback(self._keys.prefix, callback, start_revision=start_revision)

    def cancel_watch(self, handle: object) -> None:
        self.client.raw.cancel_watch(handle)

    def close(self) -> None:
        self.client.close()
