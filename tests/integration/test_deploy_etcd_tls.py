"""deploy/etcd: the TLS and auth set-up of deploy/README.md, for real. tls-certs.sh makes the
certificates with openssl, a real etcd serves TLS with client-certificate auth, enable-auth.sh
turns on RBAC with etcdctl, and elastic-train's own etcd client (what --rdzv-conf cacert=, cert=,
key=, user=, password_file= configure) can use its prefix and nothing else. The password reaches
the client from a file or the environment (deploy/slurm/node.sh passes it in the environment),
never through the command line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.errors import EtcdUnavailableError
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.etcd_server import find_etcd_binary, free_port
from elastic.rendezvous import RendezvousConfig

pytestmark = pytest.mark.integration

PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"  # elastic.etcd_client.PASSWORD_ENV, spelled out: what a user sets

REPO = Path(__file__).resolve().parents[2]
ETCD_DIR = REPO / "deploy" / "etcd"


def _etcdctl() -> str:
    beside = Path(find_etcd_binary()).with_name("etcdctl")
    found = str(beside) if beside.is_file() else shutil.which("etcdctl")
    if not found:
        pytest.skip("no etcdctl next to the etcd binary or on PATH")
    return found


def test_default_server_names_cover_the_kubernetes_services(tmp_path: Path) -> None:
    subprocess.run([str(ETCD_DIR / "tls-certs.sh"), str(tmp_path)], check=True, capture_output=True, timeout=60)
    text = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "server.crt"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("DNS:etcd-client", "DNS:*.etcd.elastic-train.svc", "DNS:localhost", "IP Address:127.0.0.1"):
        assert name in text
    for name in ("server", "root", "client"):
        subprocess.run(
            ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / f"{name}.crt")],
            check=True,
            capture_output=True,
        )


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    certs = tmp_path / "certs"
    subprocess.run(
        [str(ETCD_DIR / "tls-certs.sh"), str(certs), "localhost", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    client, peer = free_port(), free_port()
    endpoint = f"https://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [
            find_etcd_binary(), "--name", "m0", "--data-dir", str(tmp_path / "data"),
            "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"m0=http://127.0.0.1:{peer}",
            "--cert-file", str(certs / "server.crt"), "--key-file", str(certs / "server.key"),
            "--trusted-ca-file", str(certs / "ca.crt"), "--client-cert-auth",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        yield certs, endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _enable_auth(certs: Path, endpoint: str, **env: str) -> subprocess.CompletedProcess[str]:
    ctl_env = {
        **os.environ, **env, "ETCDCTL": _etcdctl(), "ETCDCTL_ENDPOINTS": endpoint,
        "ETCDCTL_CACERT": str(certs / "ca.crt"),
        "ETCDCTL_CERT": str(certs / "root.crt"), "ETCDCTL_KEY": str(certs / "root.key"),
    }  # fmt: skip
    deadline = time.monotonic() + 20
    while True:  # etcd takes a moment to serve
        health = subprocess.run(
            [_etcdctl(), "endpoint", "health"], env=ctl_env, capture_output=True, text=True, timeout=20
        )
        if health.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return subprocess.run([str(ETCD_DIR / "enable-auth.sh")], env=ctl_env, capture_output=True, text=True, timeout=60)


def _client(endpoint: str, certs: Path, cert: str = "client", **auth: str) -> EtcdClient:
    return EtcdClient(
        EtcdClientConfig(
            endpoints=endpoint,
            ca_cert=str(certs / "ca.crt"),
            cert=str(certs / f"{cert}.crt"),
            key=str(certs / f"{cert}.key"),
            retry_deadline=timedelta(seconds=3),
            **auth,
        )
    )


def test_certificate_auth_confines_the_trainers_to_their_prefix(tls_etcd: tuple[Path, str]) -> None:
    certs, endpoint = tls_etcd
    result = _enable_auth(certs, endpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Authentication Enabled" in result.stdout

    trainer = _client(endpoint, certs)  # user from the certificate's CN: elastic-train
    lease = trainer.raw.lease(5)
    trainer.raw.put("/elastic-train/run-1/nodes/n0", "alive", lease=lease)
    assert [v for v, _ in trainer.raw.get_prefix("/elastic-train/run-1/")] == [b"alive"]
    lease.revoke()
    with pytest.raises(Exception, match="permission denied"):
        trainer.raw.put("/somebody-else/key", "x")
    # The root certificate administers the cluster.
    root = _client(endpoint, certs, cert="root")
    root.raw.put("/somebody-else/key", "x")


def test_password_auth(tls_etcd: tuple[Path, str]) -> None:
    certs, endpoint = tls_etcd
    result = _enable_auth(certs, endpoint, ELASTIC_TRAIN_PASSWORD="correct-horse-battery")
    assert result.returncode == 0, result.stdout + result.stderr
    trainer = _client(endpoint, certs, user="elastic-train", password="correct-horse-battery")
    trainer.raw.put("/elastic-train/run-2/x", "1")
    with pytest.raises(Exception, match="(?i)authentication failed|invalid"):
        _client(endpoint, certs, user="elastic-train", password="wrong")


def test_password_that_etcdctl_would_truncate_is_refused(tls_etcd: tuple[Path, str]) -> None:
    certs, endpoint = tls_etcd
    result = _enable_auth(certs, endpoint, ELASTIC_TRAIN_PASSWORD="correct horse")
    assert result.returncode == 2
    assert "must not contain whitespace" in result.stderr


def _from_rdzv_conf(endpoint: str, certs: Path, **conf: str) -> EtcdClient:
    """The etcd client an agent builds from `--rdzv-conf` (elastic/rendezvous.py), for real."""
    params = RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id="run-3", min_nodes=1, max_nodes=1,
                                  cacert=str(certs / "ca.crt"), cert=str(certs / "client.crt"),
                                  key=str(certs / "client.key"), etcd_timeout="3", **conf)
    return EtcdClient(RendezvousConfig.from_parameters(params).etcd)


def test_password_from_a_file_or_the_environment(tls_etcd: tuple[Path, str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    certs, endpoint = tls_etcd
    result = _enable_auth(certs, endpoint, ELASTIC_TRAIN_PASSWORD="correct-horse-battery")
    assert result.returncode == 0, result.stdout + result.stderr
    secret = tmp_path / "etcd-password"
    secret.write_text("correct-horse-battery\n")
    secret.chmod(0o600)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    _from_rdzv_conf(endpoint, certs, user="elastic-train", password_file=str(secret)).raw.put(
        "/elastic-train/run-3/a", "1"
    )
    monkeypatch.setenv(PASSWORD_ENV, "correct-horse-battery")
    _from_rdzv_conf(endpoint, certs, user="elastic-train").raw.put("/elastic-train/run-3/b", "2")
    monkeypatch.setenv(PASSWORD_ENV, "not-the-password")
    with pytest.raises(EtcdUnavailableError, match="authentication failed") as refused:
        _from_rdzv_conf(endpoint, certs, user="elastic-train")
    assert "not-the-password" not in str(refused.value)


def test_slurm_node_passes_the_password_in_the_environment_never_in_argv_or_its_log(tmp_path: Path) -> None:
    """deploy/slurm/node.sh: ETCD_PASSWORD reaches elastic-run as ELASTIC_ETCD_PASSWORD; a stand-in
    launcher records the argv and the environment it was exec'd with."""
    record = tmp_path / "record"
    launcher = tmp_path / "elastic-run"
    launcher.write_text(f'#!/bin/sh\n{{ printf "%s\\n" "$@"; echo "ENV=$ELASTIC_ETCD_PASSWORD"; }} > {record}\n')
    launcher.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "SCONTROL": "/nonexistent/scontrol",
        "SLURM_JOB_ID": "12345", "SLURM_NNODES": "2", "SLURMD_NODENAME": "gpu001", "SLURM_JOB_NODELIST": "gpu[001-002]",
        "SLURM_TMPDIR": str(tmp_path / "local"), "SHARED_ROOT": str(tmp_path / "pfs"), "ELASTIC_RUN": str(launcher),
        "ETCD_ENDPOINTS": "https://etcd:2379", "ETCD_CACERT": "/etc/etcd/ca.pem", "ETCD_USER": "elastic-train",
        "ETCD_PASSWORD": "pa,ss=word-in-env",  # ',' and '=' are fine now: it never goes through --rdzv-conf
    }  # fmt: skip
    result = subprocess.run(
        [str(REPO / "deploy" / "slurm" / "node.sh"), "run", "train.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    lines = record.read_text().splitlines()
    assert lines[-1] == "ENV=pa,ss=word-in-env"
    argv = lines[:-1]
    assert argv[argv.index("--rdzv-conf") + 1] == "cacert=/etc/etcd/ca.pem,user=elastic-train"
    assert "runs: " in result.stderr and "word-in-env" not in result.stderr + "\n".join(argv)
    with_file = subprocess.run(
        [str(REPO / "deploy" / "slurm" / "node.sh"), "run", "train.py"],
        capture_output=True,
        text=True,
        env={**env, "ETCD_PASSWORD": "", "ETCD_PASSWORD_FILE": "/run/secrets/etcd"},
        timeout=30,
    )
    assert with_file.returncode == 0, with_file.stderr
    argv = record.read_text().splitlines()[:-1]
    assert (
        argv[argv.index("--rdzv-conf") + 1]
        == "cacert=/etc/etcd/ca.pem,user=elastic-train,password_file=/run/secrets/etcd"
    )
