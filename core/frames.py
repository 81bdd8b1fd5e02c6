"""Length-prefixed JSON frames over a stream socket: [u32 header length][header JSON][u32 body length][body].

The node's checkpoint helper speaks them on its Unix socket (ckpt/helper.py) and on its replica listener
(ckpt/replica.py).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from core.deadline import Deadline

_LEN = struct.Struct("!I")
MAX_FRAME = 256 << 20


def send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(head)) + head + _LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int, deadline: Deadline | None = None) -> bytes:
    """`n` bytes; by `deadline` if given (the socket's timeout bounds each read, not a peer that sends a byte
    now and then)."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            check_before(deadline, sock, f"{n - len(data)} of {n} bytes")
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


def check_before(deadline: Deadline, sock: socket.socket, what: str) -> None:
    """Raise TimeoutError (an OSError) once `deadline` passed; else cap the socket's timeout at what is left."""
    left = deadline.remaining()
    if left is not None and left <= 0:
        raise TimeoutError(f"the peer had not sent {what} by the deadline")
    if left is not None:
        current = sock.gettimeout()
        sock.settimeout(left if current is None else min(current, left))


def recv_frame(sock: socket.socket, deadline: Deadline | None = None) -> tuple[dict[str, Any], bytes]:
    parts = []
    for _ in range(2):
        (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
        if n > MAX_FRAME:
            raise ConnectionError(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
        parts.append(recv_exact(sock, n, deadline))
    try:
        header = json.loads(parts[0])
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser's depth
        raise ConnectionError(f"a header that is not JSON ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise ConnectionError("a header that is not a JSON object")
    return header, parts[1]
