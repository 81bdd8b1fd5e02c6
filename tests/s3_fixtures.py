"""A real S3 endpoint for tests: moto's HTTP server on a free loopback port, and s3fs options for it.

    from tests.s3_fixtures import MotoS3, moto_s3, s3_bucket  # noqa: F401  (fixtures)

`moto_s3` is one server for the whole session; tests isolate themselves with a fresh bucket
(`s3_bucket`). A test that takes the endpoint down starts its own `MotoS3` and calls `stop()` /
`start()`: the server comes back on the same port with its buckets and objects (moto keeps
them in this process), like a store that was unreachable for a while.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

_KEY = "testing"
_SECRET = "testing"
_REGION = "us-east-1"


class MotoS3:
    """moto's ThreadedMotoServer on 127.0.0.1, first on a free port, then always on that port."""

    def __init__(self) -> None:
        self.port = 0
        self._server: Any = None

    @property
    def endpoint_url(self) -> str:
        assert self.port, "start() first"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        assert self._server is None, "already running"
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self._server = server
        self.port = server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        """Shut the server down (its thread is joined); connections to the port are refused."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint: short timeouts, no botocore retries, no caching, no
        connection reuse."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"region_name": _REGION},
            "config_kwargs": {
                "connect_timeout": 1,
                "read_timeout": 5,
                "retries": {"max_attempts": 1, "mode": "standard"},
                # A new connection per request: after stop(), the server's threads still serve
                # connections opened before, so a pooled one would outlive the "outage".
                "connector_args": {"force_close": True, "keepalive_timeout": None},
            },
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }

    def make_bucket(self, name: str | None = None) -> str:
        """A new bucket (`name`, else a fresh one); returns its name."""
        import boto3

        name = name or f"ckpt-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=_KEY,
            aws_secret_access_key=_SECRET,
            region_name=_REGION,
        )
        client.create_bucket(Bucket=name)
        return name

    def refuses_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return False
        except OSError:
            return True


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(moto_s3: MotoS3) -> str:
    return moto_s3.make_bucket()


@pytest.fixture
def own_moto_s3() -> Iterator[MotoS3]:
    """A server of this test's own, which the test may stop and start again."""
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fast_s3fs_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs retries every call 5 times with up to 0.8 s pauses on top of ours; keep it to 1."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)


class Checkpointers:
    """Builds Checkpointers for a test and closes every one of them at teardown, then checks
    that no checkpoint thread outlived close()."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def make(self, config: Any, *, rank: int = 0, world_size: int = 1, **kwargs: Any) -> Any:
        from ckpt import Checkpointer

        kwargs.setdefault("local_world_size", world_size)
        checkpointer = Checkpointer(config, rank=rank, world_size=world_size, **kwargs)
        self.made.append(checkpointer)
        return checkpointer

    def close_all(self) -> None:
        from datetime import timedelta

        for checkpointer in self.made:
            checkpointer.close(timedelta(seconds=5))


def ckpt_threads() -> set[Any]:
    import threading

    # Not the tries of store calls that never answered: left behind by design until the client's own timeouts
    # end them (ckpt/retry.py, `bounded`); close() cannot join them.
    return {t for t in threading.enumerate()
            if t.name.startswith("ckpt-") and t.name != "ckpt-store-call" and t.is_alive()}


@pytest.fixture
def checkpointers() -> Iterator[Checkpointers]:
    before = ckpt_threads()
    made = Checkpointers()
    try:
        yield made
    finally:
        made.close_all()
    left = sorted(t.name for t in ckpt_threads() - before)
    assert left == [], f"checkpoint threads left running after close(): {left}"


class FailingGets:
    """An HTTP proxy in front of a real S3 endpoint that answers 503 to the GETs whose path matches `pattern`
    while `failing` is set, and passes everything else through: a store whose downloads fail for a while."""

    def __init__(self, upstream: MotoS3, pattern: str) -> None:
        import http.client
        import re
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.failing = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.close_connection = True
                if proxy.failing.is_set() and self.command == "GET" and re.search(pattern, self.path):
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream.port, timeout=30)
                conn.request(self.command, self.path, body=body,
                             headers={k: v for k, v in self.headers.items() if k.lower() != "connection"})
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(key, value)
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._upstream = upstream

    def storage_options(self) -> dict[str, Any]:
        options = self._upstream.storage_options()
        return {**options, "endpoint_url": f"http://127.0.0.1:{self._server.server_address[1]}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
