"""How soon after etcd is reachable again does an agent's etcd client answer (elastic/etcd_client.py)?

    .venv/bin/python bench/etcd_reconnect.py [--outage 8] [--rounds 2]

A lease's keep-alive refreshes every third of the TTL (3 s by default); a node whose client stays away for
longer after etcd is back loses its lease, and its peers may judge it gone (membership.py doubts the live set for
TTL + TTL/3 + 1 s after an outage, no longer). Two outages, each with our channel options and with gRPC's defaults,
side by side, in alternating rounds:

- refused: etcd stopped and started again on the same ports (connections are refused meanwhile);
- silent: a partition that drops packets. A TCP relay in front of etcd cuts the open connections, then accepts
  new ones and never answers them (a gRPC connect attempt hangs until its connect timeout), then relays again.

Prints one JSON object: seconds from etcd being reachable to the first answered lease refresh, per round.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import elastic.etcd_client as etcd_client
from elastic.etcd_client import EtcdClient, EtcdClientConfig
from elastic.etcd_server import EtcdServer, EtcdServerConfig

_OURS = list(etcd_client._CHANNEL_OPTIONS)


class Relay:
    """A TCP relay to `port` on 127.0.0.1 that can turn into a black hole."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.hole = False
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._socks.append(conn)
            if self.hole:
                continue  # held open, never answered
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._socks.append(upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def drop_packets(self) -> None:
        self.hole = True
        for s in self._socks:  # the open connections break (a keepalive would find them dead)
            _close(s)
        self._socks.clear()

    def heal(self) -> None:
        self.hole = False  # connections accepted meanwhile stay silent: a dropped SYN is never answered

    def close(self) -> None:
        _close(self._listener)
        for s in self._socks:
            _close(s)


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    _close(a)
    _close(b)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _answers(client: EtcdClient, lease: int) -> bool:
    try:
        return bool(list(client.raw.refresh_lease(lease)))
    except Exception:  # noqa: BLE001 - any failure: not back yet
        return False


def _back_after(client: EtcdClient, lease: int, outage: float, cut: Callable[[], None],
                restore: Callable[[], None]) -> float:
    assert _answers(client, lease)
    cut()
    until = time.monotonic() + outage
    while time.monotonic() < until:  # the keep-alive tries on through the outage
        _answers(client, lease)
        time.sleep(1.0)
    restore()
    back = time.monotonic()
    while not _answers(client, lease):
        if time.monotonic() - back > 90:
            return float("inf")
        time.sleep(0.05)
    return time.monotonic() - back


def refused(options: list[tuple[str, int]], outage: float) -> float:
    with tempfile.TemporaryDirectory(prefix="etcd-reconnect-") as data:
        first = EtcdServer(EtcdServerConfig(data_dir=data)).start()
        etcd_client._CHANNEL_OPTIONS[:] = options
        client = EtcdClient(EtcdClientConfig(endpoints=first.endpoint))
        lease = client.raw.lease(600).id
        servers = [first]

        def restart() -> None:
            servers.append(EtcdServer(EtcdServerConfig(data_dir=data, client_port=first.client_port,
                                                       peer_port=first.peer_port)).start())
        try:
            return _back_after(client, lease, outage, first.kill, restart)
        finally:
            client.raw.close()
            for s in servers:
                s.stop()


def silent(options: list[tuple[str, int]], outage: float) -> float:
    server = EtcdServer(EtcdServerConfig()).start()
    relay = Relay(server.client_port)
    etcd_client._CHANNEL_OPTIONS[:] = options
    client = EtcdClient(EtcdClientConfig(endpoints=f"127.0.0.1:{relay.port}"))
    try:
        return _back_after(client, client.raw.lease(600).id, outage, relay.drop_packets, relay.heal)
    finally:
        client.raw.close()
        relay.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outage", type=float, default=8.0, help="seconds etcd is unreachable")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    grpc_defaults = [o for o in _OURS if not o[0].endswith("reconnect_backoff_ms")]
    results: dict[str, Any] = {"outage_s": args.outage, "lease_ttl_s": 3.0}
    for kind, measure in (("refused", refused), ("silent", silent)):
        runs: dict[str, list[float]] = {"ours": [], "grpc_defaults": []}
        for _ in range(args.rounds):
            for name, options in (("ours", _OURS), ("grpc_defaults", grpc_defaults)):
                runs[name].append(round(measure(options, args.outage), 2))
        results[kind] = {name: {"back_after_s": r, "median_s": statistics.median(r)} for name, r in runs.items()}
        results[kind]["ratio_defaults_to_ours"] = round(
            results[kind]["grpc_defaults"]["median_s"] / max(results[kind]["ours"]["median_s"], 1e-3), 1)
    etcd_client._CHANNEL_OPTIONS[:] = _OURS
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
