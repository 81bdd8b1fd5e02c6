"""Membership on a real etcd: leased keys, join order, leave, lease expiry of a killed agent,
node id conflicts and the keep-alive."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from elastic.errors import NodeIdConflictError
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.etcd_server import EtcdServer, EtcdServerConfig
from elastic.etcd_store import EtcdRunStore
from elastic.keys import RunKeys
from elastic.membership import Membership, MembershipConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]



@pytest.fixture
def member(client: EtcdClient, run_id: str) -> Iterator[Callable[..., Membership]]:
    """Makes members of `run_id` on their own clients; every one leaves at teardown."""
    made: list[Membership] = []
    clients: list[EtcdClient] = []

    def make(node_id: str, ttl: float = 3) -> Membership:
        own = EtcdClient(client.config)
        clients.append(own)
        m = Membership(EtcdRunStore(own, RunKeys.of(run_id)),
                       MembershipConfig(run_id=run_id, node_id=node_id, lease_ttl=timedelta(seconds=ttl)))
        made.append(m)
        return m

    try:
        yield make
    finally:
        for m in made:
            m.leave()
        for c in clients:
            c.close()


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_join_registers_the_key_under_a_live_lease(client: EtcdClient, member) -> None:
    m = member("node-a")
    m.join({"addr": "10.0.0.1"})
    value, meta = client.raw.get(m.key)
    assert value is not None, f"{m.key} not registered"
    doc = json.loads(value)
    assert doc["node_id"] == "node-a" and doc["addr"] == "10.0.0.1"
    assert meta.lease_id != 0, "the key must be attached to a lease"
    info = client.raw.get_lease_info(meta.lease_id)
    assert info.TTL > 0
    assert m.key.encode() in info.keys


def test_live_nodes_lists_members_in_join_order(member) -> None:
    second, first = member("zeta"), member("alpha")
    second.join()
    first.join()
    assert second.live_nodes() == ["zeta", "alpha"]
    assert first.live_nodes() == ["zeta", "alpha"]


def test_leave_removes_the_key_at_once(client: EtcdClient, member) -> None:
    stays, goes = member("stays"), member("goes")
    stays.join()
    goes.join()
    assert stays.live_nodes() == ["stays", "goes"]
    goes.leave()
    assert client.raw.get(goes.key) == (None, None)
    assert stays.live_nodes() == ["stays"]


_CHILD = """
import sys, time
from datetime import timedelta
from elastic.etcd_client import EtcdClientConfig
from elastic.etcd_store import EtcdRunStore
from elastic.keys import RunKeys
from elastic.membership import Membership, MembershipConfig
endpoint, run_id = sys.argv[1:3]
m = Membership(EtcdRunStore.connect(EtcdClientConfig(endpoints=endpoint), RunKeys.of(run_id)),
               MembershipConfig(run_id=run_id, node_id="doomed", lease_ttl=timedelta(seconds=1)))
