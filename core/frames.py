"""Length-prefixed JSON frames over a stream socket: [u32 header length][header JSON][u32 body length][body].

The node's checkpoint helper speaks them on its Unix socket (ckpt/helper.py) and on its replica listener
(ckpt/replica.py).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_LEN = struct.Struct("!I")
MAX_FRAME = 256 << 20


def send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(head)) + head + _LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
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
        (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
        if n > MAX_FRAME:
            raise ConnectionError(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
        parts.append(recv_exact(sock, n))
    header = json.loads(parts[0])
    if not isinstance(header, dict):
        raise ConnectionError("a header that is not a JSON object")
    return header, parts[1]
