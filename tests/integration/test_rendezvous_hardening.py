"""Hardening of the etcd-v3 rendezvous against stray agents, junk in etcd and bad --rdzv-conf, with
real `elastic-run` agents, workers and etcd (issue G, items 1, 6 and 7).

- A refused (other --nnodes), duplicate (--node-id in use) or timed-out spare agent leaves the run
  open: the healthy job can still restart and scale; only the job's own success closes the run.
- Junk under the run prefix is named (key and `etcdctl del`), never taken for an unreachable etcd:
  stray node and store records are ignored; a bad round state leaves healthy workers running and
  fails the next rendezvous naming the key.
- A bad --rdzv-conf exits 2 before an embedded etcd starts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from elastic import launcher
from elastic.etcd_client import EtcdClient
from elastic.etcd_server import EtcdServer
from elastic.keys import run_prefix
from tests.conftest import Procs, read_state

pytestmark = [pytest.mark.integration]

# Rank by rank, each worker prints one READY line, then idles until the test creates `stop`.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo")
    line = (f"READY node={os.environ['NODE']} rank={dist.get_rank()} world={dist.get_world_size()} "
            f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} pid={os.getpid()}")
    os.write(1, (line + "\\n").encode())
    stop = Path(sys.argv[1])
    while not stop.exists():
        time.sleep(0.1)
    dist.destroy_process_group()
    """
)
KNOWN_KEYS = ("node_id", "prefix", "lease_ttl", "join_timeout", "last_call_timeout", "etcd_timeout", "cacert",
              "ca_cert", "cert", "key", "user", "password", "password_file", "join_token_file")
READY = re.compile(r"READY node=(\S+) rank=(\d+) world=(\d+) restart=(\d+) pid=(\d+)")