m.join()
print("joined", flush=True)
time.sleep(120)
"""


def test_sigkilled_member_disappears_after_its_lease_ttl(etcd: EtcdServer, run_id: str, member, procs) -> None:
    ttl = 1
    watcher = member("watcher")
    watcher.join()
    child = procs.start([sys.executable, "-c", _CHILD, etcd.endpoint, run_id])
    assert wait_until(lambda: "doomed" in watcher.live_nodes(), timeout=15), "child never joined"

    procs.kill_group(child, signal.SIGKILL)
    assert child.wait(timeout=10) == -signal.SIGKILL
    killed_at = time.monotonic()
    # No graceful leave happened: the key stays until etcd expires the lease.
    assert "doomed" in watcher.live_nodes()
    assert wait_until(lambda: "doomed" not in watcher.live_nodes(), timeout=ttl + 3), (
        f"killed member still listed {time.monotonic() - killed_at:.1f}s after SIGKILL"
    )
    assert watcher.live_nodes() == ["watcher"]


def test_duplicate_node_id_is_rejected_naming_the_key(client: EtcdClient, member) -> None:
    original, duplicate = member("twin"), member("twin")
    original.join()
    with pytest.raises(NodeIdConflictError) as err:
        duplicate.join()
    assert original.key in str(err.value)
    assert "twin" in str(err.value)
    # The original registration is untouched.
    value, _ = client.raw.get(original.key)
    assert value is not None
    assert original.live_nodes() == ["twin"]


@pytest.mark.timeout(20)
def test_keep_alive_holds_the_lease_well_past_the_ttl(client: EtcdClient, member) -> None:
    ttl = 1
    m = member("steady", ttl=ttl)
    m.join()
    _, meta = client.raw.get(m.key)
    granted = client.raw.get_lease_info(meta.lease_id).grantedTTL  # etcd may round a 1s TTL up
    deadline = time.monotonic() + max(3 * ttl, granted + 1)
    while time.monotonic() < deadline:
        value, now = client.raw.get(m.key)
        assert value is not None, f"{m.key} vanished: the keep-alive did not refresh the lease"
        time.sleep(0.1)
    # The very same registration: never expired and re-created behind our back.
    assert now.create_revision == meta.create_revision
    assert now.lease_id == meta.lease_id


def test_after_every_lease_lapsed_a_live_set_cannot_say_nodes_are_gone_for_one_ttl(client: EtcdClient,
                                                                                   member) -> None:
    """etcd paused past the lease TTL expires every node's lease when it resumes; each node registers again at
    its next refresh. A live set read in between lacked nodes that were alive: both agents of a healthy job judged
    it below --nnodes MIN and stopped it (exit 75). Now it cannot judge until this node is back in the live set
    and one TTL has passed since its lease was renewed."""
    ttl = 2
    a, b = member("lapse-a", ttl=ttl), member("lapse-b", ttl=ttl)
    a.join()
    b.join()
    assert a.live_set_settled(frozenset(a.live_nodes()))
    assert not a.live_set_settled(frozenset({"lapse-b"}))  # a live set without this node: its lease lapsed
    for m in (a, b):  # what a resumed etcd does to the leases that ran out while it was stopped
        assert m.lease_id is not None
        client.raw.revoke_lease(m.lease_id)
    lapsed = a.lease_id
    assert wait_until(lambda: a.lease_id != lapsed and "lapse-a" in a.live_nodes(), 10), "a did not register again"
    renewed = time.monotonic()
    assert not a.live_set_settled(frozenset(a.live_nodes()))  # b may not be back yet: no judgement
    assert wait_until(lambda: a.live_set_settled(frozenset(a.live_nodes())), 3 * ttl)
    assert time.monotonic() - renewed >= ttl * 0.9
    assert set(a.live_nodes()) == {"lapse-a", "lapse-b"}  # both back: the judgement would have been wrong


def test_the_view_follows_etcd_whose_data_was_reset(tmp_path) -> None:
    """etcd restarted with an empty data dir counts its revisions from 1 again. The view kept the newest
    revision it had seen and dropped every later read as older, so it never saw the run's nodes again (a node
    lost after that was found only by the worker's timeout and a restart of the group: 10.6 s, not 0.25 s)."""
    from elastic.etcd_client import EtcdClientConfig
    from elastic.etcd_server import EtcdServerConfig
    from elastic.view import RunView

    first = EtcdServer(EtcdServerConfig(data_dir=str(tmp_path / "one"))).start()
    port = first.client_port
    own = EtcdClient(EtcdClientConfig(endpoints=first.endpoint))
    second: EtcdServer | None = None
    try:
        store = EtcdRunStore(own, RunKeys.of("reset-run"))
        for i in range(20):  # revisions well above the fresh server's
            own.raw.put(f"/padding/{i}", "x")
        store.create(store.keys.node("before"), json.dumps({"node_id": "before", "joined_at": 1.0}),
                     lease=own.raw.lease(60).id)
        view = RunView(store).start()
        try:
            assert wait_until(lambda: view.snapshot().live == frozenset({"before"}), 10)
            first.stop()
            second = EtcdServer(EtcdServerConfig(data_dir=str(tmp_path / "two"), client_port=port)).start()
            assert wait_until(lambda: _created(store, own, "after"), 10)  # the client's endpoint back first
            assert wait_until(lambda: view.snapshot().live == frozenset({"after"}), 15), view.snapshot().live
        finally:
            view.stop()
    finally:
        own.close()
        first.stop()
        for server in (first, second):
            if server is not None:
                server.stop()


def _created(store: EtcdRunStore, client: EtcdClient, node_id: str) -> bool:
    try:
        return store.create(store.keys.node(node_id), json.dumps({"node_id": node_id, "joined_at": 2.0}),
                            lease=client.raw.lease(60).id)[0]
    except Exception:  # noqa: BLE001 - the client's endpoint is marked failed for a second after the restart
        return False


@pytest.mark.timeout(90)
def test_a_live_nodes_lease_outlives_a_long_etcd_outage(tmp_path, run_id: str) -> None:
    """etcd down for 30 s, then back with its data: every lease gets its TTL again, and a live node must refresh
    its own in time. gRPC's reconnect backoff (up to 120 s) had grown so far by then that the node reached etcd
    again up to 15 s after it was back: its lease lapsed, and a peer judged the healthy job below --nnodes MIN
    and stopped it (CI, stop 51)."""
    first = EtcdServer(EtcdServerConfig(data_dir=str(tmp_path / "etcd"))).start()
    ports = {"client_port": first.client_port, "peer_port": first.peer_port}
    client = EtcdClient(EtcdClientConfig(endpoints=first.endpoint))
    ttl = 2
    m = Membership(EtcdRunStore(client, RunKeys.of(run_id)),
                   MembershipConfig(run_id=run_id, node_id="outage-a", lease_ttl=timedelta(seconds=ttl)))
    second: EtcdServer | None = None
    try:
        m.join()
        lease = m.lease_id
        first.kill()
        time.sleep(30)  # the keep-alive tries every TTL/3 meanwhile, as a node's does
        second = EtcdServer(EtcdServerConfig(data_dir=str(tmp_path / "etcd"), **ports)).start()
        # The keep-alive shares this client's channel: once it answers, the next refresh is at most TTL/3 away.
        assert wait_until(lambda: _answers(client, m.key), 30), "the client never reached etcd again"
        time.sleep(ttl)
        assert m.lease_id == lease, "the lease of a live node lapsed after etcd came back: it reconnected too late"
        value, meta = client.raw.get(m.key)
        assert value is not None and meta.lease_id == lease
    finally:
        m.leave()
        client.close()
        for server in (first, second):
            if server is not None:
                server.stop()


def _answers(client: EtcdClient, key: str) -> bool:
    try:
        client.raw.get(key)
        return True
    except Exception:  # noqa: BLE001 - etcd not reachable yet
        return False
