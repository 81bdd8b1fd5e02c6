"""The `RunStore` contract: the same assertions against the in-memory fake and a real etcd, so the
fake the unit tests run the rendezvous on behaves as etcd does where the protocol depends on it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from elastic.errors import LeaseGoneError
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.etcd_server import EtcdServer
from elastic.etcd_store import EtcdRunStore
from elastic.keys import RunKeys
from elastic.memory_store import MemoryRunStore
from elastic.records import parse_run
from elastic.round import RoundState
from elastic.run_store import RunStore

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(30),
    # python3-etcd3 0.13.0's watch thread dies with NameError when a client that watched is closed.
    pytest.mark.filterwarnings("ignore:Exception in thread etcd3_watch:pytest.PytestUnhandledThreadExceptionWarning"),
]

Factory = Callable[[str], RunStore]


@pytest.fixture(params=["memory", "etcd"])
def stores(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """Makes the store of a run id; stores of one test share one backend, as agents share one etcd."""
    opened: list[RunStore] = []
    if request.param == "memory":
        shared: dict[str, MemoryRunStore] = {}

        def make(run_id: str) -> RunStore:
            # Different runs live in one etcd; the fake keeps one store per run (they share nothing).
            return shared.setdefault(run_id, MemoryRunStore(RunKeys.of(run_id)))
    else:
        server: EtcdServer = request.getfixturevalue("etcd")

        def make(run_id: str) -> RunStore:
            store = EtcdRunStore(EtcdClient(EtcdClientConfig(endpoints=server.endpoint)), RunKeys.of(run_id))
            opened.append(store)
            return store
    try:
        yield make
    finally:
        for store in opened:
            store.close()


@pytest.fixture
def store(stores: Factory) -> RunStore:
    return stores(f"contract-{uuid.uuid4().hex[:8]}")


def state(generation: int, *participants: str) -> str:
    return RoundState(generation=generation, status="joining", participants=participants).to_json()


def token(store: RunStore) -> int:
    return parse_run(store.keys, store.read().kvs).state_revision


def wait_for(event: threading.Event, timeout: float = 10) -> bool:
    return event.wait(timeout)


def test_a_fresh_run_reads_empty_at_a_positive_revision(store: RunStore) -> None:
    read = store.read()
    assert list(read.kvs) == [] and read.revision > 0
    assert store.get(store.keys.state) is None
    records = parse_run(store.keys, read.kvs)
    assert records.state is None and records.state_revision == 0


def test_the_state_is_compare_and_set_on_its_token(store: RunStore) -> None:
    assert store.swap_state(state(1, "a"), 0) is True
    assert store.swap_state(state(1, "b"), 0) is False, "token 0 means: the state must not exist yet"
    first = token(store)
    assert first > 0
    assert store.swap_state(state(1, "a", "b"), first) is True
    assert store.swap_state(state(1, "c"), first) is False, "a stale token loses the race"
    second = token(store)
    assert second > first
    records = parse_run(store.keys, store.read().kvs)
    assert records.state is not None and records.state.participants == ("a", "b")
    assert store.read().revision >= second


def test_a_state_write_checks_absent_keys_and_writes_its_extra_keys_with_it(store: RunStore) -> None:
    blocker, extra = store.keys.admission_run, store.keys.admission_state
    assert store.create(blocker, "claimed") == (True, None)
    assert store.swap_state(state(1, "a"), 0, absent=[blocker], puts={extra: "mac-1"}) is False
    assert store.get(store.keys.state) is None and store.get(extra) is None, "nothing of a lost race is written"
    assert store.swap_state(state(1, "a"), 0, absent=[store.keys.node("x")], puts={extra: "mac-1"}) is True
    assert store.get(extra) == b"mac-1"
    assert store.get(store.keys.state) == state(1, "a").encode()


def test_create_writes_once_and_returns_what_is_there(store: RunStore) -> None:
    key = store.keys.admission_run
    assert store.create(key, "first") == (True, None)
    assert store.create(key, "second") == (False, b"first")
    assert store.get(key) == b"first"
    other = store.keys.node("n")
    assert store.create(other, "x", absent=[key]) == (False, None), "an absent key that exists blocks the create"
    assert store.get(other) is None


def test_keys_under_a_lease_go_when_it_is_revoked(store: RunStore) -> None:
    lease = store.grant_lease(30)
    assert store.create(store.keys.node("a"), '{"node_id": "a"}', lease=lease) == (True, None)
    store.publish_store(1, '{"addr": "h", "port": 1}', lease)
    kvs = {kv.key.decode(): kv for kv in store.read().kvs}
    assert kvs[store.keys.node("a")].lease == lease and kvs[store.keys.store(1)].lease == lease
    assert store.refresh_lease(lease) is True
    store.revoke_lease(lease)
    assert list(store.read().kvs) == []
    assert store.refresh_lease(lease) is False, "a revoked lease cannot be refreshed"
    store.revoke_lease(lease)  # revoking a lease that is gone is no error
    with pytest.raises(LeaseGoneError, match=f"{lease:x}"):  # rank 0 then abandons its round (rendezvous.py)
        store.publish_store(2, '{"addr": "h", "port": 1}', lease)
    with pytest.raises(LeaseGoneError, match=f"{lease:x}"):  # a registration under it: the node registers again
        store.create(store.keys.node("b"), '{"node_id": "b"}', lease=lease)


def test_registration_order_is_the_create_revision(store: RunStore) -> None:
    lease = store.grant_lease(30)
    for node in ("b", "a", "c"):
        assert store.create(store.keys.node(node), node, lease=lease)[0]
    store.swap_state(state(1), 0)
    nodes = sorted((kv for kv in store.read().kvs if store.keys.node_id(kv.key.decode())),
                   key=lambda kv: kv.create_revision)
    assert [store.keys.node_id(kv.key.decode()) for kv in nodes] == ["b", "a", "c"]
    store.revoke_lease(lease)


def test_prune_deletes_older_store_keys_and_keeps_the_round_itself(store: RunStore) -> None:
    lease = store.grant_lease(30)
    for generation in range(1, 13):
        store.publish_store(generation, f'{{"addr": "h", "port": {generation}}}', lease)
    store.prune_stores(12)
    left = sorted(parse_run(store.keys, store.read().kvs).stores)
    assert left == [1, 2, 3, 12], "the 8 rounds before 12 go; older ones were pruned by earlier rounds"
    store.revoke_lease(lease)


def test_runs_do_not_see_each_other(stores: Factory) -> None:
    run = f"contract-{uuid.uuid4().hex[:8]}"
    one, other = stores(run), stores(run + "-2")  # one is a prefix of the other's run id
    assert one.swap_state(state(1, "a"), 0)
    assert list(other.read().kvs) == [] and other.get(other.keys.state) is None


def test_a_watch_fires_after_writes_and_deletes_until_cancelled(store: RunStore) -> None:
    fired = threading.Event()
    handle = store.watch(lambda error: fired.set(), store.read().revision + 1)
    try:
        time.sleep(0.2)  # a watch may report that it started; only what follows counts
        fired.clear()
        assert store.swap_state(state(1, "a"), 0)
        assert wait_for(fired), "no event after a state write"
        lease = store.grant_lease(30)
        store.create(store.keys.node("a"), "a", lease=lease)
        assert wait_for(fired)
        fired.clear()
        store.revoke_lease(lease)
        assert wait_for(fired), "no event after a lease revoke deleted a key"
    finally:
        store.cancel_watch(handle)
    time.sleep(0.2)
    fired.clear()
    store.swap_state(state(2, "a"), token(store))
    assert not fired.wait(0.5), "a cancelled watch fired"


def test_a_watch_from_an_older_revision_reports_what_it_missed(store: RunStore) -> None:
    start = store.read().revision + 1
    assert store.swap_state(state(1, "a"), 0)
    fired = threading.Event()
    handle = store.watch(lambda error: fired.set(), start)
    try:
        assert wait_for(fired), "a change after start_revision was not reported"
    finally:
        store.cancel_watch(handle)
