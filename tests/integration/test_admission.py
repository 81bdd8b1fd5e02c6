"""Run admission on a real etcd: a job started with a join token admits only agents that hold it.

Strangers (real elastic-run agents without the token, or with another one) pointed at the job's
--rdzv-id fail at once with a clear error and never get a rank, while the job trains on and
finishes; a node with the token joins. Records forged straight into etcd (a registration, a round
state, a store address) are ignored or refused. And every socket the rendezvous listens on is
bound to --local-addr."""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.etcd_client import EtcdClient
from elastic.etcd_server import EtcdServer
from elastic.keys import run_prefix
from elastic.rendezvous import EtcdV3RendezvousHandler, RendezvousConfig
from elastic.round import RoundState
from tests.conftest import Procs
from tests.integration.test_elastic_faults import STEP_WORKER, Node, steps_at, wait_until
from tests.integration.test_rendezvous_security import AcceptCounter

pytestmark = pytest.mark.integration

TOKEN_ENV = "ELASTIC_JOIN_TOKEN"  # elastic.admission.TOKEN_ENV, spelled out: what a user sets


def agent(procs: Procs, monkeypatch: pytest.MonkeyPatch, endpoint: str, run_id: str, node: str, *extra: str,
          token: str, stop: Path) -> Node:
    """An elastic-run agent of the step worker with `token` in its environment ("" for none); its job
    finishes once the file `stop` exists."""
    monkeypatch.setenv(TOKEN_ENV, token)  # the agent inherits this process's environment
    return Node(procs, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.1",
                "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--node-id", node, *extra,
                str(STEP_WORKER), "--interval", "0.05", "--max-seconds", "90", "--stop-file", str(stop))


