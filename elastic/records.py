"""The typed records the values under a run's etcd keys (`elastic/keys.py`) parse into, in one place.

Anyone who can write to the etcd can put junk there. Every value is parsed here, and a malformed
one becomes an `EtcdRecordError` naming the key and saying what to do; it is never taken for an
unreachable etcd. The callers decide what a bad value means: a bad node or store record is skipped
with a warning (a stranger's junk must not take a job down); a bad round state fails the next
rendezvous (see `RunView`), because guessing the state of a running job could split it in two.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from core.numbers import decimal
from elastic.errors import EtcdRecordError
from elastic.keys import RunKeys
from elastic.round import RoundState


@dataclass(frozen=True)
class NodeRecord:
    """A registered agent, as its membership record says."""

    node_id: str
    lease_id: int
    """The etcd lease the record lives under (always set: a record without one is malformed)."""
    addr: str | None = None
    """Address its TCPStore would listen on (`--local-addr`), if it says."""
    beacon: str | None = None
    """`host:port` of its liveness beacon, if it has one."""
    doc: Mapping[str, object] = field(default_factory=dict)
    """The whole record as written (more fields than the ones above may be there)."""
    value: bytes = b""
    """The exact bytes stored, e.g. for checking a signature over them."""


@dataclass(frozen=True)
class StoreRecord:
    """Where rank 0 of round `generation` hosts the round's TCPStore."""

    generation: int
    addr: str
    port: int


@dataclass(frozen=True)
class RunRecords:
    """Everything under a run's prefix, parsed; malformed values are reported, not raised."""

    state: RoundState | None
    state_revision: int
    """mod_revision of the state key; 0 if it does not exist (the compare-and-set guard)."""
    state_error: EtcdRecordError | None
    """Set when the state key exists but is malformed (then `state` is None)."""
    nodes: dict[str, NodeRecord]
    stores: dict[int, StoreRecord]
    skipped: tuple[EtcdRecordError, ...]
    """Malformed node and store records, left out of `nodes` and `stores`."""


class KeyValue(Protocol):
    """What etcd3's KV metadata gives (a range response's `kvs` items); read-only."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> bytes: ...
    @property
    def lease(self) -> int: ...
    @property
    def mod_revision(self) -> int: ...


def parse_run(keys: RunKeys, kvs: Iterable[KeyValue]) -> RunRecords:
    """Parse a range read of `keys.prefix`. Keys this module does not know are ignored."""
    state, state_rev, state_error = None, 0, None
    nodes: dict[str, NodeRecord] = {}
    stores: dict[int, StoreRecord] = {}
    skipped: list[EtcdRecordError] = []
    for kv in kvs:
        key = kv.key.decode(errors="replace")
        try:
            if key == keys.state:
                state_rev = kv.mod_revision
                state = parse_state(key, kv.value, kv.mod_revision)
            elif key.startswith(keys.nodes):
                node = parse_node(key, key[len(keys.nodes):], kv.value, kv.lease, kv.mod_revision)
                nodes[node.node_id] = node
            elif key.startswith(keys.stores):
                store = parse_store(key, key[len(keys.stores):], kv.value, kv.mod_revision)
                stores[store.generation] = store
        except EtcdRecordError as exc:
            if key == keys.state:
                state_error = exc
            else:
                skipped.append(exc)
    return RunRecords(state, state_rev, state_error, nodes, stores, tuple(skipped))


def parse_state(key: str, value: bytes, mod_revision: int = 0) -> RoundState:
    try:
        return RoundState.from_json(value)
    except ValueError as exc:
        raise EtcdRecordError(
            key, f"not a round state ({exc}; value {_excerpt(value)})",
            advice=f"Stop every agent of this run, then delete it with `etcdctl del {key}`; or start the job "
                   "under another --rdzv-id",
            mod_revision=mod_revision,
        ) from None


def parse_node(key: str, node_id: str, value: bytes, lease_id: int, mod_revision: int = 0) -> NodeRecord:
    doc = _object(key, value, "a membership record", mod_revision)
    problem = None
    if not node_id or "/" in node_id:
        problem = "not a node id"
    elif doc.get("node_id") != node_id:
        problem = f"its node_id {doc.get('node_id')!r} is not the key's {node_id!r}"
    elif doc.get("addr") is not None and (not isinstance(doc["addr"], str) or not doc["addr"]):
        problem = f"addr must be a host name, got {doc['addr']!r}"
    elif doc.get("beacon") is not None and not _is_host_port(doc["beacon"]):
        problem = f"beacon must be host:port, got {doc['beacon']!r}"
    elif not lease_id:
        problem = "it is not held under a lease, so no live agent wrote it"
    if problem is not None:
        raise EtcdRecordError(key, f"not a membership record: {problem}", mod_revision=mod_revision)
    addr, beacon = doc.get("addr"), doc.get("beacon")
    return NodeRecord(node_id=node_id, lease_id=int(lease_id), addr=str(addr) if addr is not None else None,
                      beacon=str(beacon) if beacon is not None else None, doc=doc, value=bytes(value))


def parse_store(key: str, suffix: str, value: bytes, mod_revision: int = 0) -> StoreRecord:
    generation = decimal(suffix)
    if generation is None:
        raise EtcdRecordError(key, "not a round store key: the part after rdzv/store/ must be a round number",
                              mod_revision=mod_revision)
    doc = _object(key, value, "a round store address", mod_revision)
    addr, port = doc.get("addr"), doc.get("port")
    if not isinstance(addr, str) or not addr or type(port) is not int or not 0 < port < 65536:
        raise EtcdRecordError(key, f"not a round store address: expected {{\"addr\": host, \"port\": 1..65535}}, "
                                   f"got {_excerpt(value)}", mod_revision=mod_revision)
    return StoreRecord(generation=generation, addr=addr, port=port)


def _object(key: str, value: bytes, what: str, mod_revision: int) -> dict[str, object]:
    try:
        doc = json.loads(value)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise EtcdRecordError(
            key, f"not {what}: expected a JSON object, got {_excerpt(value)}", mod_revision=mod_revision
        )
    return doc


def _is_host_port(value: object) -> bool:
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    number = decimal(port)
    return bool(sep and host and number is not None and 0 < number < 65536)


def _excerpt(value: bytes, limit: int = 80) -> str:
    text = value.decode(errors="replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")
