"""A simulated network, for `partition-node`: each node in its own network namespace on one bridge.

    bridge ecb<tag>  10.A.B.1/24    etcd listens here; the root namespace reaches every node
      veth ecv<tag><k> ── ecp<tag><k> in namespace ecn<tag>-<k>: 10.A.B.(10+k)/24, lo up

A node's agent runs under `ip netns exec` with `--local-addr` set to its address and gloo bound to
its interface, so all of its traffic (etcd, the round's store, collectives) crosses its veth.
Cutting the node off is `ip link set ecv<tag><k> down`: packets vanish without a reset, as in a real
partition. Needs root and a working `ip netns`; everything is named with the `ec` prefix and
removed by `down()`.
"""

from __future__ import annotations

import random
import subprocess
import uuid
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise OSError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class NodeNet:
    namespace: str
    address: str
    interface: str
    """The node's side of its veth, inside its namespace (for GLOO_SOCKET_IFNAME)."""
    host_link: str
    """The bridge's side of its veth: down means cut off."""


class NetnsNetwork:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:4]
        self.bridge = f"ecb{self.tag}"
        self.subnet = self._free_subnet()
        self.host_ip = f"{self.subnet}.1"
        self.nodes: list[NodeNet] = []
        self._up = False

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
        rng = random.Random()
        for _ in range(100):
            subnet = f"10.{rng.randrange(200, 250)}.{rng.randrange(0, 256)}"
            if f"{subnet}." not in used:
                return subnet
        raise OSError("no free 10.x.y.0/24 subnet for the simulated network")

    def up(self) -> NetnsNetwork:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add_node(self) -> NodeNet:
        k = len(self.nodes)
        net = NodeNet(namespace=f"ecn{self.tag}-{k}", address=f"{self.subnet}.{10 + k}",
                      interface=f"ecp{self.tag}{k}", host_link=f"ecv{self.tag}{k}")
        self.nodes.append(net)
        _ip("netns", "add", net.namespace)
        _ip("link", "add", net.host_link, "type", "veth", "peer", "name", net.interface)
        _ip("link", "set", net.interface, "netns", net.namespace)
        _ip("link", "set", net.host_link, "master", self.bridge, "up")
        _ip("-n", net.namespace, "addr", "add", f"{net.address}/24", "dev", net.interface)
        _ip("-n", net.namespace, "link", "set", net.interface, "up")
        _ip("-n", net.namespace, "link", "set", "lo", "up")
        return net

    @staticmethod
    def wrap(net: NodeNet, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", net.namespace, *argv]

    def cut(self, net: NodeNet) -> None:
        _ip("link", "set", net.host_link, "down")

    def down(self) -> None:
        for net in self.nodes:
            # Deleting one end of a veth deletes both; the namespace itself can outlive its name while
            # sockets cut off by a partition time out in the kernel, and would keep the veth alive.
            _ip("link", "del", net.host_link, check=False)
            _ip("netns", "del", net.namespace, check=False)
        self.nodes.clear()
        if self._up:
            _ip("link", "del", self.bridge, check=False)
            self._up = False