@pytest.mark.timeout(240)
def test_strangers_get_no_rank_while_the_job_with_the_token_trains_on_and_a_node_with_it_joins(
    procs: Procs, etcd: EtcdServer, client: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_id = f"adm-{uuid.uuid4().hex[:8]}"
    token = secrets.token_urlsafe(32)
    stop = tmp_path / "stop"
    victim = agent(procs, monkeypatch, etcd.endpoint, run_id, "n0", token=token, stop=stop)
    wait_until(lambda: steps_at([victim], 1) >= 10, 90, "the job training alone", [victim])

    strangers_at = time.time()
    no_token = agent(procs, monkeypatch, etcd.endpoint, run_id, "stranger", token="", stop=stop)
    wrong_token = agent(procs, monkeypatch, etcd.endpoint, run_id, "impostor", token=secrets.token_urlsafe(32),
                        stop=stop)
    for stranger in (no_token, wrong_token):
        assert stranger.proc.wait(timeout=60) == 1, stranger.text
        assert '"event": "round_closed"' not in stranger.text and '"event": "join"' not in stranger.text
    assert f"elastic-run: error: run '{run_id}' requires a join token; set $ELASTIC_JOIN_TOKEN or --rdzv-conf " \
           "join_token_file=PATH" in no_token.text
    assert (
        f"run '{run_id}' requires a join token, and this agent's is not the one the run was started with"
        in wrong_token.text
    )
    # They never registered, and the job did not notice them.
    nodes = run_prefix("elastic-train", run_id) + "nodes/"
    assert [m.key.decode()[len(nodes):] for _, m in client.raw.get_prefix(nodes)] == ["n0"]
    wait_until(lambda: steps_at([victim], 1, after=strangers_at) >= 20, 60, "the job training on", [victim])
    assert '"event": "restart"' not in victim.text and steps_at([victim], 2) == 0

    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    joiner = agent(procs, monkeypatch, etcd.endpoint, run_id, "n1", "--rdzv-conf", f"join_token_file={token_file}",
                   token="", stop=stop)
    wait_until(lambda: steps_at([victim, joiner], 2) >= 10, 90, "both nodes training together", [victim, joiner])
    stop.touch()  # the job finishes: both agents must exit 0
    for node in (victim, joiner):
        assert node.proc.wait(timeout=90) == 0, node.text[-3000:]
    for node in (victim, joiner, no_token, wrong_token):
        assert token not in node.text


@pytest.fixture
def probe() -> Iterator[AcceptCounter]:
    """A listening socket that stands in for a stranger's beacon and counts who connects to it."""
    p = AcceptCounter()
    try:
        yield p
    finally:
        p.close()


def make_handler(
    etcd: EtcdServer, run_id: str, node: str, *, local_addr: str | None = "127.0.0.1"
) -> EtcdV3RendezvousHandler:
    params = RendezvousParameters(backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, min_nodes=1, max_nodes=2,
                                  local_addr=local_addr, node_id=node, lease_ttl="2", join_timeout="20")
    return EtcdV3RendezvousHandler(RendezvousConfig.from_parameters(params))


@pytest.mark.timeout(90)
def test_records_forged_into_etcd_are_ignored_or_refused(
    etcd: EtcdServer, client: EtcdClient, run_id: str, probe: AcceptCounter, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, secrets.token_urlsafe(32))
    a = make_handler(etcd, run_id, "a")
    prefix = run_prefix("elastic-train", run_id)
    try:
        with ThreadPoolExecutor(1) as pool:
            info = pool.submit(a.next_rendezvous).result(timeout=60)
        assert (info.rank, info.world_size) == (0, 1)
        # A stranger with etcd write access registers by hand, with a made-up proof and a beacon.
        lease = client.raw.lease(30)
        forged = {"node_id": "evil", "addr": "127.0.0.1", "pid": 1, "beacon": probe.endpoint, "proof": "0" * 64}
        client.raw.put(prefix + "nodes/evil", json.dumps(forged), lease=lease)
        client.raw.put(prefix + "rdzv/store/2", json.dumps({"addr": "127.0.0.1", "port": 1, "proof": "0" * 64}))
        with caplog.at_level(logging.WARNING, logger="elastic.view"):
            # Several reads, by the watch thread (its events, then a periodic re-read) and by us.
            deadline = time.monotonic() + a.view.RESYNC.total_seconds() + 1
            while time.monotonic() < deadline:
                snap = a.view.read()
                assert "evil" not in snap.live and "evil" not in snap.nodes and 2 not in snap.stores
                assert a.num_nodes_waiting() == 0  # the job's workers would not even restart
                time.sleep(0.2)
        assert probe.accepted == 0, "the stranger's beacon was watched"
        warned = [r.getMessage() for r in caplog.records if prefix + "nodes/evil" in r.getMessage()]
        assert len(warned) == 1 and "without a valid proof of this run's join token" in warned[0]

        # The stranger rewrites the round state to put itself in: no agent of the job takes a rank from it.
        from elastic.errors import EtcdRecordError

        client.raw.put(prefix + "rdzv/state", RoundState(2, "closed", ("a", "evil"), nnodes=(1, 2)).to_json())
        with pytest.raises(EtcdRecordError, match="not signed with this run's join token") as refused:
            a.view.read().checked_state()
        assert refused.value.key == prefix + "rdzv/state"
        assert a.num_nodes_waiting() == 0  # healthy workers keep training meanwhile
        lease.revoke()
    finally:
        a.shutdown()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* has them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            host, _, hex_port = address.rpartition(":")
            if int(hex_port, 16) == port and state == "0A":
                found.append(host)
    return found


@pytest.mark.timeout(60)
def test_the_store_and_the_beacon_listen_on_local_addr_only(etcd: EtcdServer, run_id: str) -> None:
    a = make_handler(etcd, run_id, "a", local_addr="127.0.0.1")
    try:
        with ThreadPoolExecutor(1) as pool:
            info = pool.submit(a.next_rendezvous).result(timeout=60)
        assert info.rank == 0
        store_port = info.bootstrap_store_info.master_port
        beacon_port = int(a._beacon.address.rpartition(":")[2])  # noqa: SLF001
        loopback = "0100007F"  # 127.0.0.1 in /proc/net/tcp's byte order
        assert _listening(store_port) == [loopback], "rank 0's TCPStore listens beyond --local-addr"
        assert _listening(beacon_port) == [loopback], "the beacon listens beyond --local-addr"
        info.store.set("k", b"v")  # the store still serves at the advertised address
        assert info.store.get("k") == b"v"
    finally:
        a.shutdown()
