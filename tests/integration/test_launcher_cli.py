"""`elastic-run` end to end: real agents, workers and etcd; flag validation; stock `torchrun` on
the `etcd-v3` backend through the entry point."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from core import procfs
from elastic import launcher
from elastic.etcd_client import EtcdClient
from elastic.etcd_server import EtcdServer, free_port
from tests.conftest import Procs, read_state

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
    return [
        dict(item.split("=", 1) for item in line.split()[1:]) for line in output.splitlines() if line.startswith("ENV ")
    ]


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


def run_cli(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """Run a command in its own process group with separate stdout/stderr; end the group after."""
    started = time.monotonic()
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
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


FAILING = textwrap.dedent("""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise KeyError("boom-in-worker")

    main()
""")
Result = tuple[int, str, str, float]


@dataclass
class ShortRun:
    future: Future[Result]
    env: dict[str, str]
    """What the run was given in its environment (error-file paths)."""
    endpoint: str
    """The unreachable etcd endpoint (of the run that is pointed at one)."""

    def result(self) -> Result:
        return self.future.result()


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShortRun]]:
    """Launcher runs that end by themselves (bad flags, an unreachable etcd, a failing worker), all
    started at once so their start-up (a torch import each) overlaps; each test takes its own."""
    root = tmp_path_factory.mktemp("short")
    noop, failing = root / "noop.py", root / "fail.py"
    noop.write_text("pass\n")
    failing.write_text(FAILING)
    endpoint = f"127.0.0.1:{free_port()}"
    code = (f"from elastic import launcher\n"
            f"from torch.distributed.elastic.multiprocessing.errors import ChildFailedError\n"
            f"try:\n    launcher.main(['--nproc-per-node', '1', '--monitor-interval', '0.1', {str(failing)!r}])\n"
            f"except ChildFailedError as exc:\n    print('CHILD-FAILED', exc.get_first_failure()[1].exitcode)\n")
    jobs: dict[str, tuple[list[str], float, dict[str, str]]] = {
        "console-bad-flags": ([str(BIN / "elastic-run"), "--nnodes", "3:1", str(noop)], 30, {}),
        "unreachable": ([sys.executable, "-m", "elastic.launcher", "--rdzv-endpoint", endpoint, "--rdzv-conf",
                         "etcd_timeout=2", "--nproc-per-node", "1", str(noop)], 40,
                        {"TORCHELASTIC_ERROR_FILE": str(root / "unreachable-error.json")}),
        "python-main": ([sys.executable, "-c", code], 60,
                        {"TORCHELASTIC_ERROR_FILE": str(root / "launcher-error.json")}),
        "console-failed": ([str(BIN / "elastic-run"), "--nproc-per-node", "1", "--monitor-interval", "0.1",
                            "--event-log-handler", "console", str(failing)], 60, {}),
    }
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        yield {name: ShortRun(pool.submit(run_cli, args, timeout, env), env, endpoint)
               for name, (args, timeout, env) in jobs.items()}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--standalone", "--rdzv-endpoint", "x:1"], ["--standalone", "--rdzv-endpoint"]),
        (["--nnodes", "3:1"], ["--nnodes", "3:1"]),
        (["--nnodes", "abc"], ["--nnodes", "abc"]),
        (["--max-restarts", "-1"], ["--max-restarts", "-1"]),
        (["--node-id", "a", "--rdzv-conf", "node_id=b"], ["--node-id", "node_id"]),
        (["--rdzv-endpoint", "nohostport"], ["--rdzv-endpoint", "nohostport"]),
        (["--nproc-per-node", "0"], ["--nproc-per-node", "0"]),
        # Past these, the launcher allocated without end (10^20 workers), slept for ever between checks, or died of
        # a bare OverflowError / "Invalid value NaN" that named no flag.
        (["--nproc-per-node", "99999999999999999999"], ["--nproc-per-node"]),
        (["--monitor-interval", "nan"], ["--monitor-interval", "nan"]),
        (["--monitor-interval", "100000"], ["--monitor-interval"]),
        (["--hang-timeout", "inf"], ["--hang-timeout", "inf"]),
        (["--hang-timeout", "1e-300"], ["--hang-timeout"]),
        (["--rdzv-endpoint", "::1:2379"], ["--rdzv-endpoint", "brackets"]),  # parsed as host ":" port 1
        (["--standalone", "--rdzv-conf", "cacert=/no/such.pem"], ["--rdzv-conf", "cacert=/no/such.pem"]),
        # These were tracebacks from the agent's or torch's start (a socket, a mkdir, Popen).
        (["--local-addr", "no.such.host.invalid"], ["--local-addr", "no.such.host.invalid"]),
        (["--log-dir", "/proc/no/such"], ["--log-dir", "/proc/no/such"]),
        (["--no-python", "/no/such/bin"], ["--no-python", "/no/such/bin"]),
        (["--rdzv-id", "a/b"], ["--rdzv-id", "a/b"]),
        (["--node-id", ""], ["--node-id"]),
        # Session 50's audit: torch's words with no flag named or no advice, or the wrong flag named.
        (["--rdzv-backend", "bogus"], ["--rdzv-backend", "bogus", "known: ", "etcd-v3"]),
        (["--redirects", "9"], ["--redirects", "'9'", "0:3,1:1"]),
        (["--nproc-per-node", "two"], ["--nproc-per-node", "two", "auto/cpu/gpu/xpu"]),
        (["--node-id", "x/y"], ["--node-id", "x/y"]),
        (["-m", "--no-python"], ["--no-python", "-m/--module"]),
    ],
    ids=["standalone-and-endpoint", "nnodes-min-above-max", "nnodes-not-a-number", "negative-max-restarts",
         "node-id-disagrees", "endpoint-without-port", "zero-nproc-per-node", "huge-nproc-per-node",
         "nan-monitor-interval", "day-long-monitor-interval", "infinite-hang-timeout", "tiny-hang-timeout",
         "ipv6-without-brackets", "missing-cacert", "unknown-local-addr", "log-dir-in-proc", "no-python-missing",
         "slash-in-rdzv-id", "empty-node-id", "unknown-backend", "bad-redirects", "nproc-per-node-a-word",
         "slash-in-node-id", "module-and-no-python"],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], named: list[str], noop_script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        launcher.cli([*argv, str(noop_script)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: elastic-run")
    error_line = err.strip().splitlines()[-1]
    assert error_line.startswith("elastic-run: error: ")
    for word in named:
        assert word in error_line, f"{word!r} not named in {error_line!r}"
    # From Python, main() raises ValueError instead, like torch.distributed.run.main.
    with pytest.raises(ValueError, match=re.escape(named[0])):
        launcher.main([*argv, str(noop_script)])


def test_missing_training_script_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(SystemExit) as exc:
        launcher.cli(["--nproc-per-node", "1", str(missing)])
    assert exc.value.code == 2
    assert str(missing) in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_console_script_rejects_bad_flags_with_exit_2(short_runs: dict[str, ShortRun]) -> None:
    rc, out, err, _ = short_runs["console-bad-flags"].result()
    assert rc == 2, err
    assert "usage: elastic-run" in err
    assert "elastic-run: error: --nnodes '3:1'" in err
    assert out == ""


@pytest.mark.timeout(60)
def test_bad_flags_leave_no_interpreter_started_ahead(tmp_path: Path, noop_script: Path) -> None:
    """The console script starts its worker's interpreter before it parses the flags (elastic/prestart.py);
    a launcher that then exits on bad flags ends it. Output to files, not pipes: the check runs as soon as
    the launcher has exited, while an interpreter left behind would still be importing torch."""
    mark = uuid.uuid4().hex
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen([str(BIN / "elastic-run"), "--warm-spare", "--nnodes", "3:1", str(noop_script)],
                                stdout=out, stderr=out, env={**os.environ, MARK: mark})
        assert proc.wait(timeout=50) == 2
    left = processes_with(MARK, mark)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the interpreter started ahead outlived the launcher"


MARK = "ELASTIC_TEST_LAUNCHER_MARK"


def processes_with(name: str, value: str) -> list[int]:
    """The live processes whose environment has name=value (a run's own children carry its marker)."""
    return [pid for pid in procfs.pids() if procfs.environ(pid).get(name) == value]


@pytest.mark.timeout(90)
def test_unreachable_endpoint_fails_fast_naming_it(short_runs: dict[str, ShortRun]) -> None:
    run = short_runs["unreachable"]
    rc, out, err, elapsed = run.result()
    endpoint, error_file = run.endpoint, Path(run.env["TORCHELASTIC_ERROR_FILE"])
    assert rc == 1
    assert elapsed < 30, f"took {elapsed:.1f}s to give up"
    assert endpoint in err, err
    assert "Traceback" not in err, err
    # torch's @record on the launcher: a launcher-level error file, as torchrun writes.
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("EtcdUnavailableError") and endpoint in message


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
    # Our handler ran the rendezvous: its round state is in etcd. Stock torchrun calls the handler's
    # shutdown() after success and failure alike (it never calls mark_succeeded()), so the handler
    # only leaves the run and does not close it.
    state = read_state(client, run_id)
    assert state is not None, "no etcd-v3 rendezvous state for the run"
    assert state.participants == ("torchrun-node",)


# -- torchrun compatibility: run ids, plans, messages, Python callers ---------------------------------


def plan(argv: list[str], env: dict[str, str] | None = None) -> launcher.Plan:
    args = launcher.build_parser().parse_args([*argv, "-m", "any_module"])
    return launcher._validate(args, env or {})  # noqa: SLF001 - the decision, without starting a job


def test_run_id_comes_from_the_scheduler_and_is_required_for_several_nodes_on_an_external_etcd() -> None:
    external = ["--rdzv-endpoint", "127.0.0.1:2379", "--nnodes", "1:4"]
    with pytest.raises(ValueError, match="--rdzv-id is required"):
        plan(external)
    # torchrun's static form (its default backend) names the way to it.
    with pytest.raises(ValueError, match="pass --rdzv-backend static"):
        plan(["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500"])
    assert plan(["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500",
                 "--rdzv-backend", "static"]).backend == "static"
    assert plan(external, {"SLURM_JOB_ID": "77"}).run_id == "slurm-77-0"
    assert plan(external, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}).run_id == "slurm-77-2"
    assert plan(external, {"JOB_UID": "5c1f"}).run_id == "k8s-5c1f"
    assert plan(external, {"TORCHELASTIC_RUN_ID": "outer", "SLURM_JOB_ID": "77"}).run_id == "outer"
    assert plan([*external, "--rdzv-id", "job-42"], {"SLURM_JOB_ID": "77"}).run_id == "job-42"
    # One node needs nobody's agreement: a fresh id each time, never torchrun's shared 'none'.
    single = plan(["--rdzv-endpoint", "127.0.0.1:2379"])
    assert single.run_id not in ("", "none") and single.run_id != plan(["--rdzv-endpoint", "127.0.0.1:2379"]).run_id
    embedded = plan([])
    assert embedded.embedded_etcd and embedded.backend == "etcd-v3" and embedded.run_id != "none"
    assert plan(["--standalone"], {"SLURM_JOB_ID": "77"}).run_id != "slurm-77-0"  # standalone: always fresh


