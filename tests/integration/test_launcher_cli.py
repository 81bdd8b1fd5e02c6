"""`elastic-run` end to end: real agents, workers and etcd; flag validation; stock `torchrun` on
the `etcd-v3` backend through the entry point."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic import launcher
from elastic.etcd_client import EtcdClient
from elastic.etcd_server import EtcdServer, free_port
from tests.conftest import read_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BIN = Path(sys.prefix) / "bin"

TRAIN = textwrap.dedent(
    """
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"]
    line = " ".join(["ENV", *(f"{k}={os.environ[k]}" for k in keys), f"SUM={total.item():g}"])
    os.write(1, (line + "\\n").encode())  # one write: workers share the pipe, lines must not interleave
    dist.destroy_process_group()
    """
)


@pytest.fixture
def train_script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.fixture
def noop_script(tmp_path: Path) -> Path:
    path = tmp_path / "noop.py"
    path.write_text("pass\n")
    return path


def env_reports(output: str) -> list[dict[str, str]]:
    """The `ENV k=v ...` lines the workers print, one dict per worker."""
    return [dict(item.split("=", 1) for item in line.split()[1:]) for line in output.splitlines() if line.startswith("ENV ")]


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def assert_one_world(reports: list[dict[str, str]], world_size: int, output: str) -> None:
    assert len(reports) == world_size, f"expected {world_size} worker reports:\n{output}"
    assert sorted(int(r["RANK"]) for r in reports) == list(range(world_size))
    for r in reports:
        assert int(r["WORLD_SIZE"]) == world_size
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert float(r["SUM"]) == world_size * (world_size + 1) / 2  # the all_reduce ran
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in reports}) == 1, "workers disagree on the master"
    assert reports[0]["MASTER_ADDR"] and int(reports[0]["MASTER_PORT"]) > 0


def run_cli(args: list[str], timeout: float) -> tuple[int, str, str, float]:
    """Run a command in its own process group with separate stdout/stderr; end the group after."""
    started = time.monotonic()
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out, err, time.monotonic() - started




def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _end_group(proc: subprocess.Popen[str]) -> None:
    """End a job started here: its agent, workers and etcd guard live in its process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def embedded_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The two jobs on an embedded etcd, started together so their start-up (torch imports, etcd)
    overlaps on this small machine; each test waits for its own."""
    script = tmp_path_factory.mktemp("embedded") / "train.py"
    script.write_text(TRAIN)
    launch = [sys.executable, "-m", "elastic.launcher", "--monitor-interval", "0.1"]
    runs = {
        "plain": _start([*launch, "--nproc-per-node", "2", str(script)]),
        "standalone": _start([*launch, "--standalone", "--nproc-per-node", "1", str(script)]),
    }
    try:
        yield runs
    finally:
        for proc in runs.values():
            _end_group(proc)


def test_embedded_etcd_two_workers_get_torchrun_env(embedded_runs: dict[str, subprocess.Popen[str]]) -> None:
    rc, out = finish(embedded_runs["plain"], timeout=50)
    assert rc == 0, out
    reports = env_reports(out)
    assert_one_world(reports, 2, out)
    assert sorted(r["LOCAL_RANK"] for r in reports) == ["0", "1"]
    # The embedded etcd went away with the launcher, data dir included.
    ready = re.search(r"embedded etcd ready at http://[\d.]+:\d+ \(pid \d+, data (\S+)\)", out)
    assert ready, out
    assert not os.path.exists(ready.group(1)), f"embedded etcd data dir {ready.group(1)} left behind"


def test_standalone_runs_on_its_own_etcd(embedded_runs: dict[str, subprocess.Popen[str]]) -> None:
    rc, out = finish(embedded_runs["standalone"], timeout=50)
    assert rc == 0, out
    assert_one_world(env_reports(out), 1, out)
    assert "embedded etcd at" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--standalone", "--rdzv-endpoint", "x:1"], ["--standalone", "--rdzv-endpoint"]),
        (["--nnodes", "3:1"], ["--nnodes", "3:1"]),
        (["--nnodes", "abc"], ["--nnodes", "abc"]),
        (["--max-restarts", "-1"], ["--max-restarts", "-1"]),
        (["--node-id", "a", "--rdzv-conf", "node_id=b"], ["--node-id", "node_id"]),
        (["--rdzv-endpoint", "nohostport"], ["--rdzv-endpoint", "nohostport"]),
    ],
    ids=["standalone-and-endpoint", "nnodes-min-above-max", "nnodes-not-a-number", "negative-max-restarts",
         "node-id-disagrees", "endpoint-without-port"],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], named: list[str], noop_script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        launcher.main([*argv, str(noop_script)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: elastic-run")
    error_line = err.strip().splitlines()[-1]
    assert error_line.startswith("elastic-run: error: ")
    for word in named:
        assert word in error_line, f"{word!r} not named in {error_line!r}"


@pytest.mark.timeout(40)
def test_zero_nproc_per_node_exits_2(noop_script: Path) -> None:
    rc, _, err, _ = run_cli(
        [sys.executable, "-m", "elastic.launcher", "--nproc-per-node", "0", str(noop_script)], timeout=30
    )
    assert rc == 2, err
    assert "elastic-run: error: --nproc-per-node" in err


def test_missing_training_script_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(SystemExit) as exc:
        launcher.main(["--nproc-per-node", "1", str(missing)])
    assert exc.value.code == 2
    assert str(missing) in capsys.readouterr().err


def test_console_script_rejects_bad_flags_with_exit_2(noop_script: Path) -> None:
    rc, out, err, _ = run_cli([str(BIN / "elastic-run"), "--nnodes", "3:1", str(noop_script)], timeout=30)
    assert rc == 2, err
    assert "usage: elastic-run" in err
    assert "elastic-run: error: --nnodes '3:1'" in err
    assert out == ""


def test_unreachable_endpoint_fails_fast_naming_it(noop_script: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    rc, out, err, elapsed = run_cli(
        [sys.executable, "-m", "elastic.launcher", "--rdzv-endpoint", endpoint, "--rdzv-conf", "etcd_timeout=2",
         "--nproc-per-node", "1", str(noop_script)],
        timeout=40,
    )
    assert rc != 0
    assert elapsed < 30, f"took {elapsed:.1f}s to give up"
    assert endpoint in err, err
    assert "Traceback" not in err, err


def test_two_agents_form_one_world(procs, etcd: EtcdServer, run_id: str, train_script: Path) -> None:
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
             "--monitor-interval", "0.1", "--rdzv-conf", "join_timeout=40"]
    agents = [procs.elastic_run(*flags, "--node-id", f"agent-{i}", str(train_script)) for i in range(2)]
    results = [finish(agent, timeout=50) for agent in agents]
    output = "\n".join(out for _, out in results)
    assert [rc for rc, _ in results] == [0, 0], output
    reports = env_reports(output)
    assert_one_world(reports, 2, output)
    assert {r["LOCAL_RANK"] for r in reports} == {"0"}


def test_stock_torchrun_uses_the_etcd_v3_entry_point(
    procs, etcd: EtcdServer, run_id: str, train_script: Path, client: EtcdClient
) -> None:
    proc = procs.start([
        str(BIN / "torchrun"), "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
        "--rdzv-id", run_id, "--nnodes", "1", "--nproc-per-node", "2", "--monitor-interval", "0.1",
        "--rdzv-conf", "node_id=torchrun-node", str(train_script),
    ])
    rc, out = finish(proc, timeout=50)
    assert rc == 0, out
    assert_one_world(env_reports(out), 2, out)
    # Our handler ran the rendezvous: its round state is in etcd, closed by the agent's shutdown.
    state = read_state(client, run_id)
    assert state is not None, "no etcd-v3 rendezvous state for the run"
    assert state.participants == ("torchrun-node",)
    assert state.shutdown
