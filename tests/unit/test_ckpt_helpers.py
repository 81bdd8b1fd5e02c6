"""Unit tests of the pure parts of ckpt: checksums, retention, restore policy, compatibility."""

from __future__ import annotations

import hashlib
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointMismatchError, check_compatible
from ckpt.checksum import PendingDigest, _split, digest_parts
from ckpt.restore import ranks_to_try
from ckpt.retention import awaiting_replication, select_deletions

pytestmark = pytest.mark.timeout(30)


def test_chunks_span_part_boundaries_exactly() -> None:
    parts = [memoryview(b"abc"), memoryview(b""), memoryview(b"defghij"), memoryview(b"k")]
    chunks = _split(parts, 4)
    assert [b"".join(bytes(p) for p in c) for c in chunks] == [b"abcd", b"efgh", b"ijk"]
    assert _split([memoryview(b"abcd")], 4) == [[memoryview(b"abcd")]]


@pytest.mark.parametrize("algorithm", ["sha256", "crc32"])
def test_chunked_digest_is_independent_of_parts_and_threads(algorithm: str) -> None:
    data = os.urandom(1000)
    one = digest_parts([memoryview(data)], algorithm=algorithm, chunk_bytes=64)
    split = [memoryview(data[:7]), memoryview(data[7:500]), memoryview(data[500:])]
    with ThreadPoolExecutor(3) as pool:
        parallel = digest_parts(split, algorithm=algorithm, chunk_bytes=64, pool=pool)
        pending = PendingDigest(split, algorithm=algorithm, chunk_bytes=64, pool=pool).result()
    assert one == parallel == pending
    chunk = hashlib.sha256 if algorithm == "sha256" else None
    top = hashlib.sha256()
    for i in range(0, 1000, 64):
        piece = data[i : i + 64]
        top.update(chunk(piece).digest() if chunk else zlib.crc32(piece).to_bytes(4, "big"))
    assert one.digest == top.hexdigest()
    flipped = bytearray(data)
    flipped[999] ^= 1
    assert digest_parts([memoryview(bytes(flipped))], algorithm=algorithm, chunk_bytes=64) != one


def test_whole_file_digest_is_plain_sha256() -> None:
    data = os.urandom(300)
    result = digest_parts(
        [memoryview(data[:100]), memoryview(data[100:])], algorithm="sha256", chunk_bytes=0
    )
    assert result.legacy and result.digest == hashlib.sha256(data).hexdigest()
    with pytest.raises(ValueError, match="md5"):
        digest_parts([memoryview(data)], algorithm="md5", chunk_bytes=64)


def test_retention_keeps_last_k_forever_steps_and_newer_uncommitted() -> None:
    doomed = select_deletions(
        committed=[10, 20, 30, 40, 50],
        present=[5, 10, 20, 25, 30, 40, 50, 55],
        keep_last=2,
        keep_every=20,
    )
    # 40, 50 newest; 20 and 40 forever; 55 uncommitted but newer (in progress)
    assert doomed == [5, 10, 25, 30]
    assert select_deletions(committed=[], present=[1, 2], keep_last=1) == []
    assert select_deletions(committed=[3, 2, 1], present=[1, 2, 3], keep_last=1, protected={1}) == [
        2
    ]


def test_local_copy_awaits_replication_until_committed_or_superseded() -> None:
    # The step uploading waits, unless a newer shared commit superseded it; queued ones are superseded by the
    # newest (kept by keep_last), so they do not.
    waiting = awaiting_replication([10, 20, 30, 40], shared_committed={20}, shared_keep_every=None, uploading=30)
    assert waiting == {30}
    assert awaiting_replication([10, 20, 30], shared_committed={20}, shared_keep_every=None, uploading=10) == set()
    assert awaiting_replication([1, 2], shared_committed=set(), shared_keep_every=None, uploading=None) == set()
    waiting = awaiting_replication([10, 20, 30], shared_committed={30}, shared_keep_every=10, uploading=None)
    assert waiting == {10, 20}  # forever steps wait for their own commit
    assert awaiting_replication([1, 2], shared_committed=set(), shared_keep_every=None, uploading=2) == {2}


def test_restore_rank_policy() -> None:
    assert ranks_to_try(rank=1, saved_world_size=2, has_own=True, replicated=True) == [1]
    assert ranks_to_try(rank=3, saved_world_size=2, has_own=False, replicated=True) == [0]
    assert ranks_to_try(rank=1, saved_world_size=2, has_own=False, replicated=True) == [0]
    assert ranks_to_try(rank=3, saved_world_size=2, has_own=False, replicated=False) == []
    # After a node loss the survivors' local copies beat the (older) shared tier: a rank whose own
    # part was on the lost node loads a part held on its own node, then rank 0's.
    assert ranks_to_try(rank=2, saved_world_size=6, has_own=False, replicated=True, on_this_node=[5, 4]) == [4, 5, 0]
    assert ranks_to_try(rank=1, saved_world_size=2, has_own=False, replicated=True, on_this_node=[0]) == [0]
    assert ranks_to_try(rank=1, saved_world_size=2, has_own=True, replicated=True, on_this_node=[0]) == [1]


