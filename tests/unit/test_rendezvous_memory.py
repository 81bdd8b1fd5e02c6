"""The rendezvous handler over the in-memory `RunStore` (no etcd process), with a fake clock for its
deadlines: the join timeout and the last call are tested by moving the clock, never by sleeping.

A waiting handler wakes on a change of the run (its view's watch); the tests make one by
registering another node, after moving the clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousTimeoutError

from elastic.errors import EtcdUnavailableError, NodeIdConflictError
from elastic.etcd_client import EtcdClientConfig
from elastic.keys import RunKeys
from elastic.membership import Membership, MembershipConfig
from elastic.memory_store import MemoryRunStore
from elastic.records import parse_run
from elastic.rendezvous import EtcdV3RendezvousHandler, RendezvousConfig
from elastic.round import RoundState

pytestmark = pytest.mark.timeout(30)

RUN = "mem-run"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class Run:
    """Handlers of one run on one in-memory store, and threads for their `next_rendezvous`."""

    def __init__(self) -> None:
        self.store = MemoryRunStore(RunKeys.of(RUN))
        self.clock = FakeClock()
        self.handlers: list[EtcdV3RendezvousHandler] = []
        self.members: list[Membership] = []
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rdzv-mem")

    def handler(self, node: str, *, min_nodes: int = 1, max_nodes: int = 2, join_timeout: float = 600,
                last_call: float = 30) -> EtcdV3RendezvousHandler:
        config = RendezvousConfig(
            run_id=RUN, node_id=node, min_nodes=min_nodes, max_nodes=max_nodes, local_addr="127.0.0.1",
            etcd=EtcdClientConfig(endpoints="127.0.0.1:1"),  # never connected: the store is given
            lease_ttl=timedelta(seconds=5), join_timeout=timedelta(seconds=join_timeout),
            last_call_timeout=timedelta(seconds=last_call),
        )
        h = EtcdV3RendezvousHandler(config, self.store, clock=self.clock)
        self.handlers.append(h)
        return h

    def register(self, node: str) -> Membership:
        """A live node that never joins a round (or a change of the run that wakes the waiters)."""
        m = Membership(self.store, MembershipConfig(run_id=RUN, node_id=node, lease_ttl=timedelta(seconds=5)))
        m.join()
        self.members.append(m)
        return m

    def start(self, h: EtcdV3RendezvousHandler) -> Future[RendezvousInfo]:
        return self.pool.submit(h.next_rendezvous)

    def state(self) -> RoundState | None:
        return parse_run(self.store.keys, self.store.read().kvs).state

    def close(self) -> None:
        for h in self.handlers:
            h.set_closed()  # wakes any thread still waiting in a round
            h.shutdown()
        for m in self.members:
            m.leave()
        self.pool.shutdown(wait=True)


@pytest.fixture
def run() -> Iterator[Run]:
    r = Run()
    try:
        yield r
    finally:
        r.close()


def eventually(predicate: Callable[[], bool], timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_two_handlers_on_the_fake_form_a_world_with_a_shared_store(run: Run) -> None:
    a, b = run.handler("a", min_nodes=2), run.handler("b", min_nodes=2)
    fa, fb = run.start(a), run.start(b)
    ra, rb = fa.result(timeout=15), fb.result(timeout=15)
    assert {ra.rank, rb.rank} == {0, 1} and ra.world_size == rb.world_size == 2
    ra.store.set("k", "v")
    assert rb.store.get("k") == b"v"
    # What the agent reads (agent.RoundAware), the same on both.
    assert a.generation == b.generation == 1
    assert a.round_members == b.round_members and set(a.round_members) == {"a", "b"}
    assert a.node_id == "a" and not a.degraded and a.lease_ttl == timedelta(seconds=5)


def test_the_join_timeout_runs_on_the_handlers_clock(run: Run) -> None:
    lonely = run.handler("a", min_nodes=2, join_timeout=600)
    future = run.start(lonely)
    assert eventually(lambda: (s := run.state()) is not None and s.participants == ("a",))
    run.register("passer")  # a change: the handler re-decides, and its deadline is still far off
    time.sleep(0.3)
    assert not future.done()
    run.clock.advance(601)
    run.register("passer-2")
    with pytest.raises(RendezvousTimeoutError, match=rf"{RUN}.*did not complete within 600s"):
        future.result(timeout=15)


def test_the_last_call_closes_the_round_without_a_live_node_that_never_joins(run: Run) -> None:
    run.register("silent")  # live, registered, never joins
    a = run.handler("a", min_nodes=1, max_nodes=3, last_call=30)
    future = run.start(a)
    assert eventually(lambda: (s := run.state()) is not None and s.participants == ("a",))
    run.register("late")  # a change before the last call expired: still waiting for the live nodes
    time.sleep(0.3)
    assert not future.done()
    run.clock.advance(31)
    run.register("later")
    info = future.result(timeout=15)
    assert (info.rank, info.world_size) == (0, 1)
    state = run.state()
    assert state is not None and state.status == "closed" and state.participants == ("a",)


def test_a_round_whose_rank_0_is_gone_before_publishing_its_store_is_abandoned(run: Run) -> None:
    b = run.handler("b", min_nodes=1, max_nodes=2)
    closed = RoundState(generation=1, status="closed", participants=("a", "b"), acked=("a",), nnodes=(1, 2))
    assert run.store.swap_state(closed.to_json(), 0)
    info = b.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    state = run.state()
    assert state is not None and state.generation == 2 and state.participants == ("b",)


def test_a_healthy_round_survives_an_unreachable_store_in_degraded_mode(run: Run) -> None:
    a = run.handler("a", min_nodes=1, max_nodes=1)
    a.view.RESYNC = timedelta(milliseconds=100)  # the view re-reads this often: it finds the outage sooner
    run.start(a).result(timeout=15)
    run.store.unavailable = True
    try:
        assert eventually(lambda: a.degraded, timeout=3 * a.view.RESYNC.total_seconds() + 5)
        assert a.num_nodes_waiting() == 0, "healthy workers keep running while the store cannot be reached"
    finally:
        run.store.unavailable = False
    assert eventually(lambda: not a.degraded, timeout=3 * a.view.RESYNC.total_seconds() + 5)


def test_after_etcd_lost_every_lease_no_node_closes_a_round_alone_before_the_others_register_again(
    run: Run,
) -> None:
    # etcd restarted empty: every node's key and lease gone. A node whose workers failed then closed a round on a
    # live set without its peers (MIN 1: each node a world of its own) and published its store under a lease etcd
    # no longer had: the agent crashed.
    a, b = run.handler("a", min_nodes=1, max_nodes=2), run.handler("b", min_nodes=1, max_nodes=2)
    b.membership.join()  # live before a's first round: a waits for it rather than close round 1 alone
    fa = run.start(a)
    assert eventually(lambda: (s := run.state()) is not None and s.participants == ("a",))
    fb = run.start(b)
    fa.result(timeout=15), fb.result(timeout=15)
    assert a.generation == b.generation == 1 and set(a.round_members) == {"a", "b"}
    with run.store._lock:  # what an etcd restarted without its data has: nothing
        run.store._data.clear()
        run.store._leases.clear()
    fa = run.start(a)  # a's workers failed: its next round, before any node registered again
    assert eventually(lambda: b.num_nodes_waiting() > 0), "b never learned of a's round"
    fb = run.start(b)
    before = run.store.read().revision
    time.sleep(0.5)
    assert not fa.done() and not fb.done(), "a round closed on a live set the nodes had not registered in again"
    # Nor do they drop each other from the round and join again while their keys are gone (a burst of writes).
    writes = run.store.read().revision - before
    assert writes <= 4, f"{writes} writes to the run in 0.5 s while the live set settles"
    # Both register again at their keep-alive's next refresh and wait out one TTL; then the round closes with both.
    assert eventually(lambda: all(h.membership.unsure_for() == 0 and h.membership.lease_id is not None
                                  and h.node_id in h.membership.live_nodes() for h in (a, b)), timeout=20)
    run.clock.advance(10)
    run.register("passer")  # a change: the waiting handlers judge again, on the advanced clock
    ra, rb = fa.result(timeout=30), fb.result(timeout=30)
    assert a.generation == b.generation and ra.world_size == rb.world_size == 2


def test_a_member_lost_while_etcd_is_unreachable_is_a_membership_change(run: Run) -> None:
    # Only the lease told of a lost member; during an outage it could not be revoked nor expire, so the survivors'
    # failed workers were charged to --max-restarts as a worker failure. Its beacon closing tells of it too.
    a, b = run.handler("a", min_nodes=2, max_nodes=2), run.handler("b", min_nodes=2, max_nodes=2)
    a.view.RESYNC = timedelta(milliseconds=100)
    fa, fb = run.start(a), run.start(b)
    fa.result(timeout=15), fb.result(timeout=15)
    run.store.unavailable = True
    try:
        assert eventually(lambda: a.degraded, timeout=5)
        assert a.num_nodes_waiting() == 0, "healthy workers keep running while the store cannot be reached"
        beacon = b._beacon
        assert beacon is not None
        for conn in [beacon._sock, *beacon._peers]:  # b's agent process dies: its kernel closes its sockets
            conn.close()
        assert eventually(lambda: a.num_nodes_waiting() > 0, timeout=5), "the lost member went unnoticed"
    finally:
        run.store.unavailable = False
    b.set_closed()  # the job is over: a's last workers finish, whoever left
    assert eventually(lambda: a.num_nodes_waiting() == 0, timeout=5)


@pytest.mark.parametrize("blip", ["publish_store", "swap_state"])
def test_an_outage_after_a_rank_was_taken_retries_into_the_same_round(run: Run, blip: str) -> None:
    # Once a node has run a round, its rendezvous waits out an unreachable etcd. One failed call after its rank
    # was taken (the store's address, or the write that took it, committed though its answer was lost) made the
    # retry treat its own round as stale and open the next, while its peer waited in the first until join_timeout.
    a, b = run.handler("a", min_nodes=2, max_nodes=2), run.handler("b", min_nodes=2, max_nodes=2)
    fa, fb = run.start(a), run.start(b)
    fa.result(timeout=15), fb.result(timeout=15)
    real = getattr(run.store, blip)
    failed: list[object] = []

    def once(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)  # it lands in the store ...
        if not failed and (blip == "publish_store" or "closed" in str(args[0])):
            failed.append(args)
            raise EtcdUnavailableError("etcd at x did not answer (a blip)", transient=True)  # ... the answer is lost
        return result

    setattr(run.store, blip, once)
    fa, fb = run.start(a), run.start(b)
    ra, rb = fa.result(timeout=30), fb.result(timeout=30)
    assert failed
    assert a.generation == b.generation == 2 and {ra.rank, rb.rank} == {0, 1}
    ra.store.set("k", "v")
    assert rb.store.get("k") == b"v"


def test_after_etcd_lost_the_runs_state_a_round_a_newcomer_opened_is_renumbered_and_joined(run: Run) -> None:
    # etcd lost its data (the nodes' leases were registered again) while a and b ran round 1; a newcomer c opened
    # round 1 again. The running nodes took it for their own round and ignored it: c waited until join_timeout,
    # or with MIN 1 closed it alone at last call and trained beside them.
    a, b, c = (run.handler(n, min_nodes=2, max_nodes=3) for n in "abc")
    fa, fb = run.start(a), run.start(b)
    fa.result(timeout=15), fb.result(timeout=15)
    assert a.generation == b.generation == 1
    with run.store._lock:  # what etcd restarted without its data keeps: only the records nodes write again
        for key in [k for k in run.store._data if run.store.keys.node_id(k) is None]:
            del run.store._data[key]
    fc = run.start(c)
    assert eventually(lambda: (s := run.state()) is not None and s.participants == ("c",) and s.generation == 1)
    assert eventually(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0), "the running nodes ignore it"
    fa, fb = run.start(a), run.start(b)
    infos = [f.result(timeout=30) for f in (fa, fb, fc)]
    assert a.generation == b.generation == c.generation == 2
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}


def test_the_fakes_leases_expire_on_its_clock_and_watchers_hear_of_it() -> None:
    clock = FakeClock()
    store = MemoryRunStore(RunKeys.of(RUN), clock=clock)
    events: list[Exception | None] = []
    store.watch(events.append, store.read().revision + 1)
    lease = store.grant_lease(5)
    assert store.create(store.keys.node("a"), "{}", lease=lease) == (True, None)
    clock.advance(4)
    assert store.refresh_lease(lease) is True  # a refresh restarts the TTL
    clock.advance(4)
    assert store.get(store.keys.node("a")) == b"{}"
    seen = len(events)
    clock.advance(2)
    assert store.get(store.keys.node("a")) is None, "the key outlived its lease's TTL"
    assert len(events) > seen, "the expiry was not reported to the watcher"
    assert store.refresh_lease(lease) is False


def test_rank_0_whose_lease_etcd_lost_abandons_the_round_and_forms_the_next(run: Run) -> None:
    """After etcd lost its data, a node could take rank 0 in a round while its lease was gone: publishing the
    round's store under it failed (etcd: NOT_FOUND), unhandled, and the agent crashed. Now it abandons the round,
    its keep-alive registers it again, and it forms the next round."""
    h = run.handler("a")
    publish = run.store.publish_store
    lost: list[int] = []

    def publish_after_etcd_lost_the_lease(generation: int, record: str, lease: int) -> None:
        if not lost:
            lost.append(lease)
            run.store.revoke_lease(lease)  # as etcd restarted without its data: the lease and the node's key gone
        publish(generation, record, lease)

    run.store.publish_store = publish_after_etcd_lost_the_lease  # type: ignore[method-assign]
    info = run.start(h).result(timeout=20)
    assert lost and info.rank == 0 and info.world_size == 1
    assert h.generation == 2 and h.membership.lease_id != lost[0]  # the next round, under its new lease


def test_a_registration_whose_answer_was_lost_is_this_nodes_own_not_a_conflict(run: Run) -> None:
    """etcd restarting: the create of a node's key committed, its answer was lost, and the retry found the key. It
    was taken for another agent's (NodeIdConflictError), the fresh lease revoked: the node unregistered for good."""
    create = run.store.create

    def create_and_lose_the_answer(key: str, value: str, **kw: object) -> tuple[bool, bytes | None]:
        create(key, value, **kw)  # type: ignore[arg-type]
        return create(key, value, **kw)  # type: ignore[arg-type]  # the retry: (False, what is there)

    run.store.create = create_and_lose_the_answer  # type: ignore[method-assign]
    m = run.register("a")
    assert run.store.refresh_lease(m.lease_id or 0) and "a" in m.live_nodes()
    run.store.create = create  # type: ignore[method-assign]
    other = Membership(run.store, MembershipConfig(run_id=RUN, node_id="a", lease_ttl=timedelta(seconds=5)))
    with pytest.raises(NodeIdConflictError):  # another agent's key is still a conflict
        other.join()
