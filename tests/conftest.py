"""Shared fixtures: a real etcd server on free ports, unique run ids, a tier-0 directory in host shared memory,
and process bookkeeping that ends every process a test starts (by pid / process group, never by name)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.procfs import descendants, kill_tree
from core.tier0_dir import shm_root
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.etcd_server import EtcdServer
from elastic.keys import RunKeys
from elastic.round import RoundState

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "train_tiny.py"

# A warm spare (elastic/spare.py) costs each job one more torch process start (~6 s of CPU here) that few tests
# use: off by default in the suite; the tests of spares pass --warm-spare.
os.environ.setdefault("ELASTIC_WARM_SPARE", "0")
# Likewise the node's checkpoint helper (ckpt/helper.py; ~2 s of CPU to start): the tests of the helper turn it on.
os.environ.setdefault("ELASTIC_CKPT_HELPER", "0")


# The slowest modules (`make test` prints the slowest tests) go first. `make test` runs each module whole on one of
# two workers (--dist loadfile, so a module's fixtures run once) in this order: a long module handed out last would
# leave the other worker idle at the end. Only the speed depends on this list.
_SLOWEST_FIRST = ("test_reform.py", "test_chaos_smoke.py", "test_elastic_faults.py", "test_kill_resume.py",
                  "test_membership.py", "test_trainer_sharded.py", "test_launcher_cli.py", "test_ckpt_shared.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One real etcd for the whole session; tests isolate themselves with unique run ids."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> EtcdServer:
    return etcd_server


@pytest.fixture
def client(etcd: EtcdServer) -> Iterator[EtcdClient]:
    c = EtcdClient(EtcdClientConfig(endpoints=etcd.endpoint))
    try:
        yield c
    finally:
        c.close()


def read_state(client: EtcdClient, run_id: str) -> RoundState | None:
    value, _ = client.raw.get(RunKeys.of(run_id).state)
    return None if value is None else RoundState.from_json(value)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh tier-0 directory of its own in the machine's shared memory (tmpfs), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="test-tier0-", dir=shm_root()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


class Procs:
    """Starts processes in their own process groups and ends them all at teardown."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], **kwargs: object) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}  # type: ignore[dict-item]
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env=env, **kwargs,  # type: ignore[arg-type]
        )
        self.started.append(proc)
        return proc

    def elastic_run(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        return self.start([sys.executable, "-m", "elastic.launcher", *args], **kwargs)

    def kill_group(self, proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill_node(self, proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> list[int]:
        """Signal an agent and all its workers (torch starts workers in sessions of their own)."""
        return kill_tree(proc.pid, sig)

    def cleanup(self) -> None:
        trees = {proc.pid: descendants(proc.pid) for proc in self.started}
        for proc in self.started:
            if proc.poll() is None:
                self.kill_group(proc, signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
            # Workers run in sessions of their own; make sure none outlives the test.
            for pid in [proc.pid, *trees[proc.pid]]:
                kill_tree(pid, signal.SIGKILL)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


def join_or_kill(processes: list[Any], timeout: float = 30) -> None:
    """Wait for multiprocessing `processes` to end; kill those still running after `timeout` s."""
    for p in processes:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(10)
