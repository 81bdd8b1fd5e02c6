"""torchrun command lines, run side by side under `elastic-run` and stock `torchrun`
(`python -m torch.distributed.run`): the workers must see the same torchrun environment.

One worker script dumps its environment as JSON (after an all_reduce over the whole world, so the
world it describes really formed). Keys torchrun gives its workers must all be there under
elastic-run; the values that define the job (ranks, sizes, role, restart settings) must agree; run
ids, error-file paths and, where the rendezvous differs, the store's port may differ.
All jobs of the module run up front, three at a time, so their start-up overlaps.

Each case costs two jobs of two or more processes that import torch (~10 s of CPU a job on 2 cores), so
flags that do not interact share a case: the entrypoint flags (--run-path, -m, --no-python) ride along the
rendezvous variants, and --log-dir/--redirects/--tee and --local-addr along two of them. A plain script
path, relative to the working directory, is the entrypoint of the standalone case. The static case is also
elastic-run's own test of torchrun's static multi-node command with env:// workers
(tests/integration/test_static_multinode.py has the tcp:// ones), and the standalone case its test of the
embedded etcd (--standalone, or no rendezvous flags: the same etcd) and of the interpreters elastic-run starts
ahead for its workers (elastic/prestart.py: each its own torch seed, an absolute __file__ for a relative path).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic.etcd_server import EtcdServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ELASTIC_RUN = [sys.executable, "-m", "elastic.launcher"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    total = torch.ones(1)
    dist.all_reduce(total)
    env = {k: v for k, v in os.environ.items() if k not in json.loads(os.environ["COMPAT_BASE_KEYS"])}
    env["_SUM"] = str(int(total.item()))
    env["_ARGV"] = json.dumps(sys.argv[1:])
    env["_FILE"] = __file__
    env["_SEED"] = str(torch.initial_seed())
    out = os.path.join(os.environ["COMPAT_OUT"], f"rank{os.environ['RANK']}.json")
    with open(out, "w") as f:
        json.dump(env, f)
    print(f"compat worker rank {os.environ['RANK']} done", flush=True)
    dist.destroy_process_group()
    """
)

# Values that define the job: they must be the same under both launchers (so must every key not in
# MAY_DIFFER); OMP_NUM_THREADS is set by both only for more than one worker per node.
MUST_AGREE = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
    "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "_SUM", "_ARGV", "_FILE",
)
# Where they may differ by design: run ids and error-file paths are per job; the store's port and
# host follow the rendezvous (compared where both launchers use the same one: static, --local-addr).
MAY_DIFFER = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT", "MASTER_ADDR", "_SEED")
# elastic-run's own additions (the agent's progress dir for hang detection, the peer-loss grace, the
# node's tier-0 checkpoint directory, the in-process re-formation's mode, round generation and timeout:
# elastic/reform.py; the node's id in the run, for events and faults).
ELASTIC_ONLY = ("ELASTIC_PROGRESS_DIR", "ELASTIC_PEER_LOSS_GRACE_S", "ELASTIC_TIER0_DIR", "ELASTIC_REFORM",
                "ELASTIC_ROUND_GENERATION", "ELASTIC_REFORM_TIMEOUT_S", "ELASTIC_NODE_ID")


@dataclass
class Job:
    """One launcher's run of a case: its nodes' outputs and the workers' environments by rank."""

    out_dir: Path
    argvs: list[list[str]]
    returncodes: list[int] = field(default_factory=list)
    output: str = ""

    def envs(self) -> dict[int, dict[str, str]]:
        return {
            int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in sorted(self.out_dir.glob("rank*.json"))
        }


@dataclass(frozen=True)
class Case:
    """A torchrun command line per launcher; several argv lists start that many agents (simulated nodes)."""

    name: str
    elastic: list[list[str]]
    torchrun: list[list[str]]


def _run_job(argvs: list[list[str]], out_dir: Path, env: dict[str, str], cwd: Path) -> Job:
    out_dir.mkdir(parents=True)
    job_env = {**env, "COMPAT_OUT": str(out_dir)}
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env,
                              cwd=cwd, start_new_session=True) for argv in argvs]
    job = Job(out_dir, argvs)
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=150)
            job.returncodes.append(proc.returncode)
            job.output += out
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return job


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compat")
    (root / "pkg").mkdir()
    (root / "pkg" / "compat_worker.py").write_text(WORKER)
    (root / "worker.py").write_text(WORKER)
    return root


