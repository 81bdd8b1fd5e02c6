"""The `etcd-v3` rendezvous handler for torch.distributed.elastic (and so for torchrun and elastic-run).

This module is the thin I/O shell around the pure protocol in `elastic/round.py`:
read the run's keys, decide, compare-and-set the round state on its token, or wait on a watch, all
under one deadline. It speaks to a `RunStore` (`elastic/run_store.py`: etcd v3 in production, an
in-memory fake in tests), never to etcd itself.

Once a round closes, the rank-0 node hosts a fresh TCPStore for the round and publishes its address
in the store under its own lease; the agent and the workers use that TCPStore (torchrun's
`use_agent_store` contract), so worker scripts run unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_random_exponential
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from core.deadline import Clock, Deadline
from core.events import emit
from elastic import peer_loss
from elastic import round as protocol
from elastic.admission import Admission
from elastic.errors import (
    BelowMinimumError,
    ElasticRendezvousClosedError,
    ElasticRendezvousTimeoutError,
    EtcdRecordError,
    EtcdUnavailableError,
    LeaseGoneError,
    RunIdConflictError,
)
from elastic.etcd_store import EtcdRunStore
from elastic.keys import RunKeys
from elastic.liveness import Beacon, Monitor, listening_socket
from elastic.membership import Membership, MembershipConfig
from elastic.rdzv_config import RendezvousConfig
from elastic.rdzv_settings import parse_conf
from elastic.run_store import RunStore
from elastic.view import RunView, Snapshot

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"


def validate_conf(conf: Mapping[str, object]) -> None:
    """Check every `--rdzv-conf` key and value of the etcd-v3 backend; ValueError names the key.

    An unknown key is an error that lists the known ones (`elastic.rdzv_settings.KNOWN_KEYS`).
    """
    parse_conf(conf)


class EtcdV3RendezvousHandler(RendezvousHandler):
    """torch `RendezvousHandler` over a `RunStore` (etcd v3 unless another store is given).

    Besides torch's API it answers what elastic-run's agent asks (`agent.RoundAware`): `node_id`,
    `round_members`, `generation`, `degraded` and `lease_ttl`. `clock` times the join and last-call
    deadlines (tests pass a fake one).
    """

    def __init__(self, config: RendezvousConfig, store: RunStore | None = None, *,
                 clock: Clock = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        # Under stock torchrun too, a worker that dies of a lost peer waits to be stopped (see
        # elastic/peer_loss.py), so torch's agent sees a membership change, not a failure that
        # consumes a restart. elastic-run's agent sets a value of its own from its monitor interval.
        os.environ.setdefault(peer_loss.ENV_GRACE, f"{config.lease_ttl.total_seconds() + 4:g}")
        self.keys = RunKeys.of(config.run_id, config.prefix)
        self._store = store or EtcdRunStore.connect(config.etcd, self.keys)
        self.admission = Admission(config.run_id, self.keys, config.join_token)
        self.view = RunView(self._store, admission=self.admission)
        self._beacon: Beacon | None = None
        self._monitor: Monitor | None = None
        self.membership = Membership(
            self._store,
            MembershipConfig(prefix=config.prefix, run_id=config.run_id, node_id=config.node_id,
                             lease_ttl=config.lease_ttl),
            admission=self.admission,
        )
        self._completed_generation = 0
        """The round this node last took a rank in and ran (0: none)."""
        self._ran_round = False
        """This node took its rank in a round with a store: the job ran (an abandoned round does not count)."""
        self._stop_below_min = False
        """`stop_below_minimum` was called: a later round with fewer than MIN live nodes raises at once."""
        self._succeeded = False
        self._round: tuple[str, ...] = ()
        self._dead_agents: set[str] = set()
        """Peers whose beacon closed without saying LEAVING since this node's rendezvous began (liveness.Monitor):
        what tells this node of a lost member while etcd cannot, its lease not yet revoked (an outage)."""
        self._store_server: dist.TCPStore | None = None
        self._store_server_round = 0
        """The round `_store_server` serves: a retry of that round's store (after an outage) reuses it, since peers
        may have connected to the address already published."""
        self._joined_at = 0.0
        self._advertised: dict[str, str] = {}

    # -- RendezvousHandler -------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self.config.run_id

    # -- what elastic-run's agent reads (agent.RoundAware) ----------------------------------------

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def round_members(self) -> tuple[str, ...]:
        """Node ids of the round this node last took a rank in, in rank order (empty: none yet)."""
        return self._round

    @property
    def generation(self) -> int:
        """The round this node last took a rank in and ran (0: none)."""
        return self._completed_generation

    @property
    def lease_ttl(self) -> timedelta:
        """How soon after a node dies its peers learn of it (its membership lease TTL)."""
        return self.config.lease_ttl

    @property
    def join_timeout(self) -> timedelta:
        """The longest one rendezvous waits (for its peers, or for etcd to answer again)."""
        return self.config.join_timeout

    @property
    def bind_addr(self) -> str | None:
        """The address this node's listeners bind (`--local-addr`; None: every interface)."""
        return self.config.bind_addr

    @property
    def replica_key(self) -> bytes | None:
        """The key of this run's tier-0 replica pushes (elastic/admission.py); None in a run without a join token."""
        return self.admission.replica_key()

    def advertise(self, key: str, port: int) -> str:
        """Put `key`: "<local addr>:<port>" in this node's membership record (from its next registration
        on: call before the first rendezvous) for its peers to read (`advertised`). Returns the address."""
        if key in {"addr", "pid", "beacon", "since"}:
            raise ValueError(f"{key!r} is a field of the membership record itself")
        self._advertised[key] = f"{self.config.local_addr}:{port}"
        return self._advertised[key]

    def advertised(self, key: str) -> dict[str, str]:
        """Node id -> the address each registered node advertises under `key` (nodes without one left out)."""
        found: dict[str, str] = {}
        for node, record in self.view.snapshot().nodes.items():
            value = record.doc.get(key)
            if isinstance(value, str) and value:
                found[node] = value
        return found

    # -- RendezvousHandler, continued ------------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        started = self._clock()
        deadline = Deadline.after(self.config.join_timeout, clock=self._clock)
        dead_before = set(self._dead_agents)  # losses of the rounds before; one during this rendezvous still counts
        try:
            for attempt in self._through_etcd_outage(deadline):
                with attempt:
                    self._start_membership()
            while True:
                try:
                    for attempt in self._through_etcd_outage(deadline):
                        with attempt:
                            # After an outage the write that took this node's rank may have landed unseen: that
                            # round is this node's to run (its peers count on it), not a stale one to leave.
                            again = attempt.retry_state.attempt_number > 1
                            done = (again and self._taken_meanwhile()) or self._join_round(deadline)
                    for attempt in self._through_etcd_outage(deadline):
                        with attempt:  # the rank is taken: only the store is retried, never the round
                            store, addr, port = self._round_store(done, deadline)
                    break
                except _RoundAbandoned as exc:
                    log.warning("rendezvous: abandoning round %d: %s; joining the next one", done.generation, exc)
                    self._completed_generation = done.generation
        except EtcdUnavailableError as exc:
            if not self._ran_round:
                raise
            raise EtcdUnavailableError(
                f"{exc} (the rendezvous after a failure or a membership change waited for etcd for "
                f"--rdzv-conf join_timeout={self.config.join_timeout.total_seconds():.0f}s)") from exc
        self._completed_generation = done.generation
        self._ran_round = True
        self._round = done.participants
        self._dead_agents -= dead_before
        emit("round_closed", run_id=self.config.run_id, node=self.config.node_id, generation=done.generation,
             rank=done.rank, world_size=done.world_size, participants=list(done.participants),
             rendezvous_s=round(self._clock() - started, 3))
        log.info(
            "rendezvous: node %s is rank %d of %d in round %d of run %s (%.2fs)",
            self.config.node_id, done.rank, done.world_size, done.generation, self.config.run_id,
            self._clock() - started,
        )
        return RendezvousInfo(store, done.rank, done.world_size, RendezvousStoreInfo(addr, port))

    def _taken_meanwhile(self) -> protocol.Done | None:
        """The round this node took a rank in, if the state says so (a write that etcd committed although its
        answer was lost in an outage); None otherwise."""
        state = self.view.read().checked_state()
        if state is None or state.generation <= self._completed_generation:
            return None
        return protocol.taken(state, self.config.node_id)

    def _through_etcd_outage(self, deadline: Deadline) -> Retrying:
        """Attempts at a rendezvous step that retry while etcd is unreachable, once this node has run a round:
        the group restarting after a failure (or re-forming after a membership change) while etcd is down waits
        for it until the join deadline (README, "etcd faults"), as degraded mode lets healthy workers train on
        meanwhile. At the job's start an unreachable etcd still fails after one call's etcd_timeout: a wrong
        --rdzv-endpoint is reported in seconds, not after join_timeout."""
        warned = False

        def wait_out(exc: BaseException) -> bool:  # an outage, not a refusal (credentials, NOSPACE): retry those never
            return (isinstance(exc, EtcdUnavailableError) and exc.transient and self._ran_round
                    and not deadline.expired())

        def before_sleep(state: RetryCallState) -> None:
            nonlocal warned
            failure = state.outcome.exception() if state.outcome is not None else None
            (log.debug if warned else log.warning)(
                "rendezvous: %s; waiting for etcd (%.0fs left of join_timeout)", failure, deadline.remaining() or 0.0)
            warned = True

        return Retrying(retry=retry_if_exception(wait_out), stop=lambda _: deadline.expired(),
                        wait=wait_random_exponential(multiplier=0.25, max=3.0), before_sleep=before_sleep,
                        reraise=True)

    def stop_below_minimum(self) -> None:
        """From now on, once this node has run a round, a later round raises BelowMinimumError as soon as fewer
        than --nnodes MIN nodes are live, instead of waiting up to join_timeout for nodes to come back (elastic-run's
        agent: it has its workers persist and stops the job with exit 75). Stock torchrun keeps waiting: nothing
        there would persist the workers' state, and a replacement may still come."""
        self._stop_below_min = True

    def below_minimum(self) -> tuple[int, int] | None:
        """(live nodes, --nnodes MIN) when fewer nodes of the run are alive than a round needs, else None."""
        try:
            live = self.view.snapshot().live
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: the degraded mode decides, not this
            log.debug("rendezvous: membership unknown (%s)", exc)
            return None
        if len(live) >= self.config.min_nodes or not self._live_set_settled(live):
            return None
        return len(live), self.config.min_nodes

    def _live_set_settled(self, live: frozenset[str]) -> bool:
        """Membership.live_set_settled, logged when it is not (a healthy job must not stop on a stale live set)."""
        if self.membership.live_set_settled(live):
            return True
        log.debug("rendezvous: %d of --nnodes MIN %d nodes live, but this node's own lease is renewing (etcd was "
                 "unreachable past the lease TTL?): not judged until the nodes have registered again", len(live),
                 self.config.min_nodes)
        return False

    def joins_a_running_round(self) -> bool:
        """Whether other nodes train in a round this node is not in: it would join a running job (scale-up, or a
        replacement node), and they would wait for its workers in the next round's process group."""
        try:
            snap = self.view.read(deadline=timedelta(seconds=5))
        except Exception as exc:  # noqa: BLE001 - unknown: start the usual way
            log.debug("rendezvous: could not read the run's state (%s)", exc)
            return False
        state = snap.state
        if (state is None or state.status != "closed" or state.shutdown or self.config.node_id in state.participants
                or not set(state.participants) & snap.live):
            return False
        # Not the job's start, where nodes arrive seconds apart and a late one joins before training begins.
        since = [snap.nodes[p].doc.get("since") for p in state.participants if p in snap.nodes]
        started = [float(t) for t in since if isinstance(t, (int, float))]
        return bool(started) and time.time() - min(started) > _RUNNING_AFTER.total_seconds()

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
        # A member whose beacon closed counts as lost even while etcd is unreachable: its peers' collectives fail,
        # and the restart that follows is a membership change, not a worker failure (no --max-restarts used).
        dead = sum(1 for p in self._round if p in self._dead_agents)
        try:
            snap = self.view.snapshot()
        except EtcdUnavailableError as exc:
            if not dead:
                log.warning("rendezvous: etcd unreachable while workers are healthy; keeping them running (%s)", exc)
            return dead
        if snap.state is not None and snap.state.shutdown:
            return 0  # the job is over: its last workers finish, whoever left
        # A malformed state (the view warned, naming the key) leaves healthy workers running; a lost
        # member still counts, and the rendezvous that follows fails naming the key.
        return max(dead, protocol.nodes_waiting(snap.state, self._knowledge(snap), self._round))

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
            self._store.close()

    # -- membership, liveness and the watch ------------------------------------------------------

    def _start_membership(self) -> None:
        if self._beacon is None:
            self.admission.enforce(self._store)  # before registering: a refused agent leaves no trace
            self._beacon = Beacon(self.config.bind_addr, advertise=self.config.local_addr)
            self._monitor = Monitor(self._peer_lost)
            self.view.on_change = self._track_peers
            self._joined_at = time.time()
            self.membership.join(self._record())
            emit("join", run_id=self.config.run_id, node=self.config.node_id)
            self.view.start()
        else:
            self.membership.join(self._record())

    def _record(self) -> dict[str, object]:
        # `since`: when this agent first registered (wall clock), so a newcomer can tell a running job from one
        # whose nodes are still arriving (joins_a_running_round).
        return {"addr": self.config.local_addr, "pid": os.getpid(), "beacon": self._beacon.address if self._beacon
                else None, "since": round(self._joined_at, 3), **self._advertised}

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

    def _peer_lost(self, node: str, left: bool) -> None:
        # The peer's agent process is gone: revoke its lease now instead of waiting out the TTL.
        if not left:
            self._dead_agents.add(node)
        record = self.view.snapshot().nodes.get(node)
        lease_id = record.lease_id if record else 0
        if lease_id:
            self._store.revoke_lease(lease_id, deadline=timedelta(seconds=3))  # gone already is no error
        emit(
            "leave", run_id=self.config.run_id, node=node, reported_by=self.config.node_id, reason="agent process gone"
        )

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

    def _join_round(self, deadline: Deadline) -> protocol.Done:
        last_call: Deadline | None = None
        last_call_generation = -1
        last_reason = ""
        while True:
            snap = self.view.read()
            state = snap.checked_state()  # a malformed state fails the rendezvous, naming the key
            decision = protocol.decide(state, self._knowledge(snap, last_call is not None and last_call.expired()))
            if isinstance(decision, protocol.Done):
                return decision
            if isinstance(decision, protocol.Closed):
                raise ElasticRendezvousClosedError(
                    f"run {self.config.run_id!r} is closed: its job finished or was shut down. Start a new job with "
                    "a new --rdzv-id."
                )
            if isinstance(decision, protocol.Conflict):
                raise RunIdConflictError(
                    f"run id {self.config.run_id!r}: {decision.reason}. Every agent of one job must use the same "
                    "--nnodes; a different job needs its own --rdzv-id."
                )
            held: Deadline | None = None  # a judgement held back while the live set settles: retried after
            if isinstance(decision, protocol.Write) and self._judges_unsettled_live_set(state, decision, snap):
                held = self._settled_by()
                decision = protocol.Wait(f"{decision.why}: held back until the live set settles (etcd was "
                                         "unreachable or lost the nodes' leases; they register again)")
            if isinstance(decision, protocol.Write):
                if self._swap_state(decision.state, snap.state_revision):
                    log.info("rendezvous: %s", decision.why)
                    took = protocol.taken(decision.state, self.config.node_id)
                    if took is not None:
                        return took
                continue
            last_reason = decision.reason
            judge_again = held
            if self._stop_below_min and self._ran_round and len(snap.live) < self.config.min_nodes:
                if self._live_set_settled(snap.live):
                    # Nodes lost while this round forms, after the job ran (not nodes still arriving at its start):
                    # no round can form until some come back. The agent stops the job (exit 75) rather than wait.
                    raise BelowMinimumError.of(len(snap.live), self.config.min_nodes)
                judge_again = self._settled_by()
            generation = state.generation if state else 0
            if decision.last_call_armed and (last_call is None or generation != last_call_generation):
                last_call = Deadline.after(self.config.last_call_timeout, clock=self._clock)
                last_call_generation = generation
            elif not decision.last_call_armed:
                last_call = None
            if deadline.expired():
                raise ElasticRendezvousTimeoutError(
                    f"rendezvous of run {self.config.run_id!r} did not complete within "
                    f"{self.config.join_timeout.total_seconds():.0f}s: {last_reason}. Live nodes: "
                    f"{sorted(snap.live)}. Are the other agents running with the same --rdzv-endpoint and --rdzv-id?"
                )
            until = deadline if last_call is None else _earlier(deadline, last_call)
            self.view.wait_changed(snap, until if judge_again is None else _earlier(until, judge_again))

    def _settled_by(self) -> Deadline:
        """When a judgement held back while the live set settles is made again."""
        return Deadline.after(timedelta(seconds=max(0.1, self.membership.unsure_for())), clock=self._clock)

    def _judges_unsettled_live_set(self, state: protocol.RoundState | None, decision: protocol.Write,
                                   snap: Snapshot) -> bool:
        """Whether `decision` judges the live set (closes a round on it, or drops a participant missing from it)
        while that set cannot be trusted: after etcd was unreachable past the lease TTL or lost its data, nodes that
        are alive are missing from it until they register again.
        - Closed on it, with MIN 1 each node closed a round of its own (two worlds beside each other, until the next
          re-formation) and published its store under a lease etcd no longer had (both agents crashed).
        - Dropped on it, two nodes dropped each other from the joining round and joined again, hundreds of writes a
          second, until their keys were back (the close is held meanwhile, so the drop gains nothing)."""
        if not self._ran_round or self._live_set_settled(snap.live):
            return False
        new = decision.state
        closing = new.status == "closed" and (state is None or state.status != "closed")
        dropping = (state is not None and state.status == new.status == "joining"
                    and state.generation == new.generation and not set(state.participants) <= set(new.participants))
        return closing or dropping

    def _swap_state(self, state: protocol.RoundState, token: int) -> bool:
        """Compare-and-set the round state on `token` (with the join-token MAC, in a run with a token)."""
        doc = state.to_json()
        return self._store.swap_state(doc, token, absent=self.admission.state_absent(),
                                      puts=self.admission.state_puts(doc))

    # -- the round's store ---------------------------------------------------------------------

    def _round_store(self, done: protocol.Done, deadline: Deadline) -> tuple[dist.Store, str, int]:
        key = self.keys.store(done.generation)
        timeout = timedelta(seconds=max(1.0, deadline.remaining() or 0.0))
        if done.rank == 0:
            # A fresh TCPStore per round: keys of an earlier round can never leak into this one.
            server = self._store_server if self._store_server_round == done.generation else None
            if server is None:
                server = self._store_server_socket(timeout)
                self._store_server, self._store_server_round = server, done.generation
            addr, port = self.config.local_addr, int(server.port)
            lease = self.membership.lease_id
            assert lease is not None, "a node takes a rank only while registered"
            record = json.dumps(self.admission.sign_store(done.generation, addr, port))
            try:
                self._store.publish_store(done.generation, record, lease)  # the address dies with rank 0's lease
            except LeaseGoneError as exc:
                # etcd lost this node's lease (and its key) since it took the rank: its peers see rank 0 gone and
                # abandon the round too. Registered again first: under the lost lease it would take rank 0 in
                # round after round, each abandoned. Seen after etcd restarted empty.
                self.membership.register_again(lease)
                raise _RoundAbandoned(f"this node's lease lapsed before it published the round's store ({exc})") \
                    from exc
            self._store.prune_stores(done.generation)
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
            if deadline.expired():
                raise ElasticRendezvousTimeoutError(
                    f"rank 0 of round {done.generation} ({done.participants[0]}) did not publish its store at {key} "
                    "in time"
                )
            self.view.wait_changed(snap, deadline)

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
            if self._swap_state(dataclasses.replace(base, shutdown=True), snap.state_revision):
                log.info("rendezvous: run %s closed", self.config.run_id)
                return
        log.warning("rendezvous: could not close run %s: its state kept changing", self.config.run_id)


_RUNNING_AFTER = timedelta(seconds=5)
"""A closed round whose first member registered longer ago than this is a running job, not one starting up."""


def _earlier(a: Deadline, b: Deadline) -> Deadline:
    return a if b.at is None or (a.at is not None and a.at <= b.at) else b


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
