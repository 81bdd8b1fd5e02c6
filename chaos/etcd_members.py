"""The etcd under test: 1 or 3 members on fixed free ports and persistent data dirs, so that a member
can be killed and the whole cluster restarted on the same data.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from chaos.ledger import ProcessLedger
from elastic.etcd_server import EtcdServer, EtcdServerConfig, free_port


class EtcdMembers:
    """An etcd of 1 or 3 members on fixed free ports and persistent data dirs, so that a member can
    be killed and the whole cluster restarted on the same data."""

    def __init__(self, count: int, work_dir: Path, *, host: str = "127.0.0.1") -> None:
        ports = [(free_port(host), free_port(host)) for _ in range(count)]
        initial = ",".join(f"m{i}=http://{host}:{peer}" for i, (_, peer) in enumerate(ports)) if count > 1 else None
        self.host = host
        self.configs = [
            EtcdServerConfig(host=host, name=f"m{i}", data_dir=str(work_dir / f"m{i}"), client_port=client,
                             peer_port=peer, initial_cluster=initial)
            for i, (client, peer) in enumerate(ports)
        ]
        self.servers: list[EtcdServer | None] = [None] * count
        self.ledger: ProcessLedger | None = None

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.host}:{c.client_port}" for c in self.configs)

    @property
    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if s is not None]

    def start(self, members: list[int] | None = None) -> EtcdMembers:
        """Start members (all by default) together: one member alone has no quorum and never gets healthy."""
        members = list(range(len(self.configs))) if members is None else members
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                server = EtcdServer(self.configs[i]).start()
                self.servers[i] = server
                if self.ledger is not None and server.pid is not None:
                    self.ledger.record_tree(server.pid)
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]
        return self

    def kill(self, i: int) -> int | None:
        """SIGKILL member `i` (its guard and etcd). Returns the guard's pid."""
        server = self.servers[i]
        if server is None:
            return None
        pid = server.pid
        if self.ledger is not None and pid is not None:
            self.ledger.record_tree(pid)
        server.kill()
        self.servers[i] = None
        return pid

    def restart(self, down_s: float) -> list[int]:
        """Stop every live member, stay down `down_s` seconds, start them again on the same data."""
        members = self.live
        for i in members:
            server = self.servers[i]
            assert server is not None
            server.stop()
            self.servers[i] = None
        time.sleep(down_s)
        self.start(members)
        return members

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers if s is not None and s.pid is not None]

    def stop(self) -> None:
        for i, server in enumerate(self.servers):
            if server is not None:
                server.stop()
                self.servers[i] = None
