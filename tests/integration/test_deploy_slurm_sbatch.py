"""deploy/slurm/elastic-train.sbatch end to end, without Slurm: stand-ins for `srun` and `scontrol`
on PATH, a real etcd started by the script. Checks that the job starts its own etcd when no
ETCD_ENDPOINTS is given (and stops it at the end), uses an external one when given, and requeues
itself on failure and before the time limit, within MAX_REQUEUES."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd_server import find_etcd_binary, free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "elastic-train.sbatch"

# srun's stand-in: records its own options, runs the step's command once per node with that
# node's Slurm variables (node.sh in dry-run mode, so it prints the elastic-run command), checks
# whether etcd answers right now, then exits with $FAKE_SRUN_RC.
FAKE_SRUN = r"""#!/usr/bin/env bash
set -u
opts=()
while [[ $1 == -* ]]; do opts+=("$1"); shift; done
printf '%s\n' "${opts[@]}" > "$FAKE_DIR/srun.opts"
if [[ ${FAKE_REAL:-0} == 1 ]]; then
    # Really run every node's command, concurrently, each with its own node-local scratch.
    pids=()
    for ((i = 0; i < SLURM_NNODES; i++)); do
        SLURM_NODEID=$i SLURM_PROCID=$i SLURMD_NODENAME=node$i SLURM_TMPDIR=$FAKE_DIR/node$i \
            "$@" > "$FAKE_DIR/node$i.log" 2>&1 &
        pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    exit "$rc"
fi
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURMD_NODENAME=node$i DRY_RUN=1 "$@" >> "$FAKE_DIR/commands" || exit 99
done
if [[ ${FAKE_CHECK_ETCD:-0} == 1 ]]; then
    "$FAKE_PYTHON" -c 'import os, urllib.request
url = "http://" + os.environ["ETCD_ENDPOINTS"] + "/health"
print(urllib.request.urlopen(url, timeout=5).read().decode())' > "$FAKE_DIR/etcd-health"
fi
if [[ -n ${FAKE_HOLD:-} ]]; then
    touch "$FAKE_DIR/running"
    for ((i = 0; i < 200; i++)); do [[ -e $FAKE_HOLD ]] && break; sleep 0.05; done
