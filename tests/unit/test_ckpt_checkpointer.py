"""Unit tests of ckpt.Checkpointer against real files in tmp_path.

`save()` is `save_async().wait_persisted()`: a step is committed once every rank of its directory
(`local_world_size`) saved it. A saved but uncommitted step is made here by saving one rank of a
directory that has two."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt.persist
from ckpt import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CheckpointWriteError,
)

pytestmark = pytest.mark.timeout(30)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def make(
    root: Path, rank: int = 0, world_size: int = 1, keep_last: int = 3, local_world_size: int | None = None
) -> Checkpointer:
    return Checkpointer(
        CheckpointConfig(local_dir=root, keep_last=keep_last),
        rank=rank,
        world_size=world_size,
        local_world_size=world_size if local_world_size is None else local_world_size,
    )


def rank_state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b16": torch.randn(3, generator=g).bfloat16(),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(5.0)}},
            "param_groups": [{"betas": (0.9, 0.99)}],
        },
        "rng": {"torch": torch.get_rng_state(), "py": (3, (1, 2), None)},
        "data": {"epoch": 2, "position": 1024 + rank},
        "blob": bytes([rank, 255]),
        "loss": float("nan"),
    }


def test_two_ranks_committing_at_once_both_succeed_when_the_others_sweep_takes_our_scratch_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both ranks of a directory see the step complete and write the same COMMIT; the one that finishes first
    # sweeps the committed step's scratch entries (retention), which can remove the other's scratch COMMIT
    # before its rename (ENOENT: seen in bench/sharded_bench.py's smoke test). Not a failed save.
    import ckpt.persist as persist

    ranks = [make(tmp_path, rank=r, world_size=2) for r in range(2)]
    ranks[0].save(7, rank_state(0))
    real = persist.write_atomic

    def raced(path: Path, data: bytes) -> None:
        if path.name == "COMMIT":
            real(path, data)  # the other rank's identical marker lands first ...
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))  # ... ours is swept
        real(path, data)

    monkeypatch.setattr(persist, "write_atomic", raced)
    ranks[1].save(7, rank_state(1))  # raises CheckpointWriteError without the re-read
    assert ranks[1].latest() == 7 and ranks[0].latest() == 7

    def refused(path: Path, data: bytes) -> None:
        if path.name == "COMMIT":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))  # and no marker from anyone
        real(path, data)

    monkeypatch.setattr(persist, "write_atomic", refused)
    ranks[0].save(8, rank_state(0))
    with pytest.raises(CheckpointWriteError, match="COMMIT"):
        ranks[1].save(8, rank_state(1))


def saved_and_committed(root: Path, step: int = 10) -> tuple[Checkpointer, Path]:
    c = make(root)
    rank_dir = c.save(step, rank_state(0))
    return c, rank_dir


def test_two_rank_save_commit_load_is_bitwise_equal(tmp_path: Path) -> None:
    ranks = [make(tmp_path, rank=r, world_size=2) for r in range(2)]
    states = [rank_state(r) for r in range(2)]
    dirs = [ranks[0].save(120, states[0])]
    assert ranks[0].latest() is None  # saved but not yet committed: rank 1 has not saved
    dirs.append(ranks[1].save(120, states[1]))  # the last rank of the directory commits
    assert dirs == [tmp_path / "step_000000000120" / f"rank_0000{r}" for r in range(2)]

    commit = json.loads((tmp_path / "step_000000000120" / "COMMIT").read_text())
    run_uid = json.loads((tmp_path / "RUN.json").read_text())["run_uid"]
    manifests = {str(r): hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest() for r, d in enumerate(dirs)}
    assert commit == {
        "format_version": 1,
        "step": 120,
        "world_size": 2,
        "run": "default",
        "run_uid": run_uid,
        "manifests": manifests,
    }
    for r, c in enumerate(ranks):
        assert c.latest() == 120
        assert c.saved_world_size(120) == 2
        assert c.has_rank(120, r)
        loaded = c.load(120)
        expected = states[r]
        assert raw_bytes(loaded["model"]["w"]) == raw_bytes(expected["model"]["w"])
        assert loaded["model"]["b16"].dtype == torch.bfloat16
        assert raw_bytes(loaded["model"]["b16"]) == raw_bytes(expected["model"]["b16"])
        assert torch.equal(loaded["rng"]["torch"], expected["rng"]["torch"])
        assert loaded["rng"]["py"] == (3, (1, 2), None)
        assert loaded["optim"]["state"][0]["step"].item() == 5.0
        assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
        assert loaded["data"] == {"epoch": 2, "position": 1024 + r}
        assert loaded["blob"] == bytes([r, 255])
    other = ranks[0].load(120, rank=1)
    assert raw_bytes(other["model"]["w"]) == raw_bytes(states[1]["model"]["w"])


def test_latest_ignores_uncommitted_step_and_stale_temp_dirs(tmp_path: Path) -> None:
    c, _ = saved_and_committed(tmp_path, step=10)
    make(tmp_path, world_size=2).save(20, rank_state(0))  # rank 1 crashed before saving it
    stale = tmp_path / "step_000000000030" / ".tmp-rank_00000-deadbeef"
    stale.mkdir(parents=True)  # crash mid-write
    (stale / "state.safetensors").write_bytes(b"partial")
    assert c.committed_steps() == [10]
    assert c.latest() == 10
    assert not c.has_rank(20, 0)
    with pytest.raises(CheckpointNotFoundError, match="step 20 is not committed"):
        c.load(20)


def test_retention_keeps_last_k_and_removes_older_uncommitted(tmp_path: Path) -> None:
    c = make(tmp_path, keep_last=2)
    partial = make(tmp_path, world_size=2, keep_last=2)  # its rank 1 never saves: never commits
    for step in (1, 2, 3):
        c.save(step, {"x": torch.tensor(step)})
    partial.save(4, {"x": torch.tensor(4)})  # uncommitted, older than the next commit
    stale = tmp_path / "step_000000000005" / ".tmp-rank_00001-abc"
    stale.mkdir(parents=True)
    partial.save(6, {"x": torch.tensor(6)})  # uncommitted, newer: may still be in progress
    c.save(5, {"x": torch.tensor(5)})  # committed: retention runs

    assert c.committed_steps() == [5, 3]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        ".LOCK.guard",
        "LOCK",
        "RUN.json",
        "step_000000000003",
        "step_000000000005",
        "step_000000000006",
    ]
    assert not stale.exists()
    assert c.load(3)["x"].item() == 3


def test_resave_after_crashed_attempt_replaces_leftover_rank_dir(tmp_path: Path) -> None:
    c = make(tmp_path)
    rank_dir = c.save(7, {"x": torch.tensor(1)})
    (rank_dir / "junk").write_bytes(b"from the crashed attempt")
    c.save(7, {"x": torch.tensor(2)})
    assert not (rank_dir / "junk").exists()
    assert c.load(7)["x"].item() == 2


def test_resaving_committed_step_uncommits_then_replaces_it(tmp_path: Path) -> None:
    # A group that resumed from an older step (another node lacked this one) saves it again,
    # here with a smaller world.
    for rank in range(4):
        make(tmp_path, rank=rank, world_size=4).save(10, {"x": torch.tensor(rank)})
    assert make(tmp_path, rank=0, world_size=4).latest() == 10
    small = [make(tmp_path, rank=r, world_size=2) for r in range(2)]

    small[0].save(10, {"x": torch.tensor(100)})
    assert small[0].latest() is None  # invisible until committed again, never a mix
    small[1].save(10, {"x": torch.tensor(101)})  # commits, and drops ranks 2 and 3 of world 4

    assert small[0].saved_world_size(10) == 2
    assert [small[r].load(10)["x"].item() for r in range(2)] == [100, 101]
    assert sorted(p.name for p in (tmp_path / "step_000000000010").iterdir()) == [
        "COMMIT",
        "rank_00000",
        "rank_00001",
    ]
    assert not small[0].has_rank(10, 3)


def test_truncated_state_file_is_corrupt(tmp_path: Path) -> None:
    c, rank_dir = saved_and_committed(tmp_path)
    state = rank_dir / "state.safetensors"
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(CheckpointCorruptError, match="state.safetensors.*truncated") as info:
        c.load(10)
    assert info.value.path == state


def test_bit_flip_is_caught_by_checksum(tmp_path: Path) -> None:
    c, rank_dir = saved_and_committed(tmp_path)
    state = rank_dir / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-5] ^= 0x01
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="state.safetensors.*sha256"):
        c.load(10)


def test_missing_state_file_is_corrupt(tmp_path: Path) -> None:
    c, rank_dir = saved_and_committed(tmp_path)
    (rank_dir / "state.safetensors").unlink()
    with pytest.raises(CheckpointCorruptError, match="state.safetensors.*missing"):
        c.load(10)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_damaged_manifest_is_corrupt(tmp_path: Path, damage: str) -> None:
    c, rank_dir = saved_and_committed(tmp_path)
    manifest = rank_dir / "manifest.json"
    if damage == "truncate":
        manifest.write_bytes(manifest.read_bytes()[:40])
    elif damage == "garbage":
        manifest.write_bytes(b"\xff\xfe\x00garbage")
    else:
        manifest.unlink()
    with pytest.raises(CheckpointCorruptError, match="manifest.json") as info:
        c.load(10)
    assert info.value.path == manifest
    assert "restore an earlier step" in str(info.value)


def edit_manifest(rank_dir: Path, **changes: Any) -> None:
    """Craft the manifest. The COMMIT's sha256 of it would catch any edit first, so the COMMIT
    becomes one of an older version (no digests, still loaded) and the manifest's own checks
    must catch the edit."""
    path = rank_dir / "manifest.json"
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))
    commit = rank_dir.parent / "COMMIT"
    marker = json.loads(commit.read_text())
    del marker["manifests"]
    commit.write_text(json.dumps(marker))


@pytest.mark.parametrize("entry", ["../x", "/etc/hostname"])
def test_manifest_entry_escaping_rank_dir_is_rejected(tmp_path: Path, entry: str) -> None:
    c, rank_dir = saved_and_committed(tmp_path)
    files = json.loads((rank_dir / "manifest.json").read_text())["files"]
    edit_manifest(rank_dir, files={entry: files["state.safetensors"]}, tensors={})
    (tmp_path / "x").write_bytes(b"outside")
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*file entry"):
        c.load(10)


def test_garbage_header_with_matching_checksum_is_corrupt(tmp_path: Path) -> None:
    import hashlib

    c, rank_dir = saved_and_committed(tmp_path)
    state = rank_dir / "state.safetensors"
    garbage = struct.pack("<Q", 2**63 - 1) + b"\0" * 1000
    state.write_bytes(garbage)
    manifest = json.loads((rank_dir / "manifest.json").read_text())
    entry = {"sha256": hashlib.sha256(garbage).hexdigest(), "bytes": len(garbage)}
    edit_manifest(rank_dir, files={**manifest["files"], "state.safetensors": entry})
    with pytest.raises(CheckpointCorruptError, match="state.safetensors.*header length"):
        c.load(10)


def test_newer_format_version_raises_version_error(tmp_path: Path) -> None:
    c, rank_dir = saved_and_committed(tmp_path)
    edit_manifest(rank_dir, format_version=99)
    with pytest.raises(CheckpointVersionError, match="manifest.json.*upgrade"):
        c.load(10)


def test_commit_with_newer_format_version_is_listed_but_not_loaded(tmp_path: Path) -> None:
    c, _ = saved_and_committed(tmp_path, step=10)
    commit = tmp_path / "step_000000000010" / "COMMIT"
    commit.write_text(json.dumps({"format_version": 2, "step": 10, "world_size": 1}))
    assert c.latest() == 10
    with pytest.raises(CheckpointVersionError, match="COMMIT.*upgrade"):
        c.load(10)


def test_damaged_commit_marker_is_ignored(tmp_path: Path) -> None:
    c, _ = saved_and_committed(tmp_path, step=10)
    c.save(20, rank_state(0))
    (tmp_path / "step_000000000020" / "COMMIT").write_bytes(b'{"format_vers')
    assert c.committed_steps() == [10]
    with pytest.raises(CheckpointCorruptError, match="COMMIT"):
        c.saved_world_size(20)


def test_load_of_rank_not_on_this_node_raises_not_found(tmp_path: Path) -> None:
    node_a = make(tmp_path, rank=0, world_size=2, local_world_size=1)  # rank 1: another node's dir
    node_a.save(10, rank_state(0))
    assert node_a.has_rank(10, 0) and not node_a.has_rank(10, 1)
    with pytest.raises(CheckpointNotFoundError, match="rank 1 of step 10"):
        node_a.load(10, rank=1)
    with pytest.raises(CheckpointNotFoundError, match="rank 5 of step 10"):
        node_a.load(10, rank=5)


def test_after_a_node_loss_the_survivors_restore_their_newest_local_step(tmp_path: Path) -> None:
    # World 4 on two nodes (ranks 0-1 on node a, 2-3 on node b). Node a is lost; node b's two
    # ranks become ranks 0 and 1 of a world of 2. Neither has its own part on node b, so each loads
    # a part node b holds (replicated state) instead of falling back to an older or remote copy.
    node_b = tmp_path / "node-b"
    for step in (5, 10):
        savers = [make(node_b, rank=r, world_size=4, local_world_size=2) for r in (2, 3)]
        for c in savers:
            c.save(step, rank_state(c.rank) | {"step": step})
    for new_rank in range(2):
        restored = make(node_b, rank=new_rank, world_size=2).restore()
        assert restored is not None
        assert (restored.step, restored.rank, restored.own, restored.tier) == (10, 2, False, "local")
        assert raw_bytes(restored.state["model"]["w"]) == raw_bytes(rank_state(2)["model"]["w"])


def test_commit_without_any_save_raises_not_found(tmp_path: Path) -> None:
    c = make(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="nothing was saved for step 3"):
        c.commit(3)
    assert c.latest() is None


def test_commit_checks_that_save_committed_the_step(tmp_path: Path) -> None:
    # commit() stays for callers of the former synchronous API; save() commits by itself.
    make(tmp_path).save(1, {"x": torch.tensor(1)})
    make(tmp_path).commit(1)
    half = make(tmp_path, world_size=2)
    half.save(2, {"x": torch.tensor(2)})
    with pytest.raises(CheckpointNotFoundError, match="step 2 is not committed.*not all 2 ranks"):
        half.commit(2)


def test_local_dir_that_is_a_file_raises_write_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    with pytest.raises(CheckpointWriteError, match=f"{not_a_dir} is a regular file.*move it away") as info:
        make(not_a_dir)  # at start, not at the first save
    assert "disk space" not in str(info.value)
    assert not_a_dir.read_bytes() == b""


def test_disk_full_during_save_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, _ = saved_and_committed(tmp_path, step=10)

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt.persist, "write_new_file", full_disk)
    with pytest.raises(CheckpointWriteError, match="step 20.*No space left on device") as info:
        c.save(20, rank_state(0))
    assert isinstance(info.value.__cause__, OSError)
    step_dir = tmp_path / "step_000000000020"
    assert list(step_dir.iterdir()) == []  # temp dir (with its state file) removed
    assert c.committed_steps() == [10]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_local_dir_raises_write_error(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(CheckpointWriteError, match="Permission denied"):
            make(root).save(1, rank_state(0))
    finally:
        root.chmod(0o700)
    assert list(root.iterdir()) == []


def test_unsupported_state_fails_before_touching_disk(tmp_path: Path) -> None:
    c = make(tmp_path)
    with pytest.raises(TypeError, match="'model/act'"):
        c.save(1, {"model": {"act": torch.nn.ReLU()}})
    with pytest.raises(TypeError, match="'w'.*complex128"):
        c.save(1, {"w": torch.zeros(1, dtype=torch.complex128)})
    # Session 50's audit: a RecursionError with no key path, torch's "Internal error ... file an issue", and a
    # quantized tensor said to be not dense.
    loop: dict[str, Any] = {"w": torch.ones(1)}
    loop["again"] = {"up": loop}
    with pytest.raises(TypeError, match="contains itself: the container at key path 'again/up'"):
        c.save(1, loop)
    with pytest.raises(TypeError, match="'n' is a nested tensor"):
        c.save(1, {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])})
    with pytest.raises(TypeError, match="'q' is a quantized tensor .*scale and zero point"):
        c.save(1, {"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)})
    assert not tmp_path.joinpath("step_000000000001").exists()
    c.save(1, {"w": torch.ones(1)})  # still usable
    c.close()


def test_config_and_constructor_validation(tmp_path: Path) -> None:
    config = CheckpointConfig(local_dir=tmp_path)
    assert config.local_dir == str(tmp_path) and isinstance(config.local_dir, str)
    assert config.keep_last == 3
    with pytest.raises(ValueError, match="keep_last.*0"):
        CheckpointConfig(local_dir=tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="local_dir"):
        CheckpointConfig(local_dir="")
    with pytest.raises(ValueError, match="rank 2 must be below world_size 2"):
        Checkpointer(config, rank=2, world_size=2)
    with pytest.raises(ValueError, match="step"):
        make(tmp_path).save(-1, {})
    # Session 50's audit: a URL was written to ./s3:/... on the local disk; a step past int64 "saved" and was never
    # committed; restore(step="5") or a negative step returned None, a caller's "no checkpoint: start over".
    with pytest.raises(ValueError, match="local_dir must be a node-local directory.*shared=SharedConfig"):
        CheckpointConfig(local_dir="s3://bucket/run")
    c = make(tmp_path / "v")
    with pytest.raises(ValueError, match="step must be an int from 0 to 9223372036854775807, got 9223372036854775808"):
        c.save(2**63, {"w": torch.ones(1)})
    c.save(5, {"w": torch.ones(1)})
    for bad in ({"step": "5"}, {"step": -1}, {"max_step": -3}, {"max_step": 5.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int"):
            c.restore(**bad)  # type: ignore[arg-type]
    restored = c.restore(step=5)
    assert restored is not None and restored.step == 5
    c.close()


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore over a mapping that faults nothing in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        anchor = ctypes.c_char.from_buffer(mapping)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        del anchor
        return sum(v & 1 for v in vector)
    finally:
        mapping.close()


def test_a_persisted_file_leaves_the_page_cache(tmp_path: Path) -> None:
    # A checkpoint is read again only after a failure: its pages are dropped once fsynced (ckpt/persist.py
    # drop_cached), so persisting gigabytes does not evict what the job reads.
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 20))
    fd = os.open(probe, os.O_RDWR)
    try:
        os.fsync(fd)
        cached_before = resident_pages(probe)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_before == 0 or resident_pages(probe) > 0:
        pytest.skip("this file system does not drop clean pages on advice (tmpfs)")
    state = {**rank_state(0), "big": torch.randn(1 << 20)}  # 4 MiB
    rank_dir = make(tmp_path / "ckpt").save(10, state)
    data = rank_dir / "state.safetensors"
    assert data.stat().st_size > 4 << 20
    assert resident_pages(data) == 0
    loaded = make(tmp_path / "ckpt").load(10)
    assert torch.equal(loaded["big"], state["big"])  # read back from the disk, verified
