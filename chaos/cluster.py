"""The simulated nodes of one job, on one machine, on the etcd of `chaos.etcd_members`.

A simulated node is one `elastic-run` agent in a session of its own, with its own node id, its
own local-tier directory and its own event directory; torch starts its workers in sessions of
their own too, so a node is addressed as the agent's process tree, by pid (`core.procfs`). Every
process the cluster starts, and every descendant it ever sees, goes into the `ProcessLedger`.

What a node did is read from its event directory (`chaos.timeline`), never from its output; the
output goes to a log file for people.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from chaos.config import ChaosConfig
from chaos.etcd_members import EtcdMembers
from chaos.ledger import ProcessLedger
from chaos.network import NetnsNetwork, NodeNet
from chaos.samples import SAMPLE_LOG_ENV
from chaos.timeline import AgentEvent, Timeline
from core.events import EVENTS_DIR_ENV, NODE_ID_ENV, events_path
from core.procfs import descendants, environ, kill_tree, stat


@dataclass(frozen=True)
class Worker:
    pid: int
    rank: int
    local_rank: int
    group_rank: int


def _spare_worker(pid: int, env: dict[str, str]) -> Worker | None:
    """A warm spare (elastic/spare.py) that became a worker: /proc keeps the environment it started in, without
    the rank, so its rank comes from its newest event record that names one; None for a spare not in use."""
    directory = env.get(EVENTS_DIR_ENV)
    if not directory:
        return None
    try:
        lines = Path(events_path(directory, pid)).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
            return Worker(pid, int(record["rank"]), int(record["local_rank"]), int(record.get("group_rank", -1)))
        except (ValueError, KeyError, TypeError):
            continue
    return None


class SimNode:
    """One simulated node: an `elastic-run` agent (own session); its output goes to `log_path`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], *, local_dir: Path, log_path: Path,
                 ledger: ProcessLedger, net: NodeNet | None = None) -> None:
        self.name = name
        self.local_dir = local_dir
        self.log_path = log_path
        self.net = net
        self.killed = False
        self.partitioned = False
        """Cut off the network: out of the job, though its processes still run until the end."""
        self._log = open(log_path, "w", buffering=1)  # noqa: SIM115 - closed by the reader thread
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True, errors="replace")
        ledger.record(self.proc.pid, f"agent of {name}")
        self._reader = threading.Thread(target=self._read, name=f"chaos-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self._log.write(f"{time.monotonic():.3f} {line}")  # for people: the harness reads events
        finally:
            self._log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> list[Worker]:
        """The agent's worker processes (children that carry torch's RANK), by their environment."""
        out = []
        for pid in descendants(self.pid):
            st = stat(pid)
            if st is None or st.ppid != self.pid or st.state == "Z":
                continue
            env = environ(pid)
            if "RANK" in env and "LOCAL_RANK" in env:
                out.append(Worker(pid, int(env["RANK"]), int(env["LOCAL_RANK"]), int(env.get("GROUP_RANK", -1))))
            elif (worker := _spare_worker(pid, env)) is not None:
                out.append(worker)
        return sorted(out, key=lambda w: w.rank)

    def kill(self) -> list[int]:
        """SIGKILL the agent and every descendant (workers live in sessions of their own)."""
        signalled = kill_tree(self.pid, signal.SIGKILL)
        self.killed = True
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return signalled

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the agent (it stops its workers), then SIGKILL whatever of its tree is left."""
        tree = [self.pid, *descendants(self.pid)]
        if self.running():
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for pid in tree:
            kill_tree(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def join_output(self, timeout: float = 10.0) -> None:
        self._reader.join(timeout)


class Cluster:
    """The simulated nodes of one job (the reference run or the chaos run) on a shared etcd."""

    def __init__(self, config: ChaosConfig, *, name: str, work_dir: Path, log_dir: Path, etcd: EtcdMembers,
                 ledger: ProcessLedger, shared_flag: str | None = None, network: NetnsNetwork | None = None) -> None:
        self.config = config
        self.name = name
        self.run_id = f"chaos-{name}-{uuid.uuid4().hex[:8]}"
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.etcd = etcd
        self.ledger = ledger
        self.shared_flag = shared_flag
        self.samples_dir = work_dir / "samples"
        """Where the workers log the sample ids each rank consumes (`ELASTIC_SAMPLE_LOG_DIR`)."""
        self.events_dir = work_dir / "events"
        """`<events_dir>/<node>`: each node's `ELASTIC_EVENTS_DIR`. Not in its local tier, which disk-full fills."""
        self.network = network
        self.shared_dir = work_dir / "shared"
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        self.timeline = Timeline()
        self.nodes: list[SimNode] = []
        self.mounts: list[Path] = []
        self.t0 = time.monotonic()
        self.barrier = work_dir / ".start"
        ledger.watch(lambda: [n.pid for n in self.nodes if n.running()])

    def start(self, nodes: int, *, tmpfs_mb: int | None = None, timeout_s: float = 120.0) -> None:
        """Start `nodes` nodes and let them all into the rendezvous at once (see `chaos._agent`)."""
        for _ in range(nodes):
            self.add_node(tmpfs_mb=tmpfs_mb)
        deadline = time.monotonic() + timeout_s
        self.wait(lambda: all((self.work_dir / f".ready-{n.name}").exists() or not n.running() for n in self.nodes),
                  deadline)
        self.barrier.touch()

    def add_node(self, *, tmpfs_mb: int | None = None) -> SimNode:
        name = f"node{len(self.nodes)}"
        local_dir = self.work_dir / name
        local_dir.mkdir(parents=True, exist_ok=True)
        if tmpfs_mb is not None:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_mb}m", "tmpfs", str(local_dir)],
                           check=True, capture_output=True, timeout=30)
            self.mounts.append(local_dir)
        cfg = self.config
        script_argv = cfg.script_argv(local_dir=local_dir, shared_dir=self.shared_dir, node=name)
        if cfg.is_default_script and self.shared_flag:
            script_argv += [self.shared_flag, str(self.shared_dir)]
        net = self.network.add_node() if self.network is not None else None
        argv = [
            sys.executable, "-m", "chaos._agent", "--ready", str(self.work_dir / f".ready-{name}"),
            "--barrier", str(self.barrier), "--",
            "--nnodes", f"1:{cfg.max_nodes}", "--nproc-per-node", str(cfg.nproc_per_node),
            "--max-restarts", "100", "--monitor-interval", "0.1",
            "--rdzv-endpoint", self.etcd.endpoints, "--rdzv-id", self.run_id, "--node-id", name,
            "--rdzv-conf", "join_timeout=120",
            *(["--hang-timeout", str(cfg.hang_timeout_s)] if cfg.detects_hangs else []),
            "--reform", cfg.reform,
            *([] if cfg.warm_spare is None else ["--warm-spare" if cfg.warm_spare else "--no-warm-spare"]),
            *(["--local-addr", net.address] if net else []),
            str(cfg.script), *script_argv,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO", "OMP_NUM_THREADS": "1",
               "ELASTIC_CHAOS_NODE": name, "ELASTIC_CHAOS_LOCAL_DIR": str(local_dir),
               "ELASTIC_CHAOS_SHARED_DIR": str(self.shared_dir),
               EVENTS_DIR_ENV: str(self.events_dir / name), NODE_ID_ENV: name, SAMPLE_LOG_ENV: str(self.samples_dir)}
        self.timeline.watch(name, self.events_dir / name)
        if net is not None:
            assert self.network is not None
            argv = self.network.wrap(net, argv)
            env["GLOO_SOCKET_IFNAME"] = net.interface
        node = SimNode(name, argv, env, local_dir=local_dir, log_path=self.log_dir / f"{self.name}-{name}.log",
                       ledger=self.ledger, net=net)
        self.nodes.append(node)
        return node

    @property
    def live_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes if not n.killed and not n.partitioned and n.running()]

    def finished(self) -> bool:
        """Every node still in the job has exited (a partitioned node never learns that the job ended)."""
        return all(not n.running() for n in self.nodes if not n.partitioned)

    def workers(self) -> list[tuple[SimNode, Worker]]:
        return [(n, w) for n in self.live_nodes for w in n.workers()]

    def node_by_group_rank(self, target: int | Literal["last"]) -> SimNode | None:
        """The live node whose workers have GROUP_RANK `target` (`last`: the highest)."""
        ranked: dict[int, SimNode] = {}
        for node, worker in self.workers():
            ranked.setdefault(worker.group_rank, node)
        if not ranked:
            ranked = self._group_ranks_from_events()
        if not ranked:
            return None
        ranks = sorted(ranked)
        if target == "last":
            return ranked[ranks[-1]]
        return ranked.get(target, ranked[ranks[target % len(ranks)]])

    def _group_ranks_from_events(self) -> dict[int, SimNode]:
        latest: dict[str, tuple[int, int]] = {}
        for e in self.timeline.events():
            if isinstance(e, AgentEvent) and e.name == "round_closed":
                latest[e.node] = (int(e.fields.get("generation", 0)), int(e.fields.get("rank", -1)))
        by_name = {n.name: n for n in self.live_nodes}
        top = max((g for g, _ in latest.values()), default=0)
        return {rank: by_name[name] for name, (g, rank) in latest.items() if g == top and name in by_name}

    def worker_by_rank(self, rank: int) -> tuple[SimNode, Worker] | None:
        """The live worker of global rank `rank` (modulo the current world size)."""
        found = self.workers()
        if not found:
            return None
        world = max(w.rank for _, w in found) + 1
        for node, worker in found:
            if worker.rank == rank % world:
                return node, worker
        return found[0]

    def wait(self, until: Callable[[], bool], deadline: float, poll_s: float = 0.05) -> bool:
        while time.monotonic() < deadline:
            if until():
                return True
            time.sleep(poll_s)
        return until()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(grace_s=5.0)
        for node in self.nodes:
            node.join_output()
        for mount in self.mounts:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30, check=False)
        self.mounts.clear()
