"""The `etcd-v3` rendezvous handler for torch.distributed.elastic (and so for torchrun and elastic-run).

This module is the thin I/O shell around the pure protocol in `elastic/round.py`:
read the run's keys, decide, compare-and-set on mod_revision, or wait on a watch, all under one
deadline. Once a round closes, the rank-0 node hosts a fresh TCPStore for the round and publishes
its address in etcd under its own lease; the agent and the workers use that store (torchrun's
`use_agent_store` contract), so worker scripts run unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from core.events import emit
from elastic import peer_loss
from elastic import round as protocol
from elastic.admission import Admission, load_join_token
from elastic.errors import (
    ElasticRendezvousClosedError,
    ElasticRendezvousTimeoutError,
    EtcdRecordError,
    EtcdUnavailableError,
    RunIdConflictError,
)
from elastic.etcd_client import EtcdClient, EtcdClientConfig, resolve_password
from elastic.liveness import Beacon, Monitor, listening_socket
from elastic.membership import Membership, MembershipConfig, run_prefix
from elastic.rdzv_settings import TORCH_KEYS, RendezvousSettings, parse_conf
from elastic.records import RunKeys
from elastic.view import RunView, Snapshot

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"


def validate_conf(conf: Mapping[str, object]) -> None:
    """Check every `--rdzv-conf` key and value of the etcd-v3 backend; ValueError names the key.

    An unknown key is an error that lists the known ones (`elastic.rdzv_settings.KNOWN_KEYS`).
    """
    parse_conf(conf)


@dataclass(frozen=True, kw_only=True)
class RendezvousConfig:
    run_id: str
    """The job's run id (`--rdzv-id`); runs with different ids never mix."""
    node_id: str
    """This agent's id (`--rdzv-conf node_id=`); default `<hostname>-<pid>-<random>`."""
    min_nodes: int
    """Fewest nodes a round may close with (`--nnodes MIN:MAX`)."""
    max_nodes: int
    """Most nodes in a round; more wait as spares."""
    local_addr: str
    """Address other nodes reach this node's TCPStore at (`--local-addr`)."""
    etcd: EtcdClientConfig
    """How to reach etcd (`--rdzv-endpoint` plus TLS/auth from `--rdzv-conf`)."""
    prefix: str = "elastic-train"
    """etcd key prefix shared by all runs (`--rdzv-conf prefix=`)."""
    lease_ttl: timedelta = timedelta(seconds=3)
    """Membership lease TTL (`--rdzv-conf lease_ttl=`)."""
    join_timeout: timedelta = timedelta(seconds=600)
    """Deadline for one rendezvous round (`--rdzv-conf join_timeout=`)."""
    last_call_timeout: timedelta = timedelta(seconds=30)
    """How long a round with >= min nodes waits for a live node that does not join (`last_call_timeout=`)."""
    bind_addr: str | None = None
    """Host this node's listening sockets (beacon, rank 0's TCPStore) bind to: `--local-addr` when given; None: all."""
    join_token: bytes | None = field(default=None, repr=False)
    """The run's join token (`$ELASTIC_JOIN_TOKEN` or `join_token_file=`); None: no admission (elastic/admission.py)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need 0 < min <= max")
        for name in ("lease_ttl", "join_timeout", "last_call_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def from_parameters(params: RendezvousParameters) -> RendezvousConfig:
        # The same parser as elastic-run's up-front check, so stock torchrun rejects the same mistakes.
        try:
            settings = parse_conf({k: v for k, v in params.config.items() if k not in TORCH_KEYS})
        except ValueError as exc:
            raise ValueError(f"--rdzv-conf: {exc}") from exc
        return RendezvousConfig.from_settings(params, settings)

    @staticmethod
    def from_settings(params: RendezvousParameters, settings: RendezvousSettings) -> RendezvousConfig:
        default_node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return RendezvousConfig(
            run_id=params.run_id,
            node_id=settings.node_id or default_node,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            local_addr=params.local_addr or socket.getfqdn(),
            etcd=EtcdClientConfig(
                endpoints=params.endpoint,
                ca_cert=settings.ca_cert,
                cert=settings.cert,
                key=settings.key,
                user=settings.user,
                password=resolve_password(settings.user, settings.password, settings.password_file),
                retry_deadline=settings.etcd_timeout,
            ),
            prefix=settings.prefix,
            lease_ttl=settings.lease_ttl,
            join_timeout=settings.join_timeout,
            last_call_timeout=settings.last_call_timeout,
            bind_addr=params.local_addr or None,
            join_token=load_join_token(settings.join_token_file),
        )


class EtcdV3RendezvousHandler(RendezvousHandler):
    """torch `RendezvousHandler` on etcd v3: leases, compare-and-set on mod_revision, watches."""

    def __init__(self, config: RendezvousConfig, client: EtcdClient | None = None) -> None:
        self.config = config
        # Under stock torchrun too, a worker that dies of a lost peer waits to be stopped (see
        # elastic/peer_loss.py), so torch's agent sees a membership change, not a failure that
        # consumes a restart. elastic-run's agent sets a value of its own from its monitor interval.
        os.environ.setdefault(peer_loss.ENV_GRACE, f"{config.lease_ttl.total_seconds() + 4:g}")
        self._client = client or EtcdClient(config.etcd)
        self._prefix = run_prefix(config.prefix, config.run_id)
        self.keys = RunKeys(self._prefix)
        self._state_key = self.keys.state
        self.admission = Admission(config.run_id, self.keys, config.join_token)
        self.view = RunView(self._client, self._prefix, admission=self.admission)
        self._beacon: Beacon | None = None
        self._monitor: Monitor | None = None
        self.membership = Membership(
            self._client,
            MembershipConfig(prefix=config.prefix, run_id=config.run_id, node_id=config.node_id, lease_ttl=config.lease_ttl),
            admission=self.admission,
        )
        self._completed_generation = 0
        """The round this node last took a rank in and ran (0: none)."""
        self._succeeded = False
        self._round: tuple[str, ...] = ()
        self._store_server: dist.TCPStore | None = None

    # -- RendezvousHandler -------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self.config.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        started = time.monotonic()
        deadline = started + self.config.join_timeout.total_seconds()
        self._start_membership()
        while True:
            done = self._join_round(deadline)
            try:
                store, addr, port = self._round_store(done, deadline)
                break
            except _RoundAbandoned as exc:
                log.warning("rendezvous: abandoning round %d: %s; joining the next one", done.generation, exc)
                self._completed_generation = done.generation
        self._completed_generation = done.generation
        self._round = done.participants
        emit("round_closed", run_id=self.config.run_id, node=self.config.node_id, generation=done.generation,
             rank=done.rank, world_size=done.world_size, participants=list(done.participants),
             rendezvous_s=round(time.monotonic() - started, 3))
        log.info(
            "rendezvous: node %s is rank %d of %d in round %d of run %s (%.2fs)",
            self.config.node_id, done.rank, done.world_size, done.generation, self.config.run_id, time.monotonic() - started,
        )
        return RendezvousInfo(store, done.rank, done.world_size, RendezvousStoreInfo(addr, port))

    def is_closed(self) -> bool:
        state = self.view.read().checked_state()
        return bool(state and state.shutdown)

    def set_closed(self) -> None:
        """Close the run for every agent (torch's API: an explicit operator decision)."""
        self._close_run(force=True)

    def mark_succeeded(self) -> None:
        """This node's workers finished the job: `shutdown()` may then close the run.

        elastic-run's agent calls it on success; stock torchrun does not, so under torchrun
        `shutdown()` only leaves the run.
        """
        self._succeeded = True

    def num_nodes_waiting(self) -> int:
        # Called by the agent every monitor interval while workers are healthy; answered from the
        # watch-fed view, without a round trip. A node lost from our round counts too: its peers
        # must restart now instead of hanging in a collective. While etcd is unreachable the view
        # keeps the last membership, so healthy workers keep training (degraded mode).
        try:
            snap = self.view.snapshot()
        except EtcdUnavailableError as exc:
            log.warning("rendezvous: etcd unreachable while workers are healthy; keeping them running (%s)", exc)
            return 0
        # A malformed state (the view warned, naming the key) leaves healthy workers running; a lost
        # member still counts, and the rendezvous that follows fails naming the key.
        return protocol.nodes_waiting(snap.state, self._knowledge(snap), self._round)

    @property
    def degraded(self) -> bool:
        """True while etcd cannot be reached (workers keep running on the last known membership)."""
        return self.view.degraded_since is not None

    def shutdown(self) -> bool:
        """Leave the run and unregister this node; close the run only after `mark_succeeded()`, and only
        if this node ran the run's newest round (a refused, duplicate, spare or timed-out agent never does)."""
        try:
            if self._succeeded:
                self._close_run(force=False)
            return True
        except Exception as exc:  # noqa: BLE001 - process boundary: the agent is exiting anyway
            log.warning("rendezvous: shutdown of run %s failed: %s", self.config.run_id, exc)
            return False
        finally:
            self._stop_membership()
            self._store_server = None
            self._client.close()

    # -- membership, liveness and the watch ------------------------------------------------------

    def _start_membership(self) -> None:
        if self._beacon is None:
            self.admission.enforce(self._client)  # before registering: a refused agent leaves no trace
            self._beacon = Beacon(self.config.bind_addr, advertise=self.config.local_addr)
            self._monitor = Monitor(self._peer_lost)
            self.view.on_change = self._track_peers
            self.membership.join({"addr": self.config.local_addr, "pid": os.getpid(), "beacon": self._beacon.address})
            emit("join", run_id=self.config.run_id, node=self.config.node_id)
            self.view.start()
        else:
            self.membership.join({"addr": self.config.local_addr, "pid": os.getpid(), "beacon": self._beacon.address})

    def _stop_membership(self) -> None:
        self.view.stop()
        if self._monitor is not None:
            self._monitor.close()
        self.membership.leave()
        if self._beacon is not None:
            self._beacon.close()
        emit("leave", run_id=self.config.run_id, node=self.config.node_id, reason="shutdown")

    def _track_peers(self, snap: Snapshot) -> None:
        if self._monitor is not None:
            self._monitor.track({n: r.beacon for n, r in snap.nodes.items()
                                 if n != self.config.node_id and r.beacon})

    def _peer_lost(self, node: str) -> None:
        # The peer's agent process is gone: revoke its lease now instead of waiting out the TTL.
        record = self.view.snapshot().nodes.get(node)
        lease_id = record.lease_id if record else 0
        if lease_id:
            try:
                self._client.call(lambda: self._client.raw.revoke_lease(lease_id), what=f"revoke the lease of {node}",
                                  deadline=timedelta(seconds=3))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it already expired or left
                    raise
        emit("leave", run_id=self.config.run_id, node=node, reported_by=self.config.node_id, reason="agent process gone")

    # -- protocol loop -------------------------------------------------------------------------

    def _knowledge(self, snap: Snapshot, last_call_expired: bool = False) -> protocol.Knowledge:
        return protocol.Knowledge(
            node_id=self.config.node_id,
            live=snap.live,
            min_nodes=self.config.min_nodes,
            max_nodes=self.config.max_nodes,
            completed_generation=self._completed_generation,
            last_call_expired=last_call_expired,
        )

    def _join_round(self, deadline: float) -> protocol.Done:
        last_call_at: float | None = None
        last_call_generation = -1
        last_reason = ""
        while True:
            snap = self.view.read()
            state = snap.checked_state()  # a malformed state fails the rendezvous, naming the key
            now = time.monotonic()
            expired = last_call_at is not None and now >= last_call_at
            decision = protocol.decide(state, self._knowledge(snap, expired))
            if isinstance(decision, protocol.Done):
                return decision
            if isinstance(decision, protocol.Closed):
                raise ElasticRendezvousClosedError(
                    f"run {self.config.run_id!r} is closed: its job finished or was shut down. Start a new job with a new --rdzv-id."
                )
            if isinstance(decision, protocol.Conflict):
                raise RunIdConflictError(
                    f"run id {self.config.run_id!r}: {decision.reason}. Every agent of one job must use the same "
                    "--nnodes; a different job needs its own --rdzv-id."
                )
            if isinstance(decision, protocol.Write):
                if self._compare_and_set(decision.state, snap.state_revision):
                    log.info("rendezvous: %s", decision.why)
                    took = protocol.taken(decision.state, self.config.node_id)
                    if took is not None:
                        return took
                continue
            last_reason = decision.reason
            generation = state.generation if state else 0
            if decision.last_call_armed and (last_call_at is None or generation != last_call_generation):
                last_call_at = now + self.config.last_call_timeout.total_seconds()
                last_call_generation = generation
            elif not decision.last_call_armed:
                last_call_at = None
            if now >= deadline:
                raise ElasticRendezvousTimeoutError(
                    f"rendezvous of run {self.config.run_id!r} did not complete within "
                    f"{self.config.join_timeout.total_seconds():.0f}s: {last_reason}. Live nodes: {sorted(snap.live)}. "
                    "Are the other agents running with the same --rdzv-endpoint and --rdzv-id?"
                )
            wake = min(deadline, last_call_at) if last_call_at is not None else deadline
            self.view.wait_changed(snap, max(0.0, wake - now))

    def _compare_and_set(self, state: protocol.RoundState, expected_revision: int) -> bool:
        raw = self._client.raw
        txn = raw.transactions
        guard = txn.version(self._state_key) == 0 if expected_revision == 0 else txn.mod(self._state_key) == expected_revision
        doc = state.to_json()
        ok, _ = self._client.call(
            lambda: raw.transaction(compare=[guard, *self.admission.compares(txn)],
                                    success=[txn.put(self._state_key, doc), *self.admission.state_puts(txn, doc)], failure=[]),
            what=f"update {self._state_key}",
        )
        return bool(ok)

    # -- the round's store ---------------------------------------------------------------------

    def _round_store(self, done: protocol.Done, deadline: float) -> tuple[dist.Store, str, int]:
        key = self.keys.store(done.generation)
        timeout = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        if done.rank == 0:
            # A fresh TCPStore per round: keys of an earlier round can never leak into this one.
            server = self._store_server_socket(timeout)
            self._store_server = server
            addr, port = self.config.local_addr, int(server.port)
            raw = self._client.raw
            lease = self.membership._lease  # noqa: SLF001 - the address dies with rank 0's lease
            record = json.dumps(self.admission.sign_store(done.generation, addr, port))
            self._client.call(lambda: raw.put(key, record, lease=lease), what=f"publish {key}")
            self._prune_stores(done.generation)
            return server, addr, port
        self._store_server = None
        while True:
            snap = self.view.read()
            published = snap.stores.get(done.generation)
            if published is not None:
                addr, port = published.addr, published.port
                return dist.TCPStore(addr, port, is_master=False, timeout=timeout), addr, port
            if done.participants[0] not in snap.live:
                raise _RoundAbandoned(f"its rank 0 ({done.participants[0]}) left before publishing the round's store")
            if time.monotonic() >= deadline:
                raise ElasticRendezvousTimeoutError(
                    f"rank 0 of round {done.generation} ({done.participants[0]}) did not publish its store at {key} in time"
                )
            self.view.wait_changed(snap, deadline - time.monotonic())

    def _store_server_socket(self, timeout: timedelta) -> dist.TCPStore:
        # torch's TCPStore server listens on all interfaces, whatever host it is given. Handed a
        # socket already bound to --local-addr (master_listen_fd), it listens there only.
        if self.config.bind_addr is None:
            return dist.TCPStore(self.config.local_addr, 0, is_master=True, wait_for_workers=False, timeout=timeout,
                                 multi_tenant=True)
        sock = listening_socket(self.config.bind_addr)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the descriptor from here on and closes it
        try:
            return dist.TCPStore(self.config.bind_addr, port, is_master=True, wait_for_workers=False, timeout=timeout,
                                 multi_tenant=True, master_listen_fd=fd)
        except Exception:
            os.close(fd)
            raise

    def _prune_stores(self, generation: int) -> None:
        raw = self._client.raw
        stale = [raw.transactions.delete(self.keys.store(g)) for g in range(max(1, generation - 8), generation)]
        if stale:
            self._client.call(lambda: raw.transaction(compare=[], success=stale, failure=[]), what="prune old store keys")

    def _close_run(self, *, force: bool) -> None:
        """Mark the run shut down. Unless `force`, only if this node may (`protocol.may_close`)."""
        for _ in range(20):  # each failed compare-and-set means another writer moved on; re-read
            snap = self.view.read(deadline=timedelta(seconds=3))
            try:
                state = snap.checked_state()
            except EtcdRecordError as exc:
                if not force:
                    log.warning("rendezvous: leaving run %s open: %s", self.config.run_id, exc)
                    return
                state = None  # an explicit close replaces the malformed document
            if state is not None and state.shutdown:
                return
            if not force and not protocol.may_close(state, self.config.node_id, self._completed_generation):
                log.info("rendezvous: node %s leaves run %s open: it did not run the run's newest round",
                         self.config.node_id, self.config.run_id)
                return
            base = state or protocol.RoundState(generation=0, status="closed", participants=())
            if self._compare_and_set(dataclasses.replace(base, shutdown=True), snap.state_revision):
                log.info("rendezvous: run %s closed", self.config.run_id)
                return
        log.warning("rendezvous: could not close run %s: its state kept changing", self.config.run_id)


class _RoundAbandoned(Exception):
    """The closed round this node was placed in can never start; join the next one."""


def create_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """The creator torch's rendezvous registry calls for `--rdzv-backend etcd-v3`."""
    return EtcdV3RendezvousHandler(RendezvousConfig.from_parameters(params))


def register() -> None:
    """Register `etcd-v3` in this process's torch rendezvous registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
    except ValueError:
        pass  # already registered, e.g. through the entry point
