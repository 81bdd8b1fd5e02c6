"""The node's checkpoint helper: a process that finishes tier-0 snapshots for the node's workers.

    elastic-run's agent:  python -m ckpt.helper_process --socket <tier0 dir>/helper.sock --parent <agent pid>
    a worker (writer):    HelperClient(<tier0 dir>).publish(slot, ...)   -> the slot's manifest is written

Why a process: a snapshot every step leaves work after its copy (a sum64 checksum of the whole slot,
the manifest, its atomic write). Done on a thread of the training process, it took ~6% of a GPT's
throughput on one H200 (bench/results/goodput_cuda_h200_tier0_probe_*): that thread and the training
thread share the GIL and the CPU that launches the kernels. The helper reads the slot through its own
mapping of the tmpfs file (the slot lives in the node's shared memory, ckpt/tier0.py), so the worker
only sends a few hundred bytes and waits on a socket, without the GIL.

Protocol: a Unix stream socket in the node's tier-0 directory (private to the node, mode 0700); one
connection per worker; request, then reply, framed as [u32 header length][header JSON][u32 body
length][body]. Requests:
  template  header {"op", "id"}; body: a manifest of the layout (its tensors and shards; any files
            and state) — sent once per layout, as the tensors' entries are hundreds of lines
  publish   header {"op", "template", "path" (the slot directory), "size" (bytes of its file image),
            "step", "rank", "world_size", "generation", "run", "run_uid", "chunk_bytes"}; body: the
            state skeleton's JSON. The helper checksums the slot's file image, writes its manifest
            (atomically) and replies; the slot is then the rank's newest snapshot.
Replies: {"ok": true} or {"ok": false, "error": "..."}.

Failure: the worker gives the helper `timeout` seconds; on no answer, a broken connection or an
error it publishes the slot itself, as without a helper, and tries the helper again later (a restarted
helper, which the agent starts when the old one died: elastic/node_helper.py). A helper that writes a
manifest late, after the worker reused the slot, leaves a manifest whose checksum does not match the
slot's bytes: readers reject it (ckpt/tier0.py) and use the other slot.

The process itself: ckpt/helper_process.py.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from pathlib import Path
from typing import Any

from core.events import emit

logger = logging.getLogger(__name__)

SOCKET_NAME = "helper.sock"
"""The helper's socket, in the node's tier-0 directory."""

_LEN = struct.Struct("!I")
_MAX_FRAME = 256 << 20


class HelperError(Exception):
    """The helper did not finish a request (the caller does the work itself)."""


def socket_path(tier0_dir: str | Path) -> Path:
    return Path(tier0_dir) / SOCKET_NAME


# -- framing ---------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(head)) + head + _LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    parts = []
    for _ in range(2):
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if n > _MAX_FRAME:
            raise ConnectionError(f"a frame of {n} bytes (the limit is {_MAX_FRAME})")
        parts.append(_recv_exact(sock, n))
    header = json.loads(parts[0])
    if not isinstance(header, dict):
        raise ConnectionError("a header that is not a JSON object")
    return header, parts[1]


# -- the worker's side -----------------------------------------------------------------------------


class HelperClient:
    """A worker's connection to its node's helper (one per rank; used from one thread at a time)."""

    RETRY_S = 5.0
    """After a failure, the helper is tried again this much later (meanwhile the worker publishes)."""

    def __init__(self, tier0_dir: str | Path, *, timeout: float = 30.0) -> None:
        self.path = socket_path(tier0_dir)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._templates: dict[int, int] = {}  # id(template bytes' owner) -> template id sent on this connection
        self._next_id = 0
        self._retry_at = 0.0
        self._warned = False
        self.published = 0
        """Snapshots the helper published (for metrics and tests)."""

    def available(self) -> bool:
        """Whether to try the helper now: its socket exists and no failure is recent."""
        return time.monotonic() >= self._retry_at and (self._sock is not None or self.path.exists())

    def publish(self, *, template_key: int, template: bytes, path: Path, size: int, step: int, rank: int,
                world_size: int, generation: str, run: str, run_uid: str, chunk_bytes: int,
                state_json: bytes) -> None:
        """Have the helper checksum the slot at `path` and write its manifest. Raises HelperError (the
        caller then publishes the slot itself)."""
        try:
            sock = self._connect()
            tid = self._templates.get(template_key)
            if tid is None:
                tid = self._next_id = self._next_id + 1
                self._call(sock, {"op": "template", "id": tid}, template)
                self._templates = {template_key: tid}  # one layout at a time: the old one is not reused
            self._call(sock, {"op": "publish", "template": tid, "path": str(path), "size": size, "step": step,
                              "rank": rank, "world_size": world_size, "generation": generation, "run": run,
                              "run_uid": run_uid, "chunk_bytes": chunk_bytes}, state_json)
            self.published += 1
        except (OSError, ValueError, HelperError) as exc:
            self.close()
            self._retry_at = time.monotonic() + self.RETRY_S
            if not self._warned:
                self._warned = True
                emit("ckpt_helper", state="lost", step=step, error=str(exc))
                logger.warning("the node's checkpoint helper (%s) did not publish step %d: %s; this worker "
                               "publishes its snapshots itself until the helper answers again", self.path, step, exc)
            raise HelperError(str(exc)) from exc

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except OSError:
                sock.close()
                raise
            self._sock, self._templates = sock, {}
            if self._warned:
                logger.info("the node's checkpoint helper answers again (%s)", self.path)
                emit("ckpt_helper", state="back")
                self._warned = False
        return self._sock

    @staticmethod
    def _call(sock: socket.socket, header: dict[str, Any], body: bytes) -> None:
        send_frame(sock, header, body)
        reply, _ = recv_frame(sock)
        if not reply.get("ok"):
            raise HelperError(str(reply.get("error", "no reason given")))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