def _cases(root: Path, etcd: EtcdServer) -> list[Case]:
    w = str(root / "worker.py")
    logs = root / "logs"
    one = ["--monitor-interval", "0.1", "--nproc-per-node"]

    def static(port: int) -> list[list[str]]:
        return [["--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port),
                 *one, "1", "--run-path", w, "a1"] for r in range(2)]

    def both(*argv: str) -> tuple[list[list[str]], list[list[str]]]:
        return [list(argv)], [list(argv)]

    def logged(launcher: str) -> list[str]:
        return ["--log-dir", str(logs / launcher), "--redirects", "3", "--tee", "3"]

    standalone = ["--standalone", *one, "2", "worker.py", "--flag", "x"]  # relative: cwd is `root`
    raw = {
        # elastic-run's workers through the interpreters it starts ahead (prestart, with its warm spare)
        "standalone": ([["--warm-spare", *standalone]], [standalone]),
        "no-python+local-addr": both("--standalone", "--local-addr", "127.0.0.1", *one, "1", "--no-python",
                                      sys.executable, w, "np"),
        "static-2-nodes+run-path": (static(free_port()), static(free_port())),
        "nnodes-min-max+module+logs": (
            [["--nnodes", "1:2", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", f"compat-{uuid.uuid4().hex[:8]}",
              *one, "1", *logged("elastic"), "-m", "compat_worker", "m1"]],
            [["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-id", "compat", "--rdzv-conf", "last_call_timeout=1", *one, "1", *logged("torchrun"),
              "-m", "compat_worker", "m1"]],
        ),
    }
    return [Case(name, [ELASTIC_RUN + a for a in e], [TORCHRUN + a for a in t]) for name, (e, t) in raw.items()]


@pytest.fixture(scope="module")
def results(workspace: Path, etcd_server: EtcdServer) -> Iterator[dict[str, tuple[Job, Job]]]:
    cases = _cases(workspace, etcd_server)  # the session's etcd: its run id is unique
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(workspace / "pkg"), str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    env.pop("OMP_NUM_THREADS", None)
    env["COMPAT_BASE_KEYS"] = json.dumps(sorted([*env, "COMPAT_OUT", "COMPAT_BASE_KEYS"]))
    futures: dict[str, tuple[Future[Job], Future[Job]]] = {}
    first = ("static-2-nodes+run-path", "nnodes-min-max+module+logs", "standalone")  # the longest: none left alone
    with ThreadPoolExecutor(max_workers=3) as pool:
        for case in sorted(cases, key=lambda c: first.index(c.name) if c.name in first else len(first)):
            futures[case.name] = (
                pool.submit(_run_job, case.elastic, workspace / "out" / case.name / "elastic", env, workspace),
                pool.submit(_run_job, case.torchrun, workspace / "out" / case.name / "torchrun", env, workspace),
            )
        yield {name: (e.result(), t.result()) for name, (e, t) in futures.items()}


CASES = ["standalone", "no-python+local-addr", "static-2-nodes+run-path", "nnodes-min-max+module+logs"]
SIZES = {"standalone": 2, "static-2-nodes+run-path": 2}