class Agent:
    """An `elastic-run` process whose merged output is collected by a thread, for waiting on lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float, since: int = 0) -> re.Match[str]:
        """The first match at line index >= `since`; fails with the output after `timeout` seconds."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[since:]:
                    if m := regex.search(line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._thread.is_alive()):
                    pytest.fail(f"no line matching {regex.pattern!r} within {timeout:.0f}s (rc={self.proc.poll()}):\n"
                                + "".join(self.lines))
                self._cond.wait(min(left, 0.5))

    def ready(self, timeout: float, *, world: int, since: int = 0) -> re.Match[str]:
        return self.wait_for(rf"READY node=(\S+) rank=(\d+) world=({world}) restart=(\d+) pid=(\d+)", timeout, since)

    def finish(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        self._thread.join(timeout=10)
        return rc, self.output

    def mark(self) -> int:
        """A position in the output: later waits look only at what comes after it."""
        with self._cond:
            return len(self.lines)


def start_agent(procs: Procs, etcd: EtcdServer, run_id: str, script: Path, stop: Path, node: str, *flags: str,
                nnodes: str = "1:2", conf: str = "lease_ttl=2,last_call_timeout=2,join_timeout=120") -> Agent:
    proc = procs.elastic_run(
        "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.1",
        "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--node-id", node, "--rdzv-conf", conf,
        *flags, str(script), str(stop), env={"NODE": node},
    )
    return Agent(proc)


@pytest.fixture
def worker(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script, tmp_path / "stop"


def kill_worker(match: re.Match[str]) -> None:
    os.kill(int(match.group(5)), signal.SIGKILL)


@pytest.mark.timeout(420)
def test_refused_duplicate_and_spare_agents_leave_the_run_open_and_only_success_closes_it(
    procs: Procs, etcd: EtcdServer, run_id: str, client: EtcdClient, worker: tuple[Path, Path]
) -> None:
    script, stop = worker
    a = start_agent(procs, etcd, run_id, script, stop, "a")
    b = start_agent(procs, etcd, run_id, script, stop, "b")
    # Once round 1 closed with a and b (a is registered, the round is full), three agents that must not
    # touch the run: another job's --nnodes under the same id, a second agent with a node id in use, and
    # a spare whose join_timeout runs out. They start while a's and b's workers start (both import torch).
    a.wait_for(r'"event": "round_closed".*"participants": \[("a", "b"|"b", "a")\]', 150)
    conflict = start_agent(procs, etcd, run_id, script, stop, "other-job", nnodes="2:3", conf="join_timeout=60")
    duplicate = start_agent(procs, etcd, run_id, script, stop, "a", conf="join_timeout=60")
    spare = start_agent(procs, etcd, run_id, script, stop, "spare", conf="join_timeout=3,lease_ttl=2")
    a.ready(150, world=2)
    b.ready(150, world=2)

    rc, out = conflict.finish(120)
    assert rc == 1 and "--nnodes 1:2" in out and "--nnodes 2:3" in out, out
    rc, out = duplicate.finish(120)
    assert rc == 1 and "node id 'a' is already registered" in out, out
    rc, out = spare.finish(120)
    assert rc == 1 and "waiting as a spare" in out and "did not complete within 3s" in out, out
    for refused in (conflict, duplicate, spare):
        assert "READY" not in refused.output, "a refused agent started workers"

    state = read_state(client, run_id)
    assert state is not None and not state.shutdown, f"a refused agent closed the run: {state}"
    assert a.proc.poll() is None and b.proc.poll() is None, a.output + b.output
    # Node a is still registered: the duplicate did not overwrite or revoke its record.
    value, _ = client.raw.get(run_prefix("elastic-train", run_id) + "nodes/a")
    assert value is not None and b'"pid"' in value

    # The job can still restart: a worker of b dies, both nodes re-form at world 2.
    at_a, at_b = a.mark(), b.mark()
    kill_worker(READY.search(b.output))  # type: ignore[arg-type]
    a.ready(120, world=2, since=at_a)
    b.ready(120, world=2, since=at_b)

    # ... and scale: node b is lost (SIGKILL, agent and workers), a goes on alone, c joins.
    at_a = a.mark()
    procs.kill_node(b.proc)
    a.ready(120, world=1, since=at_a)
    at_a = a.mark()
    c = start_agent(procs, etcd, run_id, script, stop, "c")
    a.ready(150, world=2, since=at_a)
    c.ready(60, world=2)

    # The job's success closes the run.
    stop.touch()
    for agent in (a, c):
        rc, out = agent.finish(120)
        assert rc == 0, out
    state = read_state(client, run_id)
    assert state is not None and state.shutdown, f"the finished job left its run open: {state}"


@pytest.mark.timeout(300)
def test_junk_under_the_run_prefix_is_named_never_taken_for_an_unreachable_etcd(
    procs: Procs, etcd: EtcdServer, run_id: str, client: EtcdClient, worker: tuple[Path, Path]
) -> None:
    script, stop = worker
    prefix = run_prefix("elastic-train", run_id)
    # Before the job starts: a stranger's node records (one leaseless, one not JSON under a
    # lease) and stray round-store keys.
    stranger_lease = client.raw.lease(120)
    client.raw.put(prefix + "nodes/stranger", '{"hello": 1}')
    client.raw.put(prefix + "nodes/impostor", "alive", lease=stranger_lease)
    client.raw.put(prefix + "rdzv/store/abc", "junk")
    client.raw.put(prefix + "rdzv/store/99", "[1, 2]")
    a = start_agent(procs, etcd, run_id, script, stop, "a")
    first = a.ready(150, world=1)
    for key in ("nodes/stranger", "nodes/impostor", "rdzv/store/abc", "rdzv/store/99"):
        a.wait_for(re.escape(f"etcd key {prefix}{key} is malformed"), 30)
    assert f"etcdctl del {prefix}nodes/stranger" in a.output

    # A restart still works around the junk.
    at = a.mark()
    kill_worker(first)
    second = a.ready(120, world=1, since=at)
    assert second.group(4) == "1"

    # A malformed round state while the job runs: healthy workers keep running, the view names the key.
    at = a.mark()
    state_key = prefix + "rdzv/state"
    client.raw.put(state_key, '{"hello": 1}')
    a.wait_for(re.escape(f"etcd key {state_key} is malformed"), 30, since=at)
    # A new agent of the run, started now (it refuses at start; checked below), so its start-up
    # overlaps the wait that follows.
    late = start_agent(procs, etcd, run_id, script, stop, "late")
    time.sleep(3)  # a few of the view's re-reads and the agent's monitor rounds
    assert a.proc.poll() is None, a.output
    os.kill(int(second.group(5)), 0)  # the worker is alive

    # The next rendezvous (after a worker failure) fails, naming the key and what to do.
    kill_worker(second)
    rc, out = a.finish(120)
    assert rc == 1, out
    assert f"elastic-run: error: etcd key {state_key} is malformed" in out
    assert f"etcdctl del {state_key}" in out
    for wrong in ("unreachable", "degraded", "KeyError", "Traceback"):
        assert wrong not in out, f"{wrong!r} in the output:\n{out}"

    # At start: a new agent of the run refuses to rendezvous on the malformed state.
    rc, out = late.finish(120)
    assert rc == 1 and f"etcd key {state_key} is malformed" in out, out
    for wrong in ("unreachable", "degraded", "KeyError", "Traceback", "READY"):
        assert wrong not in out, f"{wrong!r} in the output:\n{out}"
    stranger_lease.revoke()


@pytest.mark.timeout(60)
def test_misspelled_rdzv_conf_key_exits_2_listing_the_known_keys_before_etcd_starts(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    # Without --rdzv-endpoint elastic-run would start an embedded etcd: with this $ETCD_BINARY that
    # fails with exit 1 naming it. Exit 2 without it shows the check ran before.
    proc = subprocess.run(
        [sys.executable, "-m", "elastic.launcher", "--rdzv-conf", "lease_tll=5", "--nproc-per-node", "1", str(script)],
        capture_output=True, text=True, timeout=50, env={**os.environ, "ETCD_BINARY": str(tmp_path / "no-etcd")},
    )
    assert proc.returncode == 2, proc.stderr
    error_line = proc.stderr.strip().splitlines()[-1]
    assert error_line.startswith("elastic-run: error: --rdzv-conf: unknown key 'lease_tll'"), error_line
    for key in KNOWN_KEYS:
        assert key in error_line
    assert "ETCD_BINARY" not in proc.stderr and "embedded etcd" not in proc.stderr


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # torch's @record under pytest's capture
@pytest.mark.parametrize(
    "conf",
    ["lease_ttl=abc", "lease_ttl=-1", "lease_ttl=inf", "etcd_timeout=nan", "join_timeout=0", "last_call_timeout=1e999"],
)
def test_bad_rdzv_conf_values_exit_2_naming_the_key(
    conf: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    with pytest.raises(SystemExit) as exc:
        launcher.cli(["--rdzv-conf", conf, "--nproc-per-node", "1", str(script)])
    assert exc.value.code == 2
    key, value = conf.split("=")
    assert f"elastic-run: error: --rdzv-conf: {key}={value!r}" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_etcd_out_of_space_and_a_server_that_is_not_etcd_are_named_with_what_to_do(tmp_path: Path) -> None:
    """Both ended the job with a raw gRPC traceback (RESOURCE_EXHAUSTED "mvcc: database space exceeded",
    UNIMPLEMENTED "Method not found"), naming neither the endpoint nor what to do."""
    from concurrent import futures

    import grpc

    from elastic.errors import EtcdUnavailableError
    from elastic.etcd_client import EtcdClientConfig
    from elastic.etcd_server import EtcdServerConfig, free_port

    port = free_port()
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # a gRPC server with no etcd services
    other.add_insecure_port(f"127.0.0.1:{port}")
    other.start()
    try:
        with pytest.raises(EtcdUnavailableError, match=rf"127.0.0.1:{port}.*does not speak etcd's v3 API"):
            EtcdClient(EtcdClientConfig(endpoints=f"127.0.0.1:{port}"))
    finally:
        other.stop(0)

    with EtcdServer(EtcdServerConfig(extra_args=("--quota-backend-bytes", str(1 << 20)))) as small:
        client = EtcdClient(EtcdClientConfig(endpoints=small.endpoint))
        try:
            with pytest.raises(EtcdUnavailableError, match=rf"{small.endpoint}.*out of space.*alarm disarm"):
                for i in range(4096):  # until the NOSPACE alarm
                    client.call(lambda i=i: client.raw.put(f"/fill/{i}", "x" * 4096), what="put")
        finally:
            client.close()
