"""Fast detection of a dead agent process, ahead of its lease expiring.

Each agent listens on a "beacon" socket for as long as it lives, and publishes its address in its
membership record. Peers hold one idle TCP connection to every beacon. When an agent process dies,
even by SIGKILL, its kernel closes the socket and the peers read EOF at once; they then revoke the
dead node's lease, so everyone sees it leave through the normal watch. When a whole machine or its
network goes away no EOF arrives, and the lease TTL remains the (slower) safety net. An agent that leaves on
purpose (its job done, a stop signal) sends `LEAVING` on each held connection before it closes them: its peers
then log its leaving, not its loss.

Every socket this package listens on is made by `listening_socket`: bound to `--local-addr` when
one is given, so nothing listens on interfaces the user did not name.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def listening_socket(host: str | None, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on a free port of `host` (`--local-addr`), or of every interface when None."""
    if host is None:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=backlog)
        return socket.create_server(("", 0), backlog=backlog)
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, 0), family=family, backlog=backlog)


LEAVING = b"L"
"""The one byte a beacon sends: its agent is leaving on purpose (the connection closes next)."""

MAX_HELD = 4096
"""Connections a beacon holds at most: one per live peer is what it needs; past this, new ones are refused."""


class Beacon:
    """A listening socket held open for this agent's lifetime; each peer's connection is held until that peer
    closes it (a lost node's agent, a port scan): every connection was held for the agent's life, one file
    descriptor per node that ever joined, until the agent ran out of them and its node fell out of the job."""

    def __init__(self, bind: str | None, *, advertise: str | None = None) -> None:
        """Listen on `bind` (None: every interface); peers are told `advertise:port` (default: `bind`)."""
        host = advertise or bind
        if host is None:
            raise ValueError("a beacon on every interface needs the address peers reach it at (advertise=)")
        self._sock = listening_socket(bind, backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._peers: set[socket.socket] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="elastic-beacon", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """Peer connections held now."""
        return len(self._peers)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ, None)
            while not self._closed.is_set():
                for key, _ in selector.select(timeout=1.0):
                    if key.data is None:
                        self._accept(selector)
                    else:
                        self._read(selector, key.fileobj)  # type: ignore[arg-type]

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return  # closed (close() wakes the select by shutting the socket down), or the peer already gone
        if len(self._peers) >= MAX_HELD:
            conn.close()
            return
        conn.setblocking(False)
        self._peers.add(conn)
        selector.register(conn, selectors.EVENT_READ, "peer")

    def _read(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)  # never sent by our peers: only its closing carries meaning
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # that peer closed: so do we
            selector.unregister(conn)
            self._peers.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop listening; tell each peer this agent leaves on purpose, then close its connection."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked select() on Linux
        except OSError:
            pass
        self._thread.join(timeout=2)
        for peer in list(self._peers):
            try:
                peer.send(LEAVING)  # non-blocking: one byte into an idle connection's empty buffer
            except OSError:
                pass
        for s in [self._sock, *self._peers]:
            try:
                s.close()
            except OSError:
                pass


class Monitor:
    """Holds a connection to each peer's beacon and calls `on_lost(node_id, left)` when one closes (`left`: it said
    LEAVING first, its agent left on purpose)."""

    def __init__(self, on_lost: Callable[[str, bool], None]) -> None:
        self._on_lost = on_lost
        self._selector = selectors.DefaultSelector()
        self._conns: dict[str, socket.socket] = {}
        self._addresses: dict[str, str] = {}
        self._leaving: set[str] = set()
        """Peers whose beacon said LEAVING: their closing is a leave, not a loss."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="elastic-liveness", daemon=True)
        self._thread.start()

    def track(self, peers: dict[str, str]) -> None:
        """Watch exactly these peers (node id -> beacon `host:port`); connect to new ones."""
        with self._lock:
            for node in list(self._conns):
                if node not in peers or peers[node] != self._addresses.get(node):
                    self._drop(node)
            for node, address in peers.items():
                if node in self._conns:
                    continue
                host, _, port = address.rpartition(":")
                try:
                    conn = socket.create_connection((host, int(port)), timeout=1.0)
                except (OSError, ValueError):
                    continue  # unreachable beacon: the lease still covers this peer
                conn.setblocking(False)
                self._conns[node], self._addresses[node] = conn, address
                self._selector.register(conn, selectors.EVENT_READ, node)
        self._wake_w.send(b"x")

    def _drop(self, node: str) -> None:
        conn = self._conns.pop(node, None)
        self._addresses.pop(node, None)
        self._leaving.discard(node)
        if conn is not None:
            try:
                self._selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=1.0):
                if key.data is None:
                    self._wake_r.recv(4096)
                    continue
                node = key.data
                try:
                    data = key.fileobj.recv(1)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data == LEAVING:
                    with self._lock:
                        if self._conns.get(node) is key.fileobj:  # not a connection track() replaced meanwhile
                            self._leaving.add(node)
                    continue
                if data == b"":
                    with self._lock:
                        left = node in self._leaving
                        if self._conns.get(node) is key.fileobj:
                            self._drop(node)
                        else:
                            continue
                    if left:
                        log.info("liveness: the agent of node %s left (it closed its beacon on purpose)", node)
                    else:
                        log.warning("liveness: the agent of node %s closed its beacon: it is gone", node)
                    try:
                        self._on_lost(node, left)
                    except Exception as exc:  # noqa: BLE001 - thread boundary; the lease TTL is the fallback
                        log.warning("liveness: reporting %s lost failed (%s): its lease running out reports it",
                                     node, exc)
                        log.debug("liveness: reporting %s lost failed", node, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for node in list(self._conns):
                self._drop(node)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
