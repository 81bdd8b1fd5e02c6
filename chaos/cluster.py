"""The cluster under test, on one machine: an etcd of 1 or 3 members and N simulated nodes.

A simulated node is one `elastic-run` agent in a session of its own, with its own node id and its
own local-tier directory; torch starts its workers in sessions of their own too, so a node is
addressed as the agent's process tree, by pid (`core.procfs`). Every process the cluster
starts, and every descendant it ever sees, is recorded with its start time, so that the end of the
run can prove that none is left (pids are reused; the start time tells them apart).
"""

from __future__ import annotations

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
from chaos.network import NetnsNetwork, NodeNet
from chaos.timeline import AgentEvent, Timeline, parse
from core.procfs import alive, cmdline, descendants, environ, kill_tree, stat
from elastic.etcd_server import EtcdServer, EtcdServerConfig, free_port

# -- processes -----------------------------------------------------------------------------------


class ProcessLedger:
    """Every process started or seen, by (pid, start time). A sampler thread adds descendants."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, int], str] = {}
        self._below_roots: set[int] = set()
        self._roots: list[Callable[[], list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="chaos-ledger", daemon=True)
        self._thread.start()

    def watch(self, roots: Callable[[], list[int]]) -> None:
        """Sample the trees under the pids `roots()` returns, from now on."""
        with self._lock:
            self._roots.append(roots)

    def record(self, pid: int, what: str = "") -> None:
        st = stat(pid)
        if st is not None:
            with self._lock:
                self._seen.setdefault((pid, st.start), what or cmdline(pid)[:160])

    def record_tree(self, pid: int) -> list[int]:
        pids = [pid, *descendants(pid)]
        for p in pids:
            self.record(p)
        return pids

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                roots = list(self._roots)
            for get in roots:
                for pid in get():
                    below = self.record_tree(pid)[1:]
                    with self._lock:
                        self._below_roots.update(below)
            with self._lock:
                orphans = set(self._below_roots)
            _reap_orphans(orphans)

    def survivors(self) -> list[str]:
        """Recorded processes still alive, as 'pid cmdline'."""
        with self._lock:
            items = list(self._seen.items())
        return [f"{pid} {what}" for (pid, start), what in items if alive(pid, start)]

    def kill_survivors(self) -> None:
        with self._lock:
            items = list(self._seen)
        for pid, start in items:
            if alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_SUBREAPER = False


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux), so none escapes the ledger and
    their zombies are reaped here. For the CLI's own process; a library caller decides for itself."""
    global _SUBREAPER
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        _SUBREAPER = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        _SUBREAPER = False
    return _SUBREAPER


def _reap_orphans(candidates: set[int]) -> None:
    """Reap zombies re-parented to us. Only processes first seen below an agent qualify: the status
    of a child we started ourselves belongs to its Popen object."""
    if not _SUBREAPER:
        return
    me = os.getpid()
    for pid in candidates:
        st = stat(pid)
        if st is not None and st.state == "Z" and st.ppid == me:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


# -- etcd ----------------------------------------------------------------------------------------