def test_a_directory_with_a_main_module_is_a_training_script(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    with pytest.raises(ValueError, match="is a directory without a __main__.py"):
        launcher._validate(launcher.build_parser().parse_args([str(app)]), {})  # noqa: SLF001
    (app / "__main__.py").write_text("print('app')\n")  # what `python app` runs
    assert launcher._validate(launcher.build_parser().parse_args([str(app)]), {}).embedded_etcd  # noqa: SLF001


def test_torchruns_pet_variables_set_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kubeflow's PyTorchJob passes torchrun's flags as PET_* variables; PET_RDZV_BACKEND was dropped.
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "h:29803")
    monkeypatch.setenv("PET_NNODES", "2")
    pet = plan([])
    assert (pet.backend, pet.embedded_etcd, pet.run_id) == ("c10d", False, "none")


def test_rendezvous_follows_torchruns_rule_for_the_flags_given() -> None:
    static = plan(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29400"])
    assert (static.backend, static.embedded_etcd) == ("static", False)
    assert "static rendezvous at 10.0.0.1:29400, node rank 1 of 2" in static.notes[0]
    assert plan(["--master-port", "29400"]).backend == "static"  # as torchrun: an explicit port, one node
    c10d = plan(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29500"])
    assert c10d.backend == "c10d" and "etcd-v3" in c10d.notes[0] and "--rdzv-endpoint" in c10d.notes[0]
    assert c10d.run_id != "none"  # one node: its own id
    # Several nodes on torch's backend without --rdzv-id: torchrun's shared default, or they never meet.
    assert plan(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29500", "--nnodes", "2"]).run_id == "none"
    static_at = plan(["--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:29761", "--nnodes", "2"])
    assert "static rendezvous at 127.0.0.1:29761," in static_at.notes[0]  # the store torch's handler really uses
    with pytest.raises(ValueError, match="--node-rank 2"):
        plan(["--nnodes", "2", "--node-rank", "2"])
    with pytest.raises(ValueError, match="--node-rank 1 with --nnodes 1:2 and no --rdzv-endpoint: each node would run "
                                         "alone on a private etcd"):
        plan(["--nnodes", "1:2", "--node-rank", "1", "--master-addr", "127.0.0.1"])  # torchrun: one static job
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        plan(["--rdzv-backend", "etcd-v3", "--nnodes", "2"])
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not supported by etcd-v3"):
        plan([], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert plan(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    with pytest.raises(ValueError, match="--event-log-handler 'nope'"):
        plan(["--event-log-handler", "nope"])


def test_help_describes_elastic_runs_rendezvous(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.cli(["--help"]) == 0  # torch's @record turns argparse's SystemExit(0) into a return
    text = " ".join(capsys.readouterr().out.split())
    assert "private embedded etcd" in text and "C10d TCP store" not in text  # torchrun's --standalone text
    assert "default: etcd-v3" in text and "etcd endpoint(s) of the job" in text


@pytest.mark.timeout(90)
@pytest.mark.timeout(120)
def test_python_main_raises_child_failed_and_console_exits_1(short_runs: dict[str, ShortRun]) -> None:
    python_main = short_runs["python-main"]
    rc, out, err, _ = python_main.result()
    assert rc == 0 and "CHILD-FAILED 1" in out, err
    # @record copied the worker's error file to the launcher's TORCHELASTIC_ERROR_FILE, as torchrun does.
    error_file = Path(python_main.env["TORCHELASTIC_ERROR_FILE"])
    assert "boom-in-worker" in json.loads(error_file.read_text())["message"]["message"]
    rc, out, err, _ = short_runs["console-failed"].result()
    assert rc == 1 and "elastic-run: the job failed" in err and "boom-in-worker" in err
    # Our events went to torch's event handler too, next to torch's own worker events.
    torch_events = [json.loads(line) for line in (out + err).splitlines() if line.startswith('{"name": ')]
    names = {e["name"] for e in torch_events}
    assert {"elastic.join", "elastic.round_closed", "torchelastic.worker.status.FAILED"} <= names, names
    closed = next(e for e in torch_events if e["name"] == "elastic.round_closed")
    assert closed["source"] == "AGENT" and closed["metadata"]["world_size"] == 1


@dataclass
class SleepingJob:
    """An elastic-run job of one worker that sleeps (it imports no torch), with --metrics-port."""

    proc: subprocess.Popen[str]
    lines: list[str]
    """The agent's output so far, collected by `reader`."""
    reader: threading.Thread
    metrics: str
    """The agent's /metrics body once it reported its round (elastic_members 1)."""


@pytest.fixture(scope="module")
def sleeping_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SleepingJob]:
    """Started once its worker is up and the agent's /metrics, read over HTTP, shows its one member; the
    SIGTERM test ends it."""
    script = tmp_path_factory.mktemp("sleeping") / "sleep.py"
    script.write_text("import os, time\nos.write(1, b'WORKER-UP\\n')\ntime.sleep(120)\n")
    port = free_port()
    procs = Procs()
    try:
        proc = procs.elastic_run("--nproc-per-node", "1", "--monitor-interval", "0.1", "--metrics-port", str(port),
                                 str(script))
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
        reader.start()
        deadline, body = time.monotonic() + 60, ""
        while time.monotonic() < deadline and proc.poll() is None:
            if any("WORKER-UP" in line for line in list(lines)):
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                    if re.search(r"^elastic_members 1\.0$", body, re.M):
                        break
                except OSError:
                    pass
            time.sleep(0.2)
        assert re.search(r"^elastic_members 1\.0$", body, re.M), body[-2000:] + "".join(lines[-20:])
        yield SleepingJob(proc, lines, reader, body)
    finally:
        procs.cleanup()


@pytest.mark.timeout(90)
def test_agent_serves_membership_metrics(sleeping_job: SleepingJob) -> None:
    body = sleeping_job.metrics  # `elastic-run --metrics-port`: Prometheus text, read while the job runs
    assert re.search(r"^elastic_members 1\.0$", body, re.M), body[-2000:]
    assert re.search(r"^elastic_generation 1\.0$", body, re.M), body[-2000:]  # the first round
    assert re.search(r"^elastic_degraded 0\.0$", body, re.M), body[-2000:]
    assert "elastic_restarts_total" in body and "elastic_last_recovery_seconds" in body


@pytest.mark.timeout(90)
def test_sigterm_stops_cleanly_with_exit_143(sleeping_job: SleepingJob) -> None:
    proc = sleeping_job.proc
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    sleeping_job.reader.join(timeout=30)  # it ends with the agent's output
    out = "".join(sleeping_job.lines)
    assert proc.returncode == 143, out
    assert "Traceback" not in out, out
    assert out.count("elastic-run: stopped by SIGTERM") == 1
    assert "left open" not in out  # its embedded etcd ends with it: no run to continue


@pytest.mark.timeout(120)
def test_explicit_c10d_runs_torchs_backend_with_a_note(procs, train_script: Path) -> None:
    proc = procs.elastic_run("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                             "--nproc-per-node", "2", "--monitor-interval", "0.1", str(train_script))
    rc, out = finish(proc, timeout=100)
    assert rc == 0, out
    assert_one_world(env_reports(out), 2, out)
    assert "torch's c10d rendezvous as asked" in out and "Fast re-formation needs etcd-v3" in out
    assert "embedded etcd" not in out


LOOP = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from elastic import peer_loss

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    peer_loss.install()
    os.write(1, f"LOOPING rank={dist.get_rank()} world={dist.get_world_size()}\\n".encode())
    for _ in range(600):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(150)
def test_lost_peer_is_one_line_not_a_traceback(procs, etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
             "--monitor-interval", "0.1", "--max-restarts", "0"]
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    a = procs.elastic_run(*flags, "--node-id", "a", str(script), env=env)
    b = procs.elastic_run(*flags, "--node-id", "b", str(script), env=env)
    lines: list[str] = []
    assert a.stdout is not None
    for line in a.stdout:  # bounded by the test's timeout
        lines.append(line)
        if "LOOPING" in line and "world=2" in line:
            break
    procs.kill_node(b)
    for line in a.stdout:
        lines.append(line)
        if "LOOPING" in line and "world=1" in line:  # the survivor re-formed alone and trains on
            break
    procs.kill_group(a, signal.SIGTERM)
    out = "".join(lines) + a.communicate(timeout=60)[0]
    assert "peer node b lost; the group re-formed with 1 node" in out, out
    assert "Traceback" not in out and "Connection closed by peer" not in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT], ids=["SIGHUP", "SIGINT"])
def test_a_stop_signal_during_the_rendezvous_cleans_up_and_exits_128_plus_n(
        procs, etcd: EtcdServer, run_id: str, tmp_path: Path, sig: signal.Signals) -> None:
    # torch installs its signal handlers only once the workers start: before, SIGTERM and SIGHUP killed the agent
    # outright (its tier-0 and progress directories left in /dev/shm) and Ctrl-C printed a traceback.
    from core.tier0_dir import shm_root

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(3)\n")  # never started: the second node never comes
    proc = procs.elastic_run("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.endpoint,
                             "--rdzv-id", run_id, "--monitor-interval", "0.1", str(script))
    mine = [f"elastic-tier0-{proc.pid}-*", f"elastic-progress-{proc.pid}-*"]
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any("rendezvous" in line.lower() for line in list(lines)):  # waiting for the second node
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    assert all(list(shm_root().glob(pattern)) for pattern in mine), "".join(lines)
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    reader.join(timeout=30)
    out = "".join(lines)
    assert proc.returncode == 128 + sig, out
    assert "Traceback" not in out and f"elastic-run: stopped by {sig.name}" in out, out
    assert "the run is left open, so a requeued job with the same --rdzv-id can continue it" in out  # a shared etcd
    assert [p for pattern in mine for p in shm_root().glob(pattern)] == []


@pytest.mark.timeout(120)
def test_sigterm_while_a_static_node_waits_for_the_others_stops_it_cleanly(procs, tmp_path: Path) -> None:
    # torch's static rendezvous waits in C++ (TCPStore's waitForWorkers, 600 s), where a Python signal handler never
    # runs: the node ignored SIGTERM until a SIGKILL, and left its tier-0 directory in /dev/shm.
    from core.tier0_dir import shm_root

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(3)\n")  # node rank 1 never comes
    proc = procs.elastic_run("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                             str(free_port()), "--nproc-per-node", "1", str(script))
    mine = [f"elastic-tier0-{proc.pid}-*", f"elastic-progress-{proc.pid}-*"]
    deadline = time.monotonic() + 60
    while not all(list(shm_root().glob(pattern)) for pattern in mine):  # its agent exists: the wait comes next
        assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
        time.sleep(0.1)
    time.sleep(1.5)  # into the store's wait for node rank 1
    os.kill(proc.pid, signal.SIGTERM)
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        pytest.fail("elastic-run did not stop within 30 s of SIGTERM while waiting in the static rendezvous")
    assert proc.returncode == 143, out
    assert "Traceback" not in out and "elastic-run: stopped by SIGTERM" in out, out
    assert [p for pattern in mine for p in shm_root().glob(pattern)] == []


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_launchers_imports_is_one_line_and_128_plus_n(
        procs, tmp_path: Path, sig: signal.Signals) -> None:
    # The launcher imports torch and forks its workers' interpreters (warm spare on) for 1-2 s before torch's
    # handlers or the launcher's: a SIGTERM there killed it without a word, a Ctrl-C printed the import's traceback.
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(3)\n")
    proc = procs.elastic_run("--standalone", "--nproc-per-node", "2", str(script), env={"ELASTIC_WARM_SPARE": "1"})
    deadline = time.monotonic() + 30
    # Its first handlers, set together (SIGINT's is Python's own from the interpreter's start, so SIGTERM tells)
    while not catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
        time.sleep(0.005)
    os.kill(proc.pid, sig)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + sig, out
    assert "Traceback" not in out and out.count(f"elastic-run: stopped by {sig.name} before the workers started") == 1
    # The interpreters it forked for its workers and spare (its copies: the same command line) end with it.
    until = time.monotonic() + 20
    while (left := [pid for pid in procfs.pids() if str(script) in procfs.cmdline(pid) and procfs.alive(pid)]):
        assert time.monotonic() < until, left
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_signal_the_agent_was_started_ignoring_stays_ignored(
        procs, etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    # Under nohup a hang-up must not stop the job: the first version of the early handlers took SIGHUP over.
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(3)\n")
    proc = procs.elastic_run("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.endpoint,
                             "--rdzv-id", run_id, "--monitor-interval", "0.1", str(script),
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any("rendezvous" in line.lower() for line in list(lines)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGHUP)
    time.sleep(2.0)
    assert proc.poll() is None, "".join(lines)  # still waiting for its second node
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    reader.join(timeout=30)
    assert proc.returncode == 143, "".join(lines)
