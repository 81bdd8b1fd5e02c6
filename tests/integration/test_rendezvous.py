"""The `etcd-v3` rendezvous handler on a real etcd, driven directly from threads of the test
process: each handler has its own node id and etcd client, as separate agents would."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from elastic.errors import BelowMinimumError, EtcdUnavailableError
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.etcd_server import EtcdServer, free_port
from elastic.etcd_store import EtcdRunStore
from elastic.keys import RunKeys
from elastic.membership import Membership, MembershipConfig
from elastic.rendezvous import EtcdV3RendezvousHandler, RendezvousConfig
from elastic.round import RoundState
from tests.conftest import read_state

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(30),
    # python3-etcd3 0.13.0 (etcd3/watch.py:156) calls `six` without importing it, so its watch
    # thread dies with NameError whenever a client that used a watch is closed. Not ours to fix.
    pytest.mark.filterwarnings(
        "ignore:Exception in thread etcd3_watch:pytest.PytestUnhandledThreadExceptionWarning"
    ),
]


class Cluster:
    """Handlers of one run on the test etcd, and threads that run their `next_rendezvous`."""

    def __init__(self, etcd: EtcdServer, run_id: str) -> None:
        self.etcd = etcd
        self.run_id = run_id
        self.handlers: list[EtcdV3RendezvousHandler] = []
        self.shut: set[int] = set()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rdzv")

    def handler(
        self,
        node_id: str,
        *,
        min_nodes: int = 2,
        max_nodes: int = 2,
        run_id: str | None = None,
        join_timeout: float = 20,
        last_call_timeout: float = 30,
    ) -> EtcdV3RendezvousHandler:
        config = RendezvousConfig(
            run_id=run_id or self.run_id,
            node_id=node_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr="127.0.0.1",
            etcd=EtcdClientConfig(endpoints=self.etcd.endpoint, retry_deadline=timedelta(seconds=5)),
            lease_ttl=timedelta(seconds=2),
            join_timeout=timedelta(seconds=join_timeout),
            last_call_timeout=timedelta(seconds=last_call_timeout),
        )
        h = EtcdV3RendezvousHandler(config)
        self.handlers.append(h)
        return h

    def start(self, h: EtcdV3RendezvousHandler) -> Future[RendezvousInfo]:
        return self.pool.submit(h.next_rendezvous)

    def shutdown(self, h: EtcdV3RendezvousHandler) -> bool:
        self.shut.add(id(h))
        return h.shutdown()

    def close(self) -> None:
        # Closing the run wakes any thread still waiting in a round (shutdown() alone only leaves).
        for h in self.handlers:
            if id(h) not in self.shut:
                try:
                    h.set_closed()
                except Exception:  # noqa: BLE001 - another run id, or etcd gone: shutdown still leaves
                    pass
                self.shutdown(h)
        self.pool.shutdown(wait=True)


@pytest.fixture
def cluster(etcd: EtcdServer, run_id: str) -> Iterator[Cluster]:
    c = Cluster(etcd, run_id)
    try:
        yield c
    finally:
        c.close()




def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_two_nodes_form_a_world_with_a_shared_store(cluster: Cluster) -> None:
    a, b = cluster.handler("a"), cluster.handler("b")
    fa, fb = cluster.start(a), cluster.start(b)
    ra, rb = fa.result(timeout=15), fb.result(timeout=15)

    assert {ra.rank, rb.rank} == {0, 1}
    assert ra.world_size == rb.world_size == 2
    assert ra.bootstrap_store_info is not None and rb.bootstrap_store_info is not None
    assert ra.bootstrap_store_info == rb.bootstrap_store_info
    assert ra.bootstrap_store_info.master_addr == "127.0.0.1"
    assert ra.bootstrap_store_info.master_port > 0

    ra.store.set("from-a", "hello")
    assert rb.store.get("from-a") == b"hello"
    rb.store.set("from-b", "world")
    assert ra.store.get("from-b") == b"world"


def test_round_closes_as_soon_as_all_live_nodes_joined_without_last_call(cluster: Cluster) -> None:
    # --nnodes 1:3 with two live agents: the round closes with 2 at once, not after last_call.
    # The last call is far longer than the test's timeout, so waiting for it fails the test on a
    # machine of any speed (no wall-clock threshold that a loaded machine could break).
    a = cluster.handler("a", min_nodes=1, max_nodes=3, last_call_timeout=600)
    b = cluster.handler("b", min_nodes=1, max_nodes=3, last_call_timeout=600)
    # Both agents are registered before either decides, so each knows the other is alive.
    a.membership.join()
    b.membership.join()
    fa, fb = cluster.start(a), cluster.start(b)
    ra, rb = fa.result(timeout=25), fb.result(timeout=25)
    assert ra.world_size == rb.world_size == 2
    assert {ra.rank, rb.rank} == {0, 1}


def test_ranks_are_stable_across_rounds(cluster: Cluster, client: EtcdClient) -> None:
    a, b = cluster.handler("a"), cluster.handler("b")
    fa = cluster.start(a)
    assert wait_until(lambda: (s := read_state(client, cluster.run_id)) is not None and "a" in s.participants, 10)
    fb = cluster.start(b)
    ra1, rb1 = fa.result(timeout=15), fb.result(timeout=15)
    assert (ra1.rank, rb1.rank) == (0, 1)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0

    # b restarts: it opens round 2; a, still running round 1, is told to re-rendezvous.
    fb = cluster.start(b)
    assert wait_until(lambda: a.num_nodes_waiting() > 0, 10), "a never learned of round 2"
    fa = cluster.start(a)
    ra2, rb2 = fa.result(timeout=15), fb.result(timeout=15)
    assert (ra2.rank, rb2.rank) == (0, 1), "survivors must keep their ranks"
    assert ra2.world_size == rb2.world_size == 2
    state = read_state(client, cluster.run_id)
    assert state is not None and state.generation == 2 and state.participants == ("a", "b")
    ra2.store.set("round", "2")
    assert rb2.store.get("round") == b"2"


@pytest.mark.timeout(20)
def test_node_beyond_max_waits_as_spare_without_disturbing_the_round(cluster: Cluster) -> None:
    a, b = cluster.handler("a"), cluster.handler("b")
    fa, fb = cluster.start(a), cluster.start(b)
    fa.result(timeout=15)
    fb.result(timeout=15)

    spare = cluster.handler("c", join_timeout=3)
    fc = cluster.start(spare)
    assert wait_until(lambda: "c" in a.membership.live_nodes(), 5)
    samples = []
    while not fc.done():
        samples.append((a.num_nodes_waiting(), b.num_nodes_waiting()))
        time.sleep(0.1)
    assert len(samples) >= 5
    assert set(samples) == {(0, 0)}, f"a healthy full round must not be disturbed by a spare: {samples}"
    with pytest.raises(RendezvousTimeoutError, match="spare"):
        fc.result()


def test_runs_with_different_ids_do_not_see_each_other(cluster: Cluster) -> None:
    # The same node id in two runs: no conflict, and each run is a world of one.
    first = cluster.handler("n", min_nodes=1, max_nodes=1, run_id=cluster.run_id + "-x")
    second = cluster.handler("n", min_nodes=1, max_nodes=1, run_id=cluster.run_id + "-y")
    r1 = cluster.start(first).result(timeout=15)
    r2 = cluster.start(second).result(timeout=15)
    assert (r1.rank, r1.world_size) == (0, 1)
    assert (r2.rank, r2.world_size) == (0, 1)
    assert first.membership.live_nodes() == ["n"]
    assert second.membership.live_nodes() == ["n"]
    assert cluster.shutdown(first)
    assert not second.is_closed(), "closing one run must not close another"


def test_shutdown_after_success_closes_the_run(cluster: Cluster) -> None:
    first = cluster.handler("a", min_nodes=1, max_nodes=1)
    cluster.start(first).result(timeout=15)
    other = cluster.handler("b", min_nodes=1, max_nodes=1)
    assert not other.is_closed()
    first.mark_succeeded()  # the agent says so once the workers succeeded
    assert cluster.shutdown(first) is True
    # shutdown() also releases `first`'s own connection, so another agent of the run observes it.
    assert other.is_closed()
    started = time.monotonic()
    with pytest.raises(RendezvousClosedError, match=cluster.run_id):
        other.next_rendezvous()
    assert time.monotonic() - started < 20, "a closed run must be refused at once, not after join_timeout (600s)"


@pytest.mark.timeout(30)
def test_join_timeout_names_the_run(cluster: Cluster) -> None:
    lonely = cluster.handler("a", min_nodes=2, max_nodes=2, join_timeout=2)
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as err:
        lonely.next_rendezvous()
    elapsed = time.monotonic() - started
    assert 1.5 < elapsed < 20, f"timed out after {elapsed:.1f}s, join_timeout was 2s"
    assert cluster.run_id in str(err.value)


@pytest.mark.timeout(40)
def test_unreachable_endpoint_raises_connection_error_naming_it() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    config = RendezvousConfig(
        run_id="unreachable",
        node_id="a",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        etcd=EtcdClientConfig(endpoints=endpoint, retry_deadline=timedelta(seconds=2)),
    )
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError) as err:
        EtcdV3RendezvousHandler(config).next_rendezvous()
    assert time.monotonic() - started < 30, "the retry deadline was 2s"
    assert isinstance(err.value, RendezvousConnectionError)
    assert endpoint in str(err.value)


def test_lost_node_is_reported_to_its_peers(cluster: Cluster) -> None:
    a, b = cluster.handler("a"), cluster.handler("b")
    fa, fb = cluster.start(a), cluster.start(b)
    fa.result(timeout=15)
    fb.result(timeout=15)
    assert a.num_nodes_waiting() == 0
    b.membership.leave()  # revokes b's lease, as etcd would once a dead agent's TTL ran out
    # a's answer comes from its watch-fed view of the run: it must catch up within moments.
    assert wait_until(lambda: a.num_nodes_waiting() > 0, 3), "a was not told that b left its round"


def test_no_round_opens_before_every_member_of_the_closed_one_took_its_rank(
    cluster: Cluster, client: EtcdClient
) -> None:
    # Round 1 closed with b (rank 0) and a; a took its rank, b has not read the closed round yet
    # (its watch is a moment late). A newcomer c must not open round 2 now: b would only ever see
    # round 2, and a would wait for b in round 1's store until the store timeout.
    a, b, c = (cluster.handler(n, min_nodes=1, max_nodes=3) for n in "abc")
    a._start_membership()  # noqa: SLF001 - live, as an agent in the middle of its rendezvous
    b._start_membership()  # noqa: SLF001
    key = a.keys.state
    client.raw.put(key, RoundState(generation=1, status="closed", participants=("b", "a"), acked=("a",),
                                   nnodes=(1, 3)).to_json())
    fc = cluster.start(c)
    time.sleep(1.0)
    state = read_state(client, cluster.run_id)
    assert state is not None and state.generation == 1 and not fc.done()
    info = b.next_rendezvous()  # b takes its rank in round 1 ...
    assert (info.rank, info.world_size) == (0, 2)
    # ... and only then may c open round 2.
    assert wait_until(lambda: (s := read_state(client, cluster.run_id)) is not None and s.generation == 2, 5)
    assert read_state(client, cluster.run_id).participants[0] == "c"  # type: ignore[union-attr]


def test_a_round_whose_rank_0_left_before_publishing_its_store_is_abandoned(
    cluster: Cluster, client: EtcdClient
) -> None:
    # Round 1 closed with a (rank 0) and b, but a is gone (its lease expired) before it published
    # the round's store. b must not wait out its join timeout: it joins the next round instead.
    # join_timeout is far beyond the test's own timeout: waiting it out fails the test.
    b = cluster.handler("b", min_nodes=1, max_nodes=2, join_timeout=600)
    client.raw.put(b.keys.state, RoundState(generation=1, status="closed", participants=("a", "b"),
                                            acked=("a",), nnodes=(1, 2)).to_json())
    info = b.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    state = read_state(client, cluster.run_id)
    assert state is not None and state.generation == 2 and state.participants == ("b",)


def _etcd_range_count(etcd: EtcdServer) -> int:
    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(r"^etcd_mvcc_range_total (\S+)$", text, re.MULTILINE)
    assert match, "etcd /metrics has no etcd_mvcc_range_total"
    return int(float(match.group(1)))


@pytest.mark.timeout(20)
def test_waiting_node_does_not_poll_etcd_after_a_key_is_deleted(
    cluster: Cluster, etcd: EtcdServer, client: EtcdClient
) -> None:
    """A node blocked in a round waits on its watch; it must not spin on range reads, even when
    the newest event under the run prefix is a delete (a left node, a pruned store key)."""
    waiting = cluster.handler("a", min_nodes=2, max_nodes=2, join_timeout=3)
    fa = cluster.start(waiting)
    assert wait_until(lambda: read_state(client, cluster.run_id) is not None, 5)
    # A node registers and leaves again: the newest event under the run prefix is a delete.
    passer = Membership(EtcdRunStore(client, RunKeys.of(cluster.run_id)),
                        MembershipConfig(run_id=cluster.run_id, node_id="passer"))
    passer.join()
    assert wait_until(lambda: "passer" in waiting.view.snapshot().live, 5)
    passer.leave()
    assert wait_until(lambda: "passer" not in waiting.view.snapshot().live, 5)

    before = _etcd_range_count(etcd)
    quiet_until = time.monotonic() + 1.5
    while time.monotonic() < quiet_until:
        assert not fa.done(), "the waiting node should still be waiting for a second node"
        time.sleep(0.1)
    reads = _etcd_range_count(etcd) - before
    # Nothing changed in these 1.5s: a node blocked on its watch reads only on the periodic resync.
    assert reads <= 3, f"the waiting node read etcd {reads} times in 1.5s with nothing changing"
    with pytest.raises(RendezvousTimeoutError):
        fa.result(timeout=10)


def test_nodes_lost_while_a_later_round_forms_stop_it_below_the_minimum(cluster: Cluster) -> None:
    # a, b and c trained in round 1 (--nnodes 2:3). a opens round 2; b and c are lost before joining it. No round can
    # form: a is told at once (BelowMinimumError, its agent persists and exits 75), not at its 600 s join timeout.
    a, b, c = (cluster.handler(n, min_nodes=2, max_nodes=3, join_timeout=600) for n in "abc")
    a.stop_below_minimum()  # as elastic-run's agent does
    for f in [cluster.start(h) for h in (a, b, c)]:
        assert f.result(timeout=15).world_size == 3
    fa = cluster.start(a)
    time.sleep(0.5)
    assert not fa.done()  # waiting for b and c in round 2
    b.membership.leave()
    c.membership.leave()
    with pytest.raises(BelowMinimumError, match=r"needs 2 nodes \(--nnodes 2:\.\.\.\) and has 1"):
        fa.result(timeout=15)


def test_under_stock_torchrun_a_survivor_below_the_minimum_waits_for_a_replacement(cluster: Cluster) -> None:
    # Without stop_below_minimum (stock torchrun: nothing would persist the workers' state), a and b trained in round
    # 1 (--nnodes 2:3); b is lost and its replacement b2 arrives 1 s into a's next round: they form it together.
    a, b = (cluster.handler(n, min_nodes=2, max_nodes=3, join_timeout=600, last_call_timeout=1) for n in "ab")
    for f in [cluster.start(h) for h in (a, b)]:
        assert f.result(timeout=15).world_size == 2
    b.membership.leave()
    time.sleep(0.5)
    fa = cluster.start(a)
    time.sleep(1.0)
    fb2 = cluster.start(cluster.handler("b2", min_nodes=2, max_nodes=3, join_timeout=600, last_call_timeout=1))
    assert fa.result(timeout=30).world_size == 2
    assert fb2.result(timeout=30).world_size == 2


def test_below_the_minimum_at_the_first_formation_waits_for_nodes_even_after_an_abandoned_round(
    cluster: Cluster, client: EtcdClient
) -> None:
    # The job's first formation: round 1 closed with a (rank 0) and b, and a died before publishing its store, so b
    # abandoned it without running. b has run no round: with stop_below_minimum it still waits for c, 2 s later.
    b = cluster.handler("b", min_nodes=2, max_nodes=2, join_timeout=600)
    b.stop_below_minimum()
    client.raw.put(b.keys.state, RoundState(generation=1, status="closed", participants=("a", "b"),
                                            acked=("a",), nnodes=(2, 2)).to_json())
    fb = cluster.start(b)
    time.sleep(2)
    fc = cluster.start(cluster.handler("c", min_nodes=2, max_nodes=2, join_timeout=600))
    assert fb.result(timeout=30).world_size == 2
    assert fc.result(timeout=30).world_size == 2
