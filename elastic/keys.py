"""The etcd key layout of a run, in one place (as `ckpt/layout.py` is for the checkpoint directory).

    /<prefix>/<run id>/                  one run; runs with different ids never share a key
        rdzv/state                       the round state (`round.RoundState`), written by compare-and-set
        rdzv/store/<generation>          {"addr", "port"} of that round's TCPStore, under rank 0's lease
        nodes/<node id>                  a live agent's membership record, under its lease
        admission/run                    the join-token fingerprint of a run with a token (`admission.py`)
        admission/state                  the MAC of the round state, written with every state write

Every other module asks `RunKeys` for a key; none builds a key string itself.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "elastic-train"
"""Top-level prefix shared by all runs (`--rdzv-conf prefix=`)."""

STORES_KEPT = 8
"""How many older rounds' store keys a new round's rank 0 deletes (older ones are gone already)."""


def run_prefix(prefix: str, run_id: str) -> str:
    """The etcd key prefix of one run. Different run ids never share keys."""
    return f"/{prefix.strip('/')}/{run_id}/"


@dataclass(frozen=True)
class RunKeys:
    """Key names under one run's prefix (`run_prefix(prefix, run_id)`)."""

    prefix: str

    @staticmethod
    def of(run_id: str, prefix: str = DEFAULT_PREFIX) -> RunKeys:
        return RunKeys(run_prefix(prefix, run_id))

    @property
    def state(self) -> str:
        return self.prefix + "rdzv/state"

    @property
    def stores(self) -> str:
        """The prefix of every round's store key."""
        return self.prefix + "rdzv/store/"

    @property
    def nodes(self) -> str:
        """The prefix of every membership record."""
        return self.prefix + "nodes/"

    @property
    def admission_run(self) -> str:
        return self.prefix + "admission/run"

    @property
    def admission_state(self) -> str:
        return self.prefix + "admission/state"

    def store(self, generation: int) -> str:
        return f"{self.stores}{generation}"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def node_id(self, key: str) -> str | None:
        """The node id of a membership key, or None if `key` is not one."""
        return key[len(self.nodes):] if key.startswith(self.nodes) else None

    def stale_stores(self, generation: int) -> list[str]:
        """Store keys of the rounds before `generation` that its rank 0 prunes."""
        return [self.store(g) for g in range(max(1, generation - STORES_KEPT), generation)]
