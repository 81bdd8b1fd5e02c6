"""Node membership over a `RunStore` (etcd v3): one leased key per live agent.

An agent registers `RunKeys.node(node_id)` (`elastic/keys.py`) under a lease and a keep-alive thread holds
the lease. When the agent dies, the lease expires and etcd deletes the key, so "who is alive" is a
range read (or a watch) away, never a guess based on timeouts of collectives. In a run with a join
token the record carries this node's proof of the token (`elastic/admission.py`), bound to the lease.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from elastic.admission import Admission
from elastic.errors import NodeIdConflictError
from elastic.keys import DEFAULT_PREFIX, run_prefix
from elastic.run_store import RunStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MembershipConfig:
    prefix: str = DEFAULT_PREFIX
    """Top-level etcd key prefix shared by all runs."""
    run_id: str
    """The job's run id (`--rdzv-id`)."""
    node_id: str
    """This agent's id, unique among the run's live agents."""
    lease_ttl: timedelta = timedelta(seconds=3)
    """Lease time-to-live: how long after an agent dies its peers learn of it."""

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise ValueError(f"run id {self.run_id!r} must be non-empty and contain no '/'")
        if not self.node_id or "/" in self.node_id:
            raise ValueError(f"node id {self.node_id!r} must be non-empty and contain no '/'")
        if self.lease_ttl < timedelta(seconds=1):
            raise ValueError(f"lease_ttl must be at least 1s (etcd leases count whole seconds), got {self.lease_ttl}")


class Membership:
    """Registers this node under a lease and reports the run's live nodes."""

    def __init__(self, store: RunStore, config: MembershipConfig, admission: Admission | None = None) -> None:
        if store.keys.prefix != run_prefix(config.prefix, config.run_id):
            raise ValueError(f"membership of run {config.run_id!r} given the store of {store.keys.prefix}")
        self._store = store
        self.config = config
        self._admission = admission
        self.key = store.keys.node(config.node_id)
        self._lease: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._unsure_until = 0.0  # time.monotonic(): till then the run's live set may lack nodes that are alive

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def lease_id(self) -> int | None:
        """The lease this node's record lives under; None while not registered. What rank 0 publishes
        the round's store address under, so the address dies with its node."""
        return self._lease

    def join(self, info: dict[str, object] | None = None) -> None:
        """Register under a fresh lease and start the keep-alive thread. Idempotent."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._register(info or {})
            self._stop.clear()
            self._thread = threading.Thread(target=self._keep_alive, name=f"elastic-lease-{self.node_id}", daemon=True)
            self._thread.start()

    def _register(self, info: dict[str, object]) -> None:
        ttl = max(1, math.ceil(self.config.lease_ttl.total_seconds()))
        lease = self._store.grant_lease(ttl)
        doc: dict[str, object] = {"node_id": self.node_id, "joined_at": time.time(), **info}
        if self._admission is not None:
            doc = self._admission.sign_node(doc, lease)
        value = json.dumps(doc)
        ok, current = self._store.create(self.key, value, lease=lease)
        if not ok and current == value.encode():
            ok = True  # our own write, retried after its answer was lost (etcd restarting, say)
        if not ok:
            self._store.revoke_lease(lease)
            raise NodeIdConflictError(
                f"node id {self.node_id!r} is already registered at {self.key}, under a lease that is still live: "
                "another agent runs with this node id, or one that ended less than a lease TTL ago. Give each agent "
                "a unique node id (--rdzv-conf node_id=...), or wait "
                f"{self.config.lease_ttl.total_seconds():.0f}s for the old agent's lease to expire."
            )
        self._lease = lease
        self._info = info
        log.info("membership: joined as %s (lease %x, ttl %ss)", self.key, lease, ttl)

    def _keep_alive(self) -> None:
        # Refresh at a third of the TTL so two lost refreshes in a row still keep the lease.
        interval = self.config.lease_ttl.total_seconds() / 3
        failing = 0  # refreshes failed in a row: the first is a warning, the rest of the outage debug lines
        while not self._stop.wait(interval):
            lease = self._lease
            if lease is None:
                continue
            try:
                if not self._store.refresh_lease(lease):
                    log.warning("membership: lease of %s expired; registering again", self.key)
                    self.register_again(lease)
                if failing:
                    log.info("membership: the lease of %s is refreshed again, after %d failed tries", self.key,
                             failing)
                    # The peers reach etcd again at their own next refresh (a third of the TTL, plus up to a
                    # second to reconnect: etcd_client._CHANNEL_OPTIONS); one whose lease lapsed meanwhile is
                    # missing from the live set until then, though alive.
                    self._doubt(extra=interval + 1.0)
                failing = 0
            except NodeIdConflictError:
                log.error("membership: %s was taken by another agent; giving up the keep-alive", self.key)
                return
            except Exception as exc:  # noqa: BLE001 - thread boundary: log and keep trying
                self._doubt()
                (log.debug if failing else log.warning)(
                    "membership: refreshing the lease of %s failed: %s (tried again every %.1fs)", self.key, exc,
                    interval)
                failing += 1

    def register_again(self, lost: int) -> None:
        """Register under a fresh lease, unless that was done since `lost` (this node's lease, which etcd no longer
        has) was found gone: by the keep-alive, or by a rendezvous that could not publish under it."""
        with self._lock:
            if self._lease != lost or self._stop.is_set():
                return
            # The others' leases may have lapsed with this one (etcd paused or restored). Doubted before the key is
            # back: a rendezvous woken by its write must not judge the live set in between.
            self._doubt()
            self._register(self._info)

    def _doubt(self, extra: float = 0.0) -> None:
        until = time.monotonic() + self.config.lease_ttl.total_seconds() + extra
        self._unsure_until = max(self._unsure_until, until)

    def unsure_for(self) -> float:
        """Seconds until a live set can judge again (0: it can now, if this node is in it)."""
        return max(0.0, self._unsure_until - time.monotonic())

    def live_set_settled(self, live: frozenset[str]) -> bool:
        """Whether a live set read now can say that nodes are gone: this node is in it, and no refresh failed nor
        was this node's lease renewed within the last lease TTL. After etcd was unreachable past the TTL (paused,
        restarted) every node's lease lapsed at once; each registers again at its next refresh (a third of the
        TTL), so for one TTL a live set lacks nodes that are alive."""
        return self.node_id in live and time.monotonic() >= self._unsure_until

    def live_nodes(self) -> list[str]:
        """Node ids with a live lease, in registration order (by creation revision)."""
        keys = self._store.keys
        items = [kv for kv in self._store.read().kvs if keys.node_id(kv.key.decode())]
        items.sort(key=lambda kv: kv.create_revision)
        return [str(keys.node_id(kv.key.decode())) for kv in items]

    def leave(self) -> None:
        """Stop the keep-alive and revoke the lease, so peers see this node leave at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        # Not while the keep-alive or a rendezvous registers again (register_again): its new lease is revoked too.
        locked = self._lock.acquire(timeout=15)
        try:
            lease, self._lease = self._lease, None
        finally:
            if locked:
                self._lock.release()
        if lease is not None:
            try:
                self._store.revoke_lease(lease, deadline=timedelta(seconds=3))
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own within the TTL
                log.warning("membership: could not revoke the lease of %s (%s); it expires within the TTL",
                            self.key, exc)
