"""Connecting to etcd v3: endpoint lists with failover, TLS, auth, and bounded retries.

Every call into etcd from this package goes through `EtcdClient.call`, which retries transient
failures (connection refused, deadline exceeded, leader change) with exponential backoff and jitter
until a deadline, then raises `EtcdUnavailableError` naming the endpoints.

The password never travels in clear text and never shows: it comes from `--rdzv-conf
password_file=` or `$ELASTIC_ETCD_PASSWORD` (`password=` still works, with a warning: argv is
visible in `ps`), it is left out of every repr, masked in every log line (`elastic.credentials`),
and user/password auth over plain http is refused before anything is sent.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from core.numbers import decimal
from elastic.credentials import protect, read_secret_file, redact
from elastic.errors import EtcdUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"
"""Environment variable the etcd password may come from (instead of `--rdzv-conf password_file=`)."""

# python3-etcd3 0.13's watch thread calls `six.itervalues` on a broken stream without importing
# six, so a closed channel kills that thread with a NameError instead of failing the watches.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))

_TRANSIENT = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.NoServerAvailableError
    if hasattr(etcd3.exceptions, "NoServerAvailableError")
    else etcd3.exceptions.ConnectionFailedError,
)


# gRPC's own reconnect backoff grows to 120 s: after a 30 s outage a channel first tried etcd again 15 s after it
# was back, long enough for the leases of live nodes to lapse. Capped at 1 s, every node is back within a second.
# gRPC's connect timeout (`min_reconnect_backoff_ms`, 20 s by default) bounds one attempt: after a partition that
# dropped packets (no refusal) healed, the attempt begun during it hung on, and etcd answered again 12 s later (an
# 8 s partition); at 2 s, 1.0-1.1 s later (bench/etcd_reconnect.py). A list of pairs: grpc takes `options` as one,
# and python3-etcd3 hands it on as it is.
_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 2000),
]


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT):
        return True
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return False


def parse_endpoints(spec: str) -> tuple[tuple[str, int, bool], ...]:
    """Parse `host:port[,host:port...]`, each optionally with an http:// or https:// scheme.

    Returns (host, port, secure) triples. Raises ValueError naming the bad entry.
    """
    result = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        if ";" in item or " " in item:
            raise ValueError(f"bad etcd endpoint {raw.strip()!r}: separate endpoints with commas, e.g. "
                             "127.0.0.1:2379,127.0.0.1:22379")
        secure = item.startswith("https://")
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        if "://" in item:
            raise ValueError(f"bad etcd endpoint {raw.strip()!r}: the scheme is http:// or https:// (or none)")
        item = item.rstrip("/")
        host, sep, port_s = item.rpartition(":")
        port = decimal(port_s)
        if not sep or not host.strip() or port is None or not 0 < port < 65536:
            raise ValueError(f"bad etcd endpoint {raw.strip()!r}: expected host:port, e.g. 127.0.0.1:2379")
        host = host.strip()
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise ValueError(f"bad etcd endpoint {raw.strip()!r}: an IPv6 address goes in brackets, e.g. [::1]:2379")
        result.append((host, port, secure))  # brackets kept: grpc reads "[::1]:2379", not "::1:2379"
    if not result:
        raise ValueError("no etcd endpoint given: pass --rdzv-endpoint host:port[,host:port...]")
    return tuple(result)


@dataclass(frozen=True, kw_only=True)
class EtcdClientConfig:
    endpoints: str
    """Comma-separated `host:port` list (optionally http:// or https://); the client fails over between them."""
    ca_cert: str | None = None
    """CA bundle (PEM) that signed the etcd server certificates; enables TLS."""
    cert: str | None = None
    """Client certificate (PEM) for mutual TLS."""
    key: str | None = None
    """Client private key (PEM) for mutual TLS."""
    user: str | None = None
    """etcd user name for password authentication."""
    password: str | None = field(default=None, repr=False)
    """etcd password for `user` (see `resolve_password`); never in a repr or a log line."""
    request_timeout: timedelta = timedelta(seconds=3)
    """Deadline of one etcd RPC."""
    retry_deadline: timedelta = timedelta(seconds=15)
    """How long `call` keeps retrying transient failures before giving up."""

    def __post_init__(self) -> None:
        parse_endpoints(self.endpoints)
        for name, path in (("cacert", self.ca_cert), ("cert", self.cert), ("key", self.key)):
            if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ValueError(f"--rdzv-conf {name}={path}: not a readable file (a PEM file is expected)")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd TLS needs both a client certificate and its key (cert= and key=), or neither")
        if (self.user is None) != (self.password is None):
            raise ValueError(
                "etcd auth needs both user= and a password (password_file= or $ELASTIC_ETCD_PASSWORD), or neither"
            )
        if self.password is not None and not self.secure:
            raise ValueError(
                f"refusing to send the etcd password of user {self.user!r} in clear text over plain http to "
                f"{self.endpoints}: use TLS, with https:// endpoints or --rdzv-conf cacert=PATH (the CA of the "
                "etcd servers); or log in with a client certificate (cert=, key=) instead of a password"
            )
        if self.request_timeout <= timedelta(0) or self.retry_deadline <= timedelta(0):
            raise ValueError(f"etcd timeouts must be positive, got {self.request_timeout} and {self.retry_deadline}")

    @property
    def secure(self) -> bool:
        # A client certificate is for TLS too (the servers' CA then from the system's roots): over plain http it was
        # silently not sent.
        return self.ca_cert is not None or self.cert is not None or any(
            s for _, _, s in parse_endpoints(self.endpoints))


def resolve_password(user: str | None, password: str | None, password_file: str | None,
                     environ: Mapping[str, str] | None = None) -> str | None:
    """The etcd password for `user`: from `password_file=` (or `password=`), else `$ELASTIC_ETCD_PASSWORD`.

    `password=` works but is warned about: the command line is visible to every user of the machine.
    Raises ValueError naming the key when the settings contradict each other or the file is bad.
    """
    environ = os.environ if environ is None else environ
    from_env = environ.get(PASSWORD_ENV) or None
    if password is not None and password_file is not None:
        raise ValueError(
            "password= and password_file= contradict each other; pass one of them (password_file= is safer)"
        )
    if user is None:
        if password is not None or password_file is not None:
            raise ValueError(
                f"{'password' if password is not None else 'password_file'}= needs user=: the etcd user it logs in as"
            )
        if from_env is not None:
            log.warning("etcd: $%s is set but --rdzv-conf has no user=; the password is not used", PASSWORD_ENV)
        return None
    if password_file is not None:
        password = read_secret_file(password_file, key="password_file")
    elif password is not None:
        log.warning(
            "etcd: --rdzv-conf password= shows the etcd password to every user of this machine (ps, "
            "/proc/PID/cmdline) and keeps it in shell history; use password_file=PATH or $%s instead",
            PASSWORD_ENV,
        )
    elif from_env is not None:
        password = from_env
    else:
        raise ValueError(f"user={user} needs a password: pass --rdzv-conf password_file=PATH or set ${PASSWORD_ENV}")
    protect(password)
    return password


class EtcdClient:
    """A connected etcd v3 client with bounded retries. `raw` is the python-etcd3 client."""

    def __init__(self, config: EtcdClientConfig) -> None:
        self.config = config
        protect(config.password)
        self.raw: etcd3.MultiEndpointEtcd3Client = self.call(self._connect, what="connect")

    def _connect(self) -> etcd3.MultiEndpointEtcd3Client:
        cfg = self.config
        creds = None
        if cfg.secure:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(cfg.ca_cert),
                private_key=_read(cfg.key),
                certificate_chain=_read(cfg.cert),
            )
        endpoints = [
            etcd3.Endpoint(host, port, secure=cfg.secure, creds=creds, time_retry=1.0, opts=_CHANNEL_OPTIONS)
            for host, port, _ in parse_endpoints(cfg.endpoints)
        ]
        client = etcd3.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=cfg.request_timeout.total_seconds(),
            user=cfg.user,
            password=cfg.password,
            failover=True,
        )
        client.status()  # proves the endpoint answers (and that auth worked)
        return client

    def call(self, fn: Callable[[], T], *, what: str, deadline: timedelta | None = None) -> T:
        """Run `fn`, retrying transient etcd failures with jittered exponential backoff until `deadline`."""
        limit = (deadline or self.config.retry_deadline).total_seconds()
        retrying = Retrying(
            stop=stop_after_delay(limit),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception(_is_transient),
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            self._raise_typed(exc, what=what, within=f"within {limit:.0f}s")
            raise

    def once(self, fn: Callable[[], T], *, what: str) -> T:
        """Run `fn` once (a caller that tries again on its own schedule, as a lease's keep-alive); an etcd failure
        raises the same typed errors, naming the endpoints, as `call`."""
        try:
            return fn()
        except Exception as exc:
            self._raise_typed(exc, what=what, within="(one try)")
            raise

    def _raise_typed(self, exc: Exception, *, what: str, within: str) -> None:
        """Raise EtcdUnavailableError, naming the endpoints and what to do, for an etcd failure `exc` that has
        one; return for any other exception (the caller re-raises it)."""
        if _is_transient(exc):
            raise EtcdUnavailableError(
                redact(
                    f"etcd at {self.config.endpoints} did not answer `{what}` {within} "
                    f"({type(exc).__name__}: {exc}). "
                    "Is etcd running and reachable? Check --rdzv-endpoint and the network."
                ),
                transient=True,
            ) from exc
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and exc.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.PERMISSION_DENIED,
        ):
            raise EtcdUnavailableError(redact(
                f"etcd at {self.config.endpoints} refused `{what}`: {exc.details()}. "
                "Check the user/password and TLS settings in --rdzv-conf."
            )) from exc
        advice = _advice(exc)
        if advice is not None:
            raise EtcdUnavailableError(redact(
                f"etcd at {self.config.endpoints} refused `{what}`: {exc.details()}. {advice}"  # type: ignore[attr-defined]
            )) from exc

    def close(self) -> None:
        try:
            self.raw.close()
        except Exception:  # noqa: BLE001 - closing a dead channel must not mask the real error
            log.debug("closing etcd client failed", exc_info=True)


_ADVICE = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        "etcd is out of space (its --quota-backend-bytes) and takes no writes: compact and defragment it and "
        "disarm the NOSPACE alarm (etcdctl compact <revision>; etcdctl defrag; etcdctl alarm disarm), or give it a "
        "larger quota; then start the job again."),
    grpc.StatusCode.UNIMPLEMENTED: (
        "That server does not speak etcd's v3 API: check that --rdzv-endpoint names an etcd (3.4 or later) client "
        "URL, e.g. 127.0.0.1:2379."),
}
"""What to do about etcd's refusals that no retry mends (beside authentication's, handled above)."""


def _advice(exc: Exception) -> str | None:
    """_ADVICE for `exc`; RESOURCE_EXHAUSTED only when it is the space quota (etcd also says it for too many
    requests, or a message too large, which the retries or the caller handle)."""
    if not isinstance(exc, grpc.RpcError) or not hasattr(exc, "code"):
        return None
    code = exc.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space exceeded" not in str(exc.details()):
        return None
    return _ADVICE.get(code)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()