class EtcdMembers:
    """An etcd of 1 or 3 members on fixed free ports and persistent data dirs, so that a member can
    be killed and the whole cluster restarted on the same data."""

    def __init__(self, count: int, work_dir: Path, *, host: str = "127.0.0.1") -> None:
        ports = [(free_port(host), free_port(host)) for _ in range(count)]
        initial = ",".join(f"m{i}=http://{host}:{peer}" for i, (_, peer) in enumerate(ports)) if count > 1 else None
        self.host = host
        self.configs = [
            EtcdServerConfig(host=host, name=f"m{i}", data_dir=str(work_dir / f"m{i}"), client_port=client,
                             peer_port=peer, initial_cluster=initial)
            for i, (client, peer) in enumerate(ports)
        ]
        self.servers: list[EtcdServer | None] = [None] * count
        self.ledger: ProcessLedger | None = None

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.host}:{c.client_port}" for c in self.configs)

    @property
    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if s is not None]

    def start(self, members: list[int] | None = None) -> EtcdMembers:
        """Start members (all by default) together: one member alone has no quorum and never gets healthy."""
        members = list(range(len(self.configs))) if members is None else members
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                server = EtcdServer(self.configs[i]).start()
                self.servers[i] = server
                if self.ledger is not None and server.pid is not None:
                    self.ledger.record_tree(server.pid)
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]
        return self

    def kill(self, i: int) -> int | None:
        """SIGKILL member `i` (its guard and etcd). Returns the guard's pid."""
        server = self.servers[i]
        if server is None:
            return None
        pid = server.pid
        if self.ledger is not None and pid is not None:
            self.ledger.record_tree(pid)
        server.kill()
        self.servers[i] = None
        return pid

    def restart(self, down_s: float) -> list[int]:
        """Stop every live member, stay down `down_s` seconds, start them again on the same data."""
        members = self.live
        for i in members:
            server = self.servers[i]
            assert server is not None
            server.stop()
            self.servers[i] = None
        time.sleep(down_s)
        self.start(members)
        return members

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers if s is not None and s.pid is not None]

    def stop(self) -> None:
        for i, server in enumerate(self.servers):
            if server is not None:
                server.stop()
                self.servers[i] = None


# -- nodes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    pid: int
    rank: int
    local_rank: int
    group_rank: int


class SimNode:
    """One simulated node: an `elastic-run` agent (own session) whose output feeds the timeline."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], *, local_dir: Path, log_path: Path,
                 timeline: Timeline, ledger: ProcessLedger, net: NodeNet | None = None) -> None:
        self.name = name
        self.local_dir = local_dir
        self.log_path = log_path
        self.net = net
        self.killed = False
        self.partitioned = False
        """Cut off the network: out of the job, though its processes still run until the end."""
        self._timeline = timeline
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
                t = time.monotonic()
                self._log.write(f"{t:.3f} {line}")
                event = parse(t, self.name, line.rstrip("\n"))
                if event is not None:
                    self._timeline.add(event)
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
                 ledger: ProcessLedger, shared_flag: str | None = None, samples_flag: str | None = None,
                 network: NetnsNetwork | None = None) -> None:
        self.config = config
        self.name = name
        self.run_id = f"chaos-{name}-{uuid.uuid4().hex[:8]}"
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.etcd = etcd
        self.ledger = ledger
        self.shared_flag = shared_flag
        self.samples_flag = samples_flag
        self.samples_dir = work_dir / "samples"
        """Where the default script logs the sample ids each rank consumes (with `--log-samples`)."""
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
        if cfg.is_default_script and self.samples_flag:
            script_argv += [self.samples_flag, str(self.samples_dir)]
        net = self.network.add_node() if self.network is not None else None
        argv = [
            sys.executable, "-m", "chaos._agent", "--ready", str(self.work_dir / f".ready-{name}"),
            "--barrier", str(self.barrier), "--",
            "--nnodes", f"1:{cfg.max_nodes}", "--nproc-per-node", str(cfg.nproc_per_node),
            "--max-restarts", "100", "--monitor-interval", "0.1",
            "--rdzv-endpoint", self.etcd.endpoints, "--rdzv-id", self.run_id, "--node-id", name,
            "--rdzv-conf", "join_timeout=120",
            *(["--hang-timeout", str(cfg.hang_timeout_s)] if cfg.detects_hangs else []),
            *(["--local-addr", net.address] if net else []),
            str(cfg.script), *script_argv,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO", "OMP_NUM_THREADS": "1",
               "ELASTIC_CHAOS_NODE": name, "ELASTIC_CHAOS_LOCAL_DIR": str(local_dir),
               "ELASTIC_CHAOS_SHARED_DIR": str(self.shared_dir)}
        if net is not None:
            assert self.network is not None
            argv = self.network.wrap(net, argv)
            env["GLOO_SOCKET_IFNAME"] = net.interface
        node = SimNode(name, argv, env, local_dir=local_dir, log_path=self.log_dir / f"{self.name}-{name}.log",
                       timeline=self.timeline, ledger=self.ledger, net=net)
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