@pytest.mark.parametrize("name", CASES)
def test_workers_see_torchruns_environment(name: str, results: dict[str, tuple[Job, Job]]) -> None:
    ours, theirs = results[name]
    assert theirs.returncodes and set(theirs.returncodes) == {0}, f"torchrun failed:\n{theirs.output}"
    assert ours.returncodes and set(ours.returncodes) == {0}, f"elastic-run failed:\n{ours.output}"
    ours_env, theirs_env = ours.envs(), theirs.envs()
    size = SIZES.get(name, 1)
    assert sorted(ours_env) == sorted(theirs_env) == list(range(size)), (ours.output, theirs.output)
    for rank, expected in theirs_env.items():
        got = ours_env[rank]
        missing = sorted(set(expected) - set(got))
        assert not missing, f"rank {rank}: elastic-run lacks torchrun's {missing}"
        extra = sorted(set(got) - set(expected) - set(ELASTIC_ONLY))
        assert not extra, f"rank {rank}: unexpected keys under elastic-run: {extra}"
        assert all(key in got for key in MUST_AGREE if key != "OMP_NUM_THREADS"), sorted(got)
        differ = {k: (got[k], expected[k]) for k in expected if k not in MAY_DIFFER and got[k] != expected[k]}
        assert not differ, f"rank {rank}: (elastic-run, torchrun) values differ: {differ}"
        assert int(got["MASTER_PORT"]) > 0
        if name != "static-2-nodes+run-path":  # a static job's id only prefixes keys in its own store
            assert got["TORCHELASTIC_RUN_ID"] not in ("", "none")
        assert os.path.isabs(got["_FILE"]), got["_FILE"]  # as `python sub/train.py` has it, then a chdir works
    for envs in (ours_env, theirs_env):  # each worker its own torch seed, as a fresh interpreter has
        assert len({env["_SEED"] for env in envs.values()}) == len(envs), envs


def test_static_nodes_use_the_given_master_address_and_node_ranks(results: dict[str, tuple[Job, Job]]) -> None:
    for job in results["static-2-nodes+run-path"]:
        envs = job.envs()
        port = {argv[argv.index("--master-port") + 1] for argv in job.argvs}
        assert len(port) == 1  # both nodes were given the same store
        assert {envs[r]["GROUP_RANK"] for r in envs} == {"0", "1"}
        assert all(envs[r]["GROUP_RANK"] == str(r) for r in envs)  # node rank R is group rank R (1 worker a node)
        assert {envs[r]["MASTER_ADDR"] for r in envs} == {"127.0.0.1"}
        assert {envs[r]["MASTER_PORT"] for r in envs} == port  # workers get the store the flags named
        assert {(envs[r]["WORLD_SIZE"], envs[r]["_SUM"]) for r in envs} == {("2", "2")}  # the all_reduce spanned both
    ours, theirs = results["static-2-nodes+run-path"]
    assert ours.output.count("static rendezvous at 127.0.0.1:") == 2  # each node's one-line note on elasticity
    assert "--rdzv-endpoint" in ours.output
    assert "embedded etcd" not in ours.output  # a static job starts no etcd


def test_standalone_runs_on_its_own_etcd_and_removes_it(results: dict[str, tuple[Job, Job]]) -> None:
    # --standalone: a private etcd, not torchrun's c10d store (the same embedded etcd as elastic-run with no
    # rendezvous flags, which every TinyJob of the suite is).
    ours, _ = results["standalone"]
    assert ours.returncodes == [0], ours.output
    assert "embedded etcd at" in ours.output
    # The embedded etcd went away with the launcher, data dir included.
    ready = re.search(r"embedded etcd ready at http://[\d.]+:\d+ \(pid \d+, data (\S+)\)", ours.output)
    assert ready, ours.output
    assert not os.path.exists(ready.group(1)), f"embedded etcd data dir {ready.group(1)} left behind"


def test_local_addr_is_the_store_address(results: dict[str, tuple[Job, Job]]) -> None:
    ours, _ = results["no-python+local-addr"]
    assert ours.envs()[0]["MASTER_ADDR"] == "127.0.0.1"


def test_log_dir_redirects_and_tee_write_the_same_files(workspace: Path, results: dict[str, tuple[Job, Job]]) -> None:
    ours, theirs = results["nnodes-min-max+module+logs"]
    layout = {}
    for launcher in ("elastic", "torchrun"):
        files = sorted(p for p in (workspace / "logs" / launcher).rglob("*.log"))
        layout[launcher] = sorted("/".join(p.relative_to(workspace / "logs" / launcher).parts[1:]) for p in files)
        stdout = [p for p in files if p.name == "stdout.log"]
        assert stdout and "compat worker rank 0 done" in stdout[0].read_text(), launcher
    assert layout["elastic"] == layout["torchrun"]  # <run>/attempt_0/0/{stdout,stderr}.log
    for job in (ours, theirs):
        assert "compat worker rank 0 done" in job.output  # --tee: also on the console