def test_check_compatible_lists_every_offending_key() -> None:
    model = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1), "n": torch.zeros(1)}
    state = {
        "a": torch.zeros(3, 2),
        "b": torch.zeros(4, dtype=torch.float16),
        "x": torch.zeros(1),
        "n": torch.zeros(1),
    }
    with pytest.raises(CheckpointMismatchError) as info:
        check_compatible(state, model)
    err = info.value
    assert err.missing == ["c"] and err.unexpected == ["x"]
    assert [m.split(":")[0] for m in err.mismatched] == ["a", "b"]
    text = str(err)
    assert "missing in checkpoint: c" in text and "not in model: x" in text
    assert "a: checkpoint (3, 2) torch.float32, model (2, 3) torch.float32" in text
    assert "b: checkpoint (4,) torch.float16, model (4,) torch.float32" in text
    assert isinstance(err, ValueError)
    check_compatible({"a": torch.ones(2, 3)}, {"a": torch.zeros(2, 3)})  # fits: no error


def test_helper_persist_pool_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$ELASTIC_HELPER_PERSIST_THREADS sizes the node helper's tier-1 pool (a goodput probe); unset or not a
    positive number, it is the snapshot pool's size. The other settings' variables read alike (env_count)."""
    from ckpt.helper_process import env_count, persist_threads

    monkeypatch.delenv("ELASTIC_HELPER_PERSIST_THREADS", raising=False)
    assert persist_threads(6) == 6
    for bad in ("", "0", "-2", "two"):
        monkeypatch.setenv("ELASTIC_HELPER_PERSIST_THREADS", bad)
        assert persist_threads(6) == 6, bad
    monkeypatch.setenv("ELASTIC_HELPER_PERSIST_THREADS", "2")
    assert persist_threads(6) == 2
    monkeypatch.setenv("ELASTIC_HELPER_NICE", "19")
    assert env_count("ELASTIC_HELPER_NICE", 10, minimum=0) == 19
    monkeypatch.setenv("ELASTIC_HELPER_NICE", "0")
    assert env_count("ELASTIC_HELPER_NICE", 10, minimum=0) == 0


def test_the_helper_leaves_whole_cores_siblings_included_and_never_all_of_them() -> None:
    """$ELASTIC_HELPER_KEEP_CORES: the helper runs on the CPUs it may use less that many whole cores, the lowest
    numbered, each with its SMT siblings; a setting that would leave it nothing leaves its CPUs as they were."""
    from ckpt.helper_process import cpulist, cpus_without_cores

    def smt(cpu: int) -> set[int]:  # 8 cores of two threads, cpu N and N + 8 on one core
        return {cpu % 8, cpu % 8 + 8}

    assert cpus_without_cores(set(range(16)), 2, smt) == set(range(16)) - {0, 1, 8, 9}
    assert cpus_without_cores(set(range(16)), 2, lambda c: {c}) == set(range(2, 16))
    assert cpus_without_cores({3, 5, 11}, 1, smt) == {5}  # of the CPUs it may use: 3 and its sibling 11
    assert cpus_without_cores({0, 1}, 0, smt) == {0, 1}
    assert cpus_without_cores({0, 1}, 5, lambda c: {c}) == {0, 1}
    assert cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("setting", [None, "0", "3"])
def test_the_helpers_tier1_pool_runs_nicer_than_its_snapshot_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    """A tier-1 write has until the next persist, a snapshot's publish one step (step_done waits for it): the
    helper's tier-1 pool threads run PERSIST_NICE (or $ELASTIC_HELPER_PERSIST_NICE) nicer than the rest of it,
    the snapshot pool and the process itself unchanged."""
    import threading

    from ckpt.helper_process import PERSIST_NICE, Helper

    if setting is None:
        monkeypatch.delenv("ELASTIC_HELPER_PERSIST_NICE", raising=False)
    else:
        monkeypatch.setenv("ELASTIC_HELPER_PERSIST_NICE", setting)
    extra = PERSIST_NICE if setting is None else int(setting)

    def own() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = own()
    helper = Helper(tmp_path / "helper.sock", threads=2)
    try:
        assert helper.pool.submit(own).result(30) == base
        assert helper.persist_pool.submit(own).result(30) == min(19, base + extra)
        assert own() == base
    finally:
        helper.pool.shutdown()
        helper.persist_pool.shutdown()