fi
exit "${FAKE_SRUN_RC:-0}"
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/scontrol"
"""


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Batch:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.client_port = free_port()
        self.env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "HOME": str(tmp / "home"),
            "FAKE_DIR": str(tmp),
            "FAKE_PYTHON": sys.executable,
            "SLURM_JOB_ID": "4242",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node[0-1]",
            "SLURMD_NODENAME": "node0",
            "SLURM_SUBMIT_DIR": str(REPO),
            "SLURM_TMPDIR": str(tmp / "local"),
            "SHARED_ROOT": str(tmp / "pfs"),
            "ETCD_HOST": "127.0.0.1",
            "ETCD_LISTEN_HOST": "127.0.0.1",
            "ETCD_CLIENT_PORT": str(self.client_port),
            "ETCD_PEER_PORT": str(free_port()),
            "ETCD_BINARY": find_etcd_binary(),
            "ETCD_LOG": str(tmp / "etcd.log"),
        }
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *script: str, **env: str) -> subprocess.Popen[str]:
        self.proc = subprocess.Popen(
            ["bash", str(SBATCH), *(script or ("train.py", "--steps", "5"))], cwd=self.dir, env={**self.env, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        return self.proc

    def run(self, *script: str, timeout: float = 60, **env: str) -> tuple[int, str]:
        proc = self.start(*script, **env)
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out

    def commands(self) -> list[list[str]]:
        return [shlex.split(line) for line in (self.dir / "commands").read_text().splitlines()]

    def scontrol(self) -> list[str]:
        path = self.dir / "scontrol"
        return path.read_text().splitlines() if path.exists() else []

    def cleanup(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


@pytest.fixture
def batch(tmp_path: Path) -> Iterator[Batch]:
    b = Batch(tmp_path)
    try:
        yield b
    finally:
        b.cleanup()


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_starts_its_own_etcd_runs_every_node_and_stops_etcd(batch: Batch) -> None:
    rc, out = batch.run(FAKE_CHECK_ETCD="1", SLURM_CPUS_PER_TASK="32")
    assert rc == 0, out
    assert "training finished" in out
    # etcd answered while the step ran, and is gone once the job ends.
    assert '"health":"true"' in (batch.dir / "etcd-health").read_text(), (batch.dir / "etcd.log").read_text()
    assert not _port_open(batch.client_port)
    opts = (batch.dir / "srun.opts").read_text().split()
    assert {"--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill", "--cpus-per-task=32"} <= set(opts)
    commands = batch.commands()
    assert [_flag(c, "--node-id") for c in commands] == ["node0", "node1"]
    for argv in commands:
        assert argv[0] == "elastic-run"
        assert _flag(argv, "--rdzv-endpoint") == f"127.0.0.1:{batch.client_port}"
        assert _flag(argv, "--rdzv-id") == "slurm-4242-0"
        assert _flag(argv, "--nnodes") == "1:2"
        assert argv[argv.index("train.py"):] == [
            "train.py", "--steps", "5", "--ckpt-dir", str(batch.dir / "local" / "ckpt"),
            "--shared-url", str(batch.dir / "pfs" / "slurm-4242"),
        ]  # fmt: skip
    assert batch.scontrol() == []


def test_uses_an_external_etcd_and_starts_none(batch: Batch) -> None:
    # An etcd "binary" that fails: had the script started one, it would have stopped right there.
    rc, out = batch.run(ETCD_ENDPOINTS="etcd-a.example:2379,etcd-b.example:2379", ETCD_BINARY="/bin/false")
    assert rc == 0, out
    assert not (batch.dir / "etcd.log").exists()
    assert [_flag(c, "--rdzv-endpoint") for c in batch.commands()] == ["etcd-a.example:2379,etcd-b.example:2379"] * 2


def test_a_dead_etcd_fails_the_job_before_any_node_starts(batch: Batch) -> None:
    rc, out = batch.run(ETCD_BINARY="/bin/false")
    assert rc != 0
    assert "exited before it served" in out
    assert not (batch.dir / "commands").exists()


def test_failed_step_requeues_the_job(batch: Batch) -> None:
    rc, out = batch.run(FAKE_SRUN_RC="1", ETCD_ENDPOINTS="etcd:2379")
    assert rc == 0, out
    assert batch.scontrol() == ["requeue 4242"]
    assert "requeue 1 of 3" in out


def test_no_requeue_once_max_requeues_are_used(batch: Batch) -> None:
    rc, out = batch.run(FAKE_SRUN_RC="1", ETCD_ENDPOINTS="etcd:2379", SLURM_RESTART_COUNT="3", MAX_REQUEUES="3")
    assert rc == 1, out
    assert batch.scontrol() == []
    assert "3 of MAX_REQUEUES=3 requeues used" in out


def test_usage_error_is_not_requeued(batch: Batch) -> None:
    rc, out = batch.run(FAKE_SRUN_RC="2", ETCD_ENDPOINTS="etcd:2379")
    assert rc == 2, out
    assert batch.scontrol() == []


def test_time_limit_signal_requeues_and_the_step_still_finishes(batch: Batch) -> None:
    release = batch.dir / "release"
    proc = batch.start(ETCD_ENDPOINTS="etcd:2379", FAKE_HOLD=str(release))
    deadline = time.monotonic() + 20
    while not (batch.dir / "running").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends to the batch shell
    while batch.scontrol() != ["requeue 4242"]:
        assert time.monotonic() < deadline, "USR1 did not requeue the job"
        time.sleep(0.05)
    assert proc.poll() is None  # still waiting for its step
    release.touch()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "time limit" in out


def test_two_nodes_train_to_completion_through_the_real_launcher(batch: Batch) -> None:
    """No stand-in for the launcher: two simulated nodes run node.sh -> elastic-run -> train_tiny.py
    against the etcd the script started, and finish together."""
    tiny = REPO / "examples" / "train_tiny.py"
    help_text = subprocess.run([sys.executable, str(tiny), "--help"], capture_output=True, text=True, timeout=60).stdout
    # Tier 2 is passed once the example script takes --shared-url; until then only tier 1.
    tier2 = {} if "--shared-url" in help_text else {"SHARED_URL_FLAG": ""}
    rc, out = batch.run(
        str(tiny), "--steps", "8", "--ckpt-every", "4", "--global-batch", "8", "--dataset-size", "64",
        timeout=100, FAKE_REAL="1", ELASTIC_RUN=str(Path(sys.executable).parent / "elastic-run"),
        NPROC_PER_NODE="1", MIN_NODES="2", JOIN_TIMEOUT="60", **tier2,
    )  # fmt: skip
    logs = {i: (batch.dir / f"node{i}.log").read_text() for i in range(2)}
    assert rc == 0, out + "\n".join(logs.values())
    both = "\n".join(logs.values())
    assert "rank 0 of 2" in both and "rank 1 of 2" in both, both
    assert "final_digest=" in both
    for i in range(2):
        assert any((batch.dir / f"node{i}" / "ckpt").iterdir()), f"node{i} wrote no tier-1 checkpoint"
    assert not _port_open(batch.client_port)
