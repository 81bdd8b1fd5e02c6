"""etcd TLS (CA, client certificate and key) and user/password auth for the rendezvous, against a
real etcd started with TLS; certificates are generated with `cryptography`. Also: a stale
generation is fenced out by the revision check, and a conflicting run id is refused; the password
comes from the environment or a file, never shows in a real agent's output (even at debug level,
even when etcd refuses it), and is never sent over plain http."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from elastic.errors import EtcdUnavailableError, RunIdConflictError
from elastic.etcd_client import EtcdClientConfig
from elastic.etcd_server import EtcdServer, EtcdServerConfig, find_etcd_binary
from elastic.rendezvous import EtcdV3RendezvousHandler, RendezvousConfig
from elastic.round import RoundState
from tests.conftest import Procs
from tests.integration.test_elastic_faults import WORKER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"  # elastic.etcd_client.PASSWORD_ENV, spelled out: what a user sets


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


@dataclass
class Certs:
    ca: str
    server: tuple[str, str]
    client: tuple[str, str]


def make_certs(directory: Path) -> Certs:
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastic-train test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(name: str, usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert, key

    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server = _write(directory / "server", *leaf("etcd", x509.oid.ExtendedKeyUsageOID.SERVER_AUTH))
    client = _write(directory / "client", *leaf("trainer", x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH))
    return Certs(str(directory / "ca.crt"), server, client)


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Certs]]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    server = EtcdServer(EtcdServerConfig(scheme="https", extra_args=(
        "--cert-file", certs.server[0], "--key-file", certs.server[1],
        "--trusted-ca-file", certs.ca, "--client-cert-auth",
    ))).start()
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    base = [etcdctl, f"--endpoints={server.client_url}", f"--cacert={certs.ca}", f"--cert={certs.client[0]}",
            f"--key={certs.client[1]}"]
    for args in (["user", "add", "root", "--new-user-password=rootpw"], ["user", "grant-role", "root", "root"],
                 ["role", "add", "trainer"],
                 ["role", "grant-permission", "trainer", "--prefix=true", "readwrite", "/elastic-train/"],
                 ["user", "add", "trainer", "--new-user-password=s3cret"], ["user", "grant-role", "trainer", "trainer"],
                 ["auth", "enable"]):
        subprocess.run([*base, *args], check=True, capture_output=True, timeout=20)
    try:
        yield server, certs
    finally:
        server.stop()


def handler(endpoint: str, run_id: str, node: str, *, certs: Certs | None = None, password: str | None = "s3cret",
            nnodes: tuple[int, int] = (2, 2), client_cert: bool = True, join_timeout: float = 20,
            ) -> EtcdV3RendezvousHandler:
    etcd = EtcdClientConfig(
        endpoints=endpoint,
        ca_cert=certs.ca if certs else None,
        cert=certs.client[0] if certs and client_cert else None,
        key=certs.client[1] if certs and client_cert else None,
        user="trainer" if password else None,
        password=password,
        retry_deadline=timedelta(seconds=3),
    )
    return EtcdV3RendezvousHandler(RendezvousConfig(
        run_id=run_id, node_id=node, min_nodes=nnodes[0], max_nodes=nnodes[1], local_addr="127.0.0.1", etcd=etcd,
        lease_ttl=timedelta(seconds=2), join_timeout=timedelta(seconds=join_timeout),
    ))


def test_rendezvous_over_tls_with_client_certificates_and_password_auth(secure_etcd: tuple[EtcdServer, Certs]) -> None:
    server, certs = secure_etcd
    a, b = (handler(server.client_url, "tls-run", n, certs=certs) for n in ("a", "b"))
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(timeout=30) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
        infos[0].store.set("k", b"v")
        assert infos[1].store.get("k") == b"v"
    finally:
        for h in (a, b):
            h.shutdown()


def test_wrong_password_is_a_clear_error(secure_etcd: tuple[EtcdServer, Certs]) -> None:
    server, certs = secure_etcd
    with pytest.raises(EtcdUnavailableError) as info:
        handler(server.client_url, "tls-run-2", "a", certs=certs, password="wrong")
    assert server.endpoint in str(info.value) and "user/password" in str(info.value)


def test_missing_client_certificate_is_refused_within_the_deadline(secure_etcd: tuple[EtcdServer, Certs]) -> None:
    server, certs = secure_etcd
    with pytest.raises(EtcdUnavailableError) as info:
        handler(server.client_url, "tls-run-3", "a", certs=certs, client_cert=False)
    assert server.endpoint in str(info.value)


def test_stale_generation_is_fenced_out_by_the_revision_check(etcd: EtcdServer, run_id: str) -> None:
    a, b = (handler(etcd.endpoint, run_id, n, password=None) for n in ("a", "b"))
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]:
                f.result(timeout=30)
        stale = b.view.read()  # b's view of round 1, about to go stale
        a._completed_generation = stale.state.generation  # a restarts and opens round 2 # noqa: SLF001
        opened = RoundState(stale.state.generation + 1, "joining", ("a",), stale.state.participants, nnodes=(2, 2))
        assert a._swap_state(opened, stale.state_revision)  # noqa: SLF001
        # b still acts on round 1: its write carries the old revision and is refused.
        zombie = RoundState(stale.state.generation, "closed", ("b",), nnodes=(2, 2))
        assert not b._swap_state(zombie, stale.state_revision)  # noqa: SLF001
        assert b.view.read().state == opened
        assert b.num_nodes_waiting() > 0 or b.view.read().state.generation > b.generation
    finally:
        for h in (a, b):
            h.shutdown()


def test_agent_of_another_job_under_the_same_run_id_is_refused(etcd: EtcdServer, run_id: str) -> None:
    # `first` waits in its round until its join timeout: long enough for `other` to be refused (well
    # under a second), short enough not to keep the test waiting (shutdown leaves an unfinished run open).
    first = handler(etcd.endpoint, run_id, "a", password=None, nnodes=(2, 4), join_timeout=8)
    other = handler(etcd.endpoint, run_id, "b", password=None, nnodes=(1, 1))
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(first.next_rendezvous)  # opens round 1 and waits for a second node
            deadline = time.monotonic() + 15
            while other.view.read().state is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(RunIdConflictError) as info:
                other.next_rendezvous()
            assert run_id in str(info.value) and "2:4" in str(info.value)
            first.shutdown()
            with pytest.raises(Exception):  # noqa: B017 - its join timeout or the closed client ends the wait
                pending.result(timeout=30)
    finally:
        other.shutdown()


# -- the etcd password: from a file or the environment, never shown, never sent in clear text -------------


class AcceptCounter:
    """A listening socket standing in for an etcd endpoint: it counts the connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def _agent(procs: Procs, endpoint: str, conf: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return procs.elastic_run("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                             "--rdzv-id", f"pw-{uuid.uuid4().hex[:8]}", "--rdzv-conf", conf,
                             str(WORKER), "--max-seconds", "1", env={"LOGLEVEL": "DEBUG", PASSWORD_ENV: "", **env})


def _output(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=90)
    return out


@pytest.mark.timeout(180)
def test_the_password_works_from_the_environment_and_never_shows_in_the_agents_output(
    secure_etcd: tuple[EtcdServer, Certs], procs: Procs, tmp_path: Path,
) -> None:
    server, certs = secure_etcd
    tls = f"cacert={certs.ca},cert={certs.client[0]},key={certs.client[1]},user=trainer"
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("wr0ng-from-a-file\n")
    good = _agent(procs, server.client_url, tls, {PASSWORD_ENV: "s3cret"})
    from_file = _agent(procs, server.client_url, f"{tls},password_file={wrong_file}", {})
    from_argv = _agent(procs, server.client_url, f"{tls},password=wr0ng-from-argv", {})
    out = _output(good)
    assert good.returncode == 0, out[-3000:]
    assert "s3cret" not in out
    for proc, secret in ((from_file, "wr0ng-from-a-file"), (from_argv, "wr0ng-from-argv")):
        out = _output(proc)
        assert proc.returncode == 1, out[-3000:]
        assert "authentication failed" in out and "Check the user/password" in out
        assert secret not in out, f"the password shows in the agent's output:\n{out[-3000:]}"
    assert "password= shows the etcd password to every user of this machine" in out


@pytest.mark.timeout(120)
def test_password_auth_over_plain_http_is_refused_before_connecting(procs: Procs, tmp_path: Path) -> None:
    etcd = AcceptCounter()  # no etcd at all: whoever connects is counted
    try:
        in_argv = _agent(procs, etcd.endpoint, "user=trainer,password=pl4in-http-argv", {})
        in_env = _agent(procs, etcd.endpoint, "user=trainer", {PASSWORD_ENV: "pl4in-http-env"})
        for proc, secret in ((in_argv, "pl4in-http-argv"), (in_env, "pl4in-http-env")):
            out = _output(proc)
            assert proc.returncode == 2, out[-3000:]
            assert "refusing to send the etcd password of user 'trainer' in clear text over plain http" in out
            assert "use TLS, with https:// endpoints or --rdzv-conf cacert=PATH" in out
            assert secret not in out
        assert etcd.accepted == 0, "the agent connected to a plain-http endpoint with a password"
    finally:
        etcd.close()
