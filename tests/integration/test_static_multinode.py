"""torchrun's static multi-node command under elastic-run: `--nnodes 2 --node-rank R --master-addr
HOST --master-port P` and no rendezvous flags, on two simulated nodes (two agents on loopback).

Workers initialise their process group from the environment (env://) or from the address the launch
script passed on the command line (`init_method=tcp://HOST:P`), as Slurm and hand-written launch
scripts do; both must work, as under torchrun. So must `tcp://` on the default single-node command
with an explicit --master-port. The env:// case is tests/integration/test_torchrun_compat.py's
static-2-nodes case (the same command, side by side with torchrun); this module runs the tcp:// ones.
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from elastic.etcd_server import free_port
from tests.conftest import Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

WORKER = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    init = sys.argv[1]
    kwargs = {} if init == "env://" else {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group("gloo", init_method=init, timeout=timedelta(seconds=40), **kwargs)
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    line = (f"DONE rank={dist.get_rank()} group_rank={os.environ['GROUP_RANK']} world={dist.get_world_size()} "
            f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} sum={total.item():g}")
    os.write(1, (line + "\\n").encode())
    dist.destroy_process_group()
    """
)


@dataclass
class Job:
    port: int
    procs: list[subprocess.Popen[str]]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """The module's jobs, all started at once so their start-up (a torch import per process) overlaps;
    each test waits for its own."""
    worker = tmp_path_factory.mktemp("static") / "worker.py"
    worker.write_text(WORKER)
    procs = Procs()
    started: dict[str, Job] = {}
    try:
        port = free_port()
        started["tcp"] = Job(port, [procs.elastic_run(
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--nproc-per-node", "1", "--monitor-interval", "0.1", str(worker), f"tcp://127.0.0.1:{port}")
            for rank in range(2)])
        port = free_port()
        started["single"] = Job(port, [procs.elastic_run("--master-port", str(port), "--nproc-per-node", "2",
                                                         "--monitor-interval", "0.1", str(worker),
                                                         f"tcp://127.0.0.1:{port}")])
        yield started
    finally:
        procs.cleanup()


def _done_lines(output: str) -> list[dict[str, str]]:
    return [
        dict(kv.split("=", 1) for kv in line.split()[1:]) for line in output.splitlines() if line.startswith("DONE ")
    ]


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> tuple[list[int], str]:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], "\n".join(outputs)


def test_two_static_nodes_finish_with_tcp_init(jobs: dict[str, Job]) -> None:
    port = jobs["tcp"].port
    rcs, out = _finish(jobs["tcp"].procs, timeout=120)
    assert rcs == [0, 0], out
    done = _done_lines(out)
    assert sorted(d["rank"] for d in done) == ["0", "1"], out
    for d in done:
        assert d["world"] == "2" and d["sum"] == "3"  # 1 + 2: the all_reduce spanned both nodes
        assert d["master"] == f"127.0.0.1:{port}"  # workers get the store the flags named
        assert d["group_rank"] == d["rank"]  # node rank R is group rank R, as in torchrun
    assert out.count("static rendezvous at 127.0.0.1") == 2  # each node says how to get elasticity
    assert "embedded etcd" not in out


def test_single_node_tcp_init_at_the_given_master_port(jobs: dict[str, Job]) -> None:
    rcs, out = _finish(jobs["single"].procs, timeout=120)
    assert rcs == [0], out
    done = _done_lines(out)
    assert len(done) == 2 and {d["sum"] for d in done} == {"3"}, out
