"""Issue D on real etcd and real processes: node loss, spares, etcd member loss and restart, restart
accounting. Each simulated node is one elastic-run agent with its own node id; "kill a node" SIGKILLs the
agent and all its workers. A hung worker's detection is tests/integration/test_kill_resume.py's stopped worker
(its job is that module's kind, and it resumes to that module's reference digest)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.events import EVENTS_DIR_ENV, read_events
from core.procfs import alive, cmdline, descendants  # a zombie (dead, not yet reaped) counts as gone
from elastic.etcd_server import EtcdCluster, EtcdServer, EtcdServerConfig
from tests.conftest import REPO, TINY, Procs

pytestmark = pytest.mark.integration

WORKER = REPO / "bench" / "recovery_worker.py"
STEP_WORKER = Path(__file__).with_name("step_worker.py")
"""`WORKER` with a stop file: a test ends the job once it saw what it needs."""
STEP = re.compile(r"step=(\d+) world=(\d+) t=([\d.]+)")


class Node:
    """An elastic-run agent whose output is collected by a thread."""

    def __init__(self, procs: Procs, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = procs.elastic_run(*args, env={"LOGLEVEL": "INFO", **(env or {})})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def of(events_dir: Path, event: str, **match: object) -> list[dict[str, Any]]:
    """The events named `event` under `events_dir` (core.events files) whose fields match `match`."""
    return [e for e in read_events(str(events_dir))
            if e["event"] == event and all(e.get(k) == v for k, v in match.items())]


def steps(nodes: list[Node]) -> list[tuple[int, int, float]]:
    return [(int(m[1]), int(m[2]), float(m[3])) for n in nodes for line in list(n.lines) if (m := STEP.search(line))]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, nodes: list[Node]) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            tail = "\n".join(f"--- node {i}:\n" + "".join(n.lines[-15:]) for i, n in enumerate(nodes))
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
        time.sleep(0.1)


def steps_at(nodes: list[Node], world: int, after: float = 0.0) -> int:
    return sum(1 for _, w, t in steps(nodes) if w == world and t > after)


def agent(procs: Procs, endpoint: str, run_id: str, node: str, nnodes: str, *extra: str, restarts: int = 3) -> Node:
    return Node(
        procs,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--max-restarts",
        str(restarts),
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--node-id",
        node,
        "--monitor-interval",
        "0.1",
        *extra,
        str(WORKER),
        "--interval",
        "0.05",
    )


@pytest.mark.timeout(150)
def test_node_loss_shrinks_the_world_and_a_new_node_grows_it_back_up_to_max(procs: Procs, etcd: EtcdServer) -> None:
    # --max-restarts 0 throughout: with it torchrun's survivors would give up; a lost peer (or a new node)
    # is not this node's failure, so it consumes no restart.
    run_id = f"faults-{uuid.uuid4().hex[:8]}"
    nodes = [agent(procs, etcd.endpoint, run_id, f"n{i}", "1:3", restarts=0) for i in range(3)]
    wait_until(lambda: steps_at(nodes, 3) >= 20, 90, "3 nodes training together", nodes)

    victim_tree = [nodes[2].proc.pid, *descendants(nodes[2].proc.pid)]
    killed = time.time()
    procs.kill_node(nodes[2].proc)
    nodes[2].proc.wait(timeout=10)
    wait_until(lambda: steps_at(nodes, 2, after=killed) >= 10, 60, "survivors training at world size 2", nodes)
    assert not [p for p in victim_tree if alive(p)], "the killed node left processes behind"
    assert all(n.proc.poll() is None for n in nodes[:2])  # the survivors' agents are still running

    nodes.append(agent(procs, etcd.endpoint, run_id, "n3", "1:3", restarts=0))
    joined = time.time()
    wait_until(lambda: steps_at(nodes, 3, after=joined) >= 10, 60, "world size 3 again after a 4th node joined", nodes)

    nodes.append(agent(procs, etcd.endpoint, run_id, "n4", "1:3", restarts=0))  # beyond max: a spare
    # Once the spare is registered (its `join` event) the others see it waiting; from then on 40 steps
    # (a few seconds, many monitor intervals) at max: a spare wrongly admitted would have stopped them.
    wait_until(lambda: '"event": "join"' in nodes[4].text, 60, "the spare to register", nodes)
    spare_joined = time.time()
    wait_until(
        lambda: steps_at(nodes, 3, after=spare_joined) >= 40,
        60,
        "training to go on at max while a spare waits",
        nodes,
    )
    assert steps_at(nodes, 4) == 0
    assert '"event": "round_closed"' not in nodes[4].text, "the spare was admitted beyond max nodes"


@pytest.mark.timeout(150)
def test_losing_one_of_three_etcd_members_does_not_disturb_training(procs: Procs) -> None:
    with EtcdCluster(3) as cluster:
        run_id = f"faults-{uuid.uuid4().hex[:8]}"
        nodes = [agent(procs, cluster.endpoints, run_id, f"n{i}", "2:2") for i in range(2)]
        wait_until(lambda: steps_at(nodes, 2) >= 20, 90, "2 nodes training together", nodes)
        cluster.members[0].kill()
        killed = time.time()
        wait_until(
            lambda: steps_at(nodes, 2, after=killed + 6) >= 20, 60, "training to go on without etcd member 0", nodes
        )
        assert all(n.proc.poll() is None for n in nodes)
        assert not any(
            '"event": "restart"' in line and '"reason": "worker failure"' in line for n in nodes for line in n.lines
        )


@pytest.mark.timeout(180)
def test_etcd_down_keeps_healthy_workers_training_and_a_worker_failed_meanwhile_restarts_once_it_is_back(
        procs: Procs, tmp_path: Path) -> None:
    first = EtcdServer(EtcdServerConfig(data_dir=str(tmp_path / "etcd"))).start()
    client_port, peer_port = first.client_port, first.peer_port
    second: EtcdServer | None = None
    try:
        run_id = f"faults-{uuid.uuid4().hex[:8]}"
        # etcd_timeout 3 s: one call's deadline, far shorter than this outage; the restart's rendezvous
        # waits for etcd within join_timeout (README, "etcd faults"), not within one call's deadline.
        nodes = [agent(procs, first.endpoint, run_id, f"n{i}", "2:2", "--rdzv-conf", "etcd_timeout=3")
                 for i in range(2)]
        wait_until(lambda: steps_at(nodes, 2) >= 20, 90, "2 nodes training together", nodes)
        first.kill()
        down = time.time()
        # Degraded mode: no etcd, but the workers and their process group are healthy, so they train on.
        wait_until(lambda: steps_at(nodes, 2, after=down + 5) >= 20, 60, "training while etcd is down", nodes)
        wait_until(
            lambda: any('"degraded": true' in line for n in nodes for line in n.lines),
            30,
            "degraded mode reported",
            nodes,
        )
        def restarts() -> list[str]:
            return [line for n in nodes for line in list(n.lines) if '"event": "restart"' in line]

        assert not restarts(), "a healthy group restarted because etcd went down"
        workers = [p for p in descendants(nodes[0].proc.pid) if "recovery_worker.py" in cmdline(p)]
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(8)  # etcd stays down for more than two of etcd_timeout while the group restarts
        assert all(n.proc.poll() is None for n in nodes), "an agent gave up while etcd was down"
        second = EtcdServer(
            EtcdServerConfig(data_dir=str(tmp_path / "etcd"), client_port=client_port, peer_port=peer_port)
        ).start()
        back = time.time()
        wait_until(lambda: steps_at(nodes, 2, after=back) >= 20, 90, "training after etcd came back", nodes)
        assert all(n.proc.poll() is None for n in nodes)
        assert any('"reason": "worker failure"' in line for line in restarts()), "the killed worker was not restarted"
        # The outage's lease warnings name the endpoint, once per node and outage (not one a second).
        refreshes = [line for n in nodes for line in n.lines if "refreshing the lease of" in line]
        assert 1 <= len(refreshes) <= 4 and all(f"etcd at {first.endpoint}" in line for line in refreshes), refreshes
    finally:
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.timeout(90)
def test_workers_end_themselves_when_their_agent_is_sigkilled(procs: Procs, tmp_path: Path) -> None:
    # torch starts workers in sessions of their own: killing only the agent used to leave them as
    # orphans hanging in their next collective. Resumable's parent watch ends them.
    events_dir = tmp_path / "events"
    node = Node(procs, "--standalone", "--nproc-per-node", "2", str(TINY), "--steps", "100000",
                "--ckpt-dir", str(tmp_path / "ckpt"), "--step-sleep", "0.05", env={EVENTS_DIR_ENV: str(events_dir)})
    wait_until(lambda: any(e["step"] >= 3 for e in of(events_dir, "step")), 60, "training to start", [node])
    workers = [int(e["pid"]) for e in of(events_dir, "worker_started", world=2)]
    assert len(workers) == 2
    os.kill(node.proc.pid, signal.SIGKILL)  # the agent alone; its workers keep running for now
    try:
        wait_until(lambda: not any(alive(p) for p in workers), 10, "the orphaned workers to exit", [node])
    finally:
        for pid in workers:  # not descendants of the dead agent any more: end them by pid
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
