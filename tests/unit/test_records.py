"""Every value under a run's etcd prefix parses into a typed record or an `EtcdRecordError` that
names the key and says what to do (`elastic/records.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from elastic.errors import EtcdRecordError
from elastic.keys import RunKeys
from elastic.records import NodeRecord, StoreRecord, parse_run
from elastic.round import RoundState

pytestmark = pytest.mark.timeout(10)

KEYS = RunKeys("/elastic-train/r1/")


@dataclass
class KV:
    key: bytes
    value: bytes
    lease: int = 0
    mod_revision: int = 1


def kv(key: str, value: object, lease: int = 0) -> KV:
    raw = value if isinstance(value, bytes) else (value if isinstance(value, str) else json.dumps(value)).encode()
    return KV(key.encode(), raw, lease)


def test_good_records_parse() -> None:
    state = RoundState(2, "closed", ("a",), acked=("a",), nnodes=(1, 2))
    records = parse_run(KEYS, [
        kv(KEYS.state, state.to_json()),
        kv(KEYS.node("a"), {"node_id": "a", "addr": "h", "pid": 7, "beacon": "h:123"}, lease=9),
        kv(KEYS.store(2), {"addr": "h", "port": 4000}, lease=9),
        kv(KEYS.prefix + "something/else", "any"),  # keys of other components are not ours to judge
    ])
    assert records.state == state and records.state_error is None and records.skipped == ()
    assert records.nodes["a"].beacon == "h:123" and records.nodes["a"].lease_id == 9
    assert isinstance(records.nodes["a"], NodeRecord)
    assert records.stores == {2: StoreRecord(generation=2, addr="h", port=4000)}


def test_malformed_state_is_reported_naming_the_key_not_raised() -> None:
    records = parse_run(KEYS, [kv(KEYS.state, {"hello": 1})])
    assert records.state is None and records.state_revision == 1
    err = records.state_error
    assert isinstance(err, EtcdRecordError) and err.key == KEYS.state
    assert KEYS.state in str(err) and f"etcdctl del {KEYS.state}" in str(err) and "--rdzv-id" in str(err)
    assert "unreachable" not in str(err)


@pytest.mark.parametrize(
    ("key", "value", "lease"),
    [
        (KEYS.node("x"), "junk", 5),
        (KEYS.node("x"), [1], 5),
        (KEYS.node("x"), {"node_id": "y"}, 5),
        (KEYS.node("x"), {"node_id": "x", "beacon": "nope"}, 5),
        (KEYS.node("x"), {"node_id": "x", "addr": 3}, 5),
        (KEYS.node("x"), {"node_id": "x"}, 0),  # no lease: no live agent wrote it
        (KEYS.stores + "abc", {"addr": "h", "port": 1}, 5),
        (KEYS.stores + "\u00b2", {"addr": "h", "port": 1}, 5),  # isdigit() is true of it; int() refused it
        (KEYS.node("x"), {"node_id": "x", "beacon": "h:\u0663"}, 5),  # an Arabic-Indic three
        (KEYS.store(3), "junk", 5),
        (KEYS.store(3), {"addr": "h", "port": "1"}, 5),
        (KEYS.store(3), {"addr": "h", "port": 70000}, 5),
    ],
)
def test_malformed_node_and_store_records_are_skipped_naming_the_key(key: str, value: object, lease: int) -> None:
    good = kv(KEYS.node("a"), {"node_id": "a"}, lease=4)
    records = parse_run(KEYS, [good, kv(key, value, lease)])
    assert list(records.nodes) == ["a"] and records.stores == {}
    (err,) = records.skipped
    assert err.key == key and key in str(err) and f"etcdctl del {key}" in str(err)
