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
from elastic.etcd_client import EtcdClient
from elastic.etcd_server import EtcdServer
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
