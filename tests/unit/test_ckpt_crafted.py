"""Crafted checkpoints must not hang a restore (issue G item 4): every count is bounded by what
is on disk, only regular files are opened, every read has a deadline. Each test has a short
timeout, so a hang fails it. A crafted value (a key, a size, a shape) is refused naming its file and
the step before is restored: never a bare ValueError or TypeError, never an allocation it sized."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer, CheckpointError, CheckpointTimeoutError, SharedConfig
from ckpt.identity import LockRecord
from ckpt.safe_io import read_regular, with_deadline

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")
WAIT = timedelta(seconds=20)


def finishes(fn: Callable[[], T], path: Path, within: float = 15.0) -> T:
    """`fn()` run on a thread: a hang fails the test (a blocked open() of a FIFO is not always
    interrupted by pytest-timeout's signal), and the FIFO's reader is released afterwards."""
    done: list[T] = []
    thread = threading.Thread(target=lambda: done.append(fn()), daemon=True)
    thread.start()
    thread.join(within)
    if thread.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # unblocks the reader: EOF
        pytest.fail(f"a read of the FIFO {path} blocked for {within}s")
    return done[0]


def make(root: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(CheckpointConfig(local_dir=root, **kw), rank=0, world_size=1)


def two_steps(root: Path) -> None:
    with make(root) as c:
        for step in (1, 2):
            c.save_async(step, {"w": torch.full((8,), float(step))}).wait_persisted(WAIT)


def test_commit_with_a_huge_world_size_does_not_loop(tmp_path: Path) -> None:
    two_steps(tmp_path)
    commit_path = tmp_path / "step_000000000002" / "COMMIT"
    commit = json.loads(commit_path.read_text())
    commit["world_size"] = 10**12
    commit_path.write_text(json.dumps(commit))
    with make(tmp_path) as c:
        restored = c.restore()
        assert restored is not None and restored.step == 2  # rank 0's part is intact
        other = Checkpointer(CheckpointConfig(local_dir=tmp_path), rank=3, world_size=4)
        restored = other.restore()  # rank 3 of the new world loads rank 0's replicated part
        assert restored is not None and (restored.step, restored.rank) == (2, 0)
        other.close()


@pytest.mark.parametrize("victim", ["rank_00000/state.safetensors", "rank_00000/manifest.json", "COMMIT"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_unopened(
    tmp_path: Path, victim: str, caplog: pytest.LogCaptureFixture
) -> None:
    two_steps(tmp_path)
    path = tmp_path / "step_000000000002" / victim
    path.unlink()
    os.mkfifo(path)  # nobody writes it: open() for reading would block for ever
    with caplog.at_level(logging.WARNING, logger="ckpt"), make(tmp_path) as c:
        restored = finishes(c.restore, path)
        assert restored is not None and restored.step == 1
    assert any(str(path) in r.getMessage() and "FIFO" in r.getMessage() for r in caplog.records)


def test_a_fifo_in_a_mounted_shared_tier_is_refused_unopened(tmp_path: Path) -> None:
    shared = SharedConfig(url=str(tmp_path / "shared"), run_name="run")
    with make(tmp_path / "node", shared=shared) as c:
        for step in (1, 2):
            c.save_async(step, {"w": torch.full((8,), float(step))})
            c.wait_uploaded(WAIT)
    path = tmp_path / "shared" / "run" / "step_000000000002" / "COMMIT"
    path.unlink()
    os.mkfifo(path)
    with make(tmp_path / "fresh", shared=shared) as c:
        assert finishes(c.available_steps, path) == [1]


def test_a_device_in_place_of_a_data_file_is_refused(tmp_path: Path) -> None:
    two_steps(tmp_path)
    path = tmp_path / "step_000000000002" / "rank_00000" / "state.safetensors"
    path.unlink()
    path.symlink_to("/dev/zero")  # inside the rank dir by name; stat shows the device
    with make(tmp_path) as c:
        restored = c.restore()
        assert restored is not None and restored.step == 1


def test_a_read_that_hangs_passes_its_deadline(tmp_path: Path) -> None:
    release = threading.Event()
    with pytest.raises(CheckpointTimeoutError, match=f"read of {tmp_path / 'x'} did not finish"):
        with_deadline(lambda: release.wait(20), timeout=0.2, what="read", path=tmp_path / "x")
    release.set()
    record = tmp_path / "big"
    record.write_bytes(b"x" * 2000)
    with pytest.raises(Exception, match="more than the 1000 a record may be"):
        read_regular(record, timeout=5, max_bytes=1000)


# -- crafted values: refused by name, the step before restored -------------------------------------------------

STEP2 = "step_000000000002"


def _edit_json(path: Path, fn: Callable[[dict[str, Any]], object]) -> bytes:
    obj = json.loads(path.read_text())
    fn(obj)
    raw = json.dumps(obj).encode()
    path.write_bytes(raw)
    return raw


def _manifest(fn: Callable[[dict[str, Any]], object], text: Callable[[str], str] = str) -> Callable[[Path], Path]:
    """A craft of step 2's manifest (its JSON, then its text), its COMMIT's digest of it made to match."""

    def craft(root: Path) -> Path:
        path = root / STEP2 / "rank_00000" / "manifest.json"
        _edit_json(path, fn)
        path.write_text(text(path.read_text()))
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        _edit_json(root / STEP2 / "COMMIT", lambda c: c.update(manifests={"0": digest}))
        return path

    return craft


def _commit_key(key: str) -> Callable[[Path], Path]:
    def craft(root: Path) -> Path:
        path = root / STEP2 / "COMMIT"
        _edit_json(path, lambda c: c.update(manifests={key: c["manifests"]["0"]}))
        return path

    return craft


def _header(entry: dict[str, Any], tail: bytes) -> Callable[[Path], Path]:
    """Step 2's data file replaced by a safetensors file with one crafted entry, its manifest made to match."""

    def craft(root: Path) -> Path:
        header = json.dumps({"w": entry}).encode()
        data = struct.pack("<Q", len(header)) + header + tail
        path = root / STEP2 / "rank_00000" / "state.safetensors"
        path.write_bytes(data)
        _manifest(lambda m: m["files"].update({"state.safetensors": {
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}) or m.update(format_version=1))(root)
        return path

    return craft


def _chunk_bytes(value: int) -> Callable[[dict[str, Any]], object]:
    return lambda m: m["files"]["state.safetensors"]["checksum"].update(chunk_bytes=value)


CRAFTS: dict[str, Callable[[Path], Path]] = {
    # str.isdigit() is true of these; int() then raised a ValueError and nothing fell back
    "COMMIT key superscript two": _commit_key("\u00b2"),
    "COMMIT key of 5000 digits": _commit_key("1" * 5000),
    "tensor file a list": _manifest(lambda m: m["tensors"]["w"].update(file=["state.safetensors"])),
    "chunk_bytes 1": _manifest(_chunk_bytes(1)),  # ~280 bytes of memory per byte of the file to verify
    "chunk_bytes 1 TiB": _manifest(_chunk_bytes(1 << 40)),  # a scratch buffer that size
    "a state value 1e999": _manifest(lambda m: m["state"].update(lr=0.125),
                                     lambda t: t.replace("0.125", "1e999")),  # was restored as inf
    "header dtype a list": _header({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, b"\0" * 4),
    "header dimension 2**70 beside a 0": _header({"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]}, b""),
}


@pytest.mark.parametrize("craft", CRAFTS.values(), ids=CRAFTS.keys())
def test_a_crafted_value_is_refused_naming_its_file_and_the_step_before_is_restored(
    tmp_path: Path, craft: Callable[[Path], Path], caplog: pytest.LogCaptureFixture
) -> None:
    two_steps(tmp_path)
    path = craft(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ckpt"), make(tmp_path) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["w"], torch.full((8,), 1.0))
    assert any(str(path) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def _as_sharded(root: Path, fn: Callable[[dict[str, Any]], object] = lambda m: None,
                world_size: int = 1) -> Path:
    """Step 2 (tensors "w" and "b") rewritten as a sharded step (format 3): "w" a piece of a sharded tensor, "b"
    a plain one, both read by range. Digests consistent, so only the values themselves can be refused."""
    rank_dir = root / STEP2 / "rank_00000"
    data = (rank_dir / "state.safetensors").read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    chunk = hashlib.sha256(data).digest()  # one chunk of 64 KiB

    def sharded(m: dict[str, Any]) -> None:
        m["format_version"] = 3
        m["files"]["state.safetensors"] = {"bytes": len(data), "checksum": {
            "algorithm": "sha256", "chunk_bytes": 1 << 16, "digest": hashlib.sha256(chunk).hexdigest(),
            "chunks": base64.b64encode(chunk).decode()}}
        for name, entry in m["tensors"].items():
            entry["offset"] = 8 + header_len + header[name]["data_offsets"][0]
        m["shards"] = {"w": {"global_shape": [4, 3], "dtype": "F32", "placements": ["Shard(dim=0)"],
                             "mesh_shape": [1], "mesh_dims": [], "piece": {"offsets": [0, 0], "sizes": [4, 3]}}}
        fn(m)

    path = _manifest(sharded)(root)
    _edit_json(root / STEP2 / "COMMIT", lambda c: c.update(world_size=world_size))
    return path


def _unpieced_huge(m: dict[str, Any]) -> None:
    m["shards"]["w"] = {"global_shape": [2**40], "dtype": "F32"}
    del m["tensors"]["w"]


SHARDED_CRAFTS: dict[str, Callable[[Path], object]] = {
    "plain tensor without offset": lambda root: _as_sharded(root, lambda m: m["tensors"]["b"].pop("offset")),
    "plain tensor past its file's end": lambda root: _as_sharded(root, lambda m: m["tensors"]["b"].update(
        shape=[2**40])),  # was allocated (8 TiB) before a byte was read
    "an unpieced 4 TiB leaf, a rank missing": lambda root: _as_sharded(root, _unpieced_huge, world_size=2),
}


@pytest.mark.parametrize("craft", SHARDED_CRAFTS.values(), ids=SHARDED_CRAFTS.keys())
def test_a_crafted_sharded_step_is_refused_before_anything_is_allocated(
    tmp_path: Path, craft: Callable[[Path], object]
) -> None:
    with make(tmp_path) as c:
        for step in (1, 2):
            c.save_async(step, {"w": torch.full((4, 3), float(step)), "b": torch.arange(3)}).wait_persisted(WAIT)
    baseline = tmp_path / "baseline"
    shutil.copytree(tmp_path, baseline, ignore=shutil.ignore_patterns("baseline", "LOCK"))
    _as_sharded(baseline)
    with make(baseline) as c:  # the craft's own baseline is a readable sharded step
        restored = c.restore()
        assert restored is not None and restored.step == 2 and torch.equal(restored.state["b"], torch.arange(3))
    craft(tmp_path)
    with make(tmp_path) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1


def test_a_dangling_link_beside_a_rank_directorys_files_does_not_fail_its_restore(tmp_path: Path) -> None:
    two_steps(tmp_path)
    (tmp_path / STEP2 / "rank_00000" / ".nfs0000001").symlink_to(tmp_path / "gone")
    with make(tmp_path) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 2 and restored.bytes_read > 0


def test_a_lock_record_with_an_impossible_pid_is_not_taken_for_a_holder() -> None:
    rest = '"host": "h", "run_name": "r", "job": "j", "started": "s"'
    for pid in ("1e999", "1e5", str(1 << 40), "-3", '"7"'):  # 1e999: OverflowError in int() before
        assert LockRecord.parse(f'{{"pid": {pid}, {rest}}}'.encode()) is None, pid
    assert LockRecord.parse(f'{{"pid": 7, {rest}}}'.encode()) == LockRecord(7, "h", "r", "j", "s")


def test_a_shared_url_that_is_a_file_is_refused_at_start(tmp_path: Path) -> None:
    afile = tmp_path / "shared"
    afile.write_text("x")  # every upload failed with NotADirectoryError, retried all run long as if transient
    with pytest.raises(ValueError, match=f"shared.url '{afile}' is a file"):
        make(tmp_path / "ckpt", shared=SharedConfig(url=str(afile), run_name="run"))


@pytest.mark.parametrize("moved", [STEP2, f"{STEP2}/rank_00000", f"{STEP2}/rank_00000/manifest.json"])
def test_a_link_in_place_of_a_checkpoint_directory_or_record_is_not_followed(tmp_path: Path, moved: str) -> None:
    # Moved out of the root and linked back: it was read from there (another tree's files taken for this step).
    root = tmp_path / "ckpt"
    two_steps(root)
    elsewhere = tmp_path / "elsewhere"
    (root / moved).rename(elsewhere)
    (root / moved).symlink_to(elsewhere)
    with make(root) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1


@pytest.mark.parametrize("craft", ["rank directory removed", "COMMIT naming no rank"])
def test_a_committed_step_without_a_part_for_this_rank_is_skipped_with_a_word(
    tmp_path: Path, craft: str, caplog: pytest.LogCaptureFixture
) -> None:
    two_steps(tmp_path)
    step_dir = tmp_path / "step_000000000002"
    if craft == "rank directory removed":
        shutil.rmtree(step_dir / "rank_00000")
    else:
        _edit_json(step_dir / "COMMIT", lambda c: c.update(manifests={}))
    with caplog.at_level(logging.WARNING, logger="ckpt"), make(tmp_path) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1
    assert any("skipping checkpoint step 2" in r.getMessage() for r in caplog.records), caplog.text  # was silent


def test_a_mounted_shared_tier_behind_a_dangling_link_fails_at_once_naming_it(tmp_path: Path) -> None:
    (tmp_path / "mnt").symlink_to(tmp_path / "not-mounted")  # an automount that is not there
    c = make(tmp_path / "local", shared=SharedConfig(url=str(tmp_path / "mnt" / "ckpt"), run_name="r"))
    with pytest.raises(CheckpointError, match="not retried") as caught:  # it was retried as transient: 40 s at start
        c.restore()
    c.close()
    assert str(tmp_path / "mnt") in str(caught.value)
