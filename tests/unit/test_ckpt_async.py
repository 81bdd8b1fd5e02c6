"""The asynchronous checkpointer on the local tier: snapshot, background tier-1 writer, busy
policy, faults (disk full, damaged files, bad manifests), restore and its fallbacks."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt.persist
from ckpt import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointTimeoutError,
    CheckpointWriteError,
)
from ckpt.checksum import digest_parts
from tests import s3_fixtures
from tests.s3_fixtures import Checkpointers

pytestmark = pytest.mark.timeout(30)

# Fixtures shared with the other ckpt tests.
checkpointers = s3_fixtures.checkpointers

SECOND = timedelta(seconds=10)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def state_of(seed: int, *, n: int = 1000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(n, generator=g),
            "b16": torch.randn(7, generator=g).bfloat16(),
            "t": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
            "c": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
            "mask": torch.tensor([True, False]),
            "empty": torch.zeros(0, 3),
        },
        "optim": {"state": {0: {"step": torch.tensor(float(seed))}}, "lr": 0.1},
        "rng": {"torch": torch.get_rng_state(), "py": (3, (1, 2), None)},
        "data": {"epoch": 1, "position": 64 * seed},
        "blob": bytes([seed % 256, 255]),
    }


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert raw(a.resolve_conj()) == raw(b.resolve_conj())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def config(root: Path, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(local_dir=root, **kw)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:012d}"


def test_save_async_round_trip_and_metrics(tmp_path: Path, checkpointers: Checkpointers) -> None:
    c = checkpointers.make(config(tmp_path))
    expected = state_of(1)
    pending = c.save_async(5, expected)
    metrics = pending.wait_persisted(SECOND)
    assert metrics.status == "persisted" and metrics.error is None
    assert (
        metrics.bytes == (step_dir(tmp_path, 5) / "rank_00000" / "state.safetensors").stat().st_size
    )
    assert metrics.stall_s > 0 and metrics.tier1_s is not None and metrics.tier2_s is None
    assert c.committed_steps() == [5]
    assert_same(c.load(5), expected)
    restored = c.restore()
    assert restored is not None and (restored.step, restored.rank, restored.own, restored.tier) == (
        5,
        0,
        True,
        "local",
    )
    assert_same(restored.state, expected)
    manifest = json.loads((step_dir(tmp_path, 5) / "rank_00000" / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    checksum = manifest["files"]["state.safetensors"]["checksum"]
    assert checksum["algorithm"] == "sha256" and checksum["chunk_bytes"] == 64 << 20
    commit = json.loads((step_dir(tmp_path, 5) / "COMMIT").read_text())
    assert set(commit["manifests"]) == {"0"}
    assert [m.step for m in c.metrics] == [5]


def test_staging_buffer_is_reused_and_the_snapshot_is_a_copy(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path, keep_last=5))
    state = {"w": torch.zeros(256), "step": 0}
    for step in (1, 2, 3):
        state["w"].fill_(float(step))
        state["step"] = step
        pending = c.save_async(step, state)
        state["w"].fill_(-1.0)  # mutating right after a staged save must not reach the file
        state["step"] = -1
        pending.wait_persisted(SECOND)
    assert c._staging.allocations == 1
    for step in (1, 2, 3):
        loaded = c.load(step)
        assert torch.equal(loaded["w"], torch.full((256,), float(step))) and loaded["step"] == step
    c.save_async(4, {"w": torch.zeros(512), "step": 4}).wait_persisted(SECOND)  # larger: grows once
    assert c._staging.allocations == 2


def test_prepare_allocates_the_staging_buffer_before_the_first_save(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path))
    state = state_of(1)
    assert c.prepare(state) == c._staging.capacity > 0
    assert c._staging.allocations == 1
    c.save_async(1, state).wait_persisted(SECOND)
    assert c._staging.allocations == 1  # the save reused it
    assert_same(c.load(1), state)


def test_overlapped_mode_copies_before_wait_staged_returns(
    tmp_path: Path, checkpointers: Checkpointers, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = checkpointers.make(config(tmp_path, mode="overlapped"))
    state = {"w": torch.full((1000,), 7.0)}
    pending = c.save_async(1, state)
    c.wait_staged(SECOND)
    state["w"].fill_(0.0)  # like optimizer.step() after the wait
    pending.wait_persisted(SECOND)
    assert torch.equal(c.load(1)["w"], torch.full((1000,), 7.0))
    assert pending.metrics.status == "persisted"


class Gate:
    """Holds tier-1 writes until opened (bounded), to keep a save in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        real = ckpt.persist.write_all

        def gated(fd: int, data: memoryview) -> None:
            self.entered.set()
            assert self.opened.wait(10), "test gate never opened"
            real(fd, data)

        monkeypatch.setattr(ckpt.persist, "write_all", gated)


def test_if_busy_skip_skips_and_never_corrupts(
    tmp_path: Path, checkpointers: Checkpointers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    c = checkpointers.make(config(tmp_path, if_busy="skip"))
    first = c.save_async(1, {"w": torch.full((100,), 1.0)})
    assert gate.entered.wait(10)
    second = c.save_async(2, {"w": torch.full((100,), 2.0)})
    assert second.skipped and "still persisting" in (second.metrics.error or "")
    second.wait_persisted(SECOND)  # a skipped save is "done" at once
    gate.opened.set()
    first.wait_persisted(SECOND)
    assert c.committed_steps() == [1]
    assert torch.equal(c.load(1)["w"], torch.full((100,), 1.0))
    assert [m.status for m in c.metrics] == ["persisted", "skipped"]


def test_if_busy_wait_waits_then_saves_or_skips_after_busy_timeout(
    tmp_path: Path, checkpointers: Checkpointers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    c = checkpointers.make(config(tmp_path, busy_timeout=timedelta(seconds=0.2), keep_last=5))
    c.save_async(1, {"w": torch.full((100,), 1.0)})
    assert gate.entered.wait(10)
    late = c.save_async(2, {"w": torch.full((100,), 2.0)})
    assert late.skipped and "busy_timeout" in (late.metrics.error or "")
    assert late.metrics.stall_s >= 0.2
    threading.Timer(0.05, gate.opened.set).start()
    waited = c.save_async(3, {"w": torch.full((100,), 3.0)})  # waits for step 1, then saves
    assert not waited.skipped and waited.metrics.stall_s >= 0.05
    waited.wait_persisted(SECOND)
    assert c.committed_steps() == [3, 1]
    assert torch.equal(c.load(3)["w"], torch.full((100,), 3.0))


def test_disk_full_in_background_is_surfaced_and_leaves_nothing_visible(
    tmp_path: Path,
    checkpointers: Checkpointers,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = checkpointers.make(config(tmp_path))
    c.save_async(10, state_of(1)).wait_persisted(SECOND)
    real = ckpt.persist.write_all
    calls = []

    def full_after_header(fd: int, data: memoryview) -> None:
        calls.append(len(data))
        if len(calls) > 1:  # header written, data hits a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(ckpt.persist, "write_all", full_after_header)
    with caplog.at_level(logging.ERROR, logger="ckpt"):
        pending = c.save_async(20, state_of(2))  # training continues: no exception here
        with pytest.raises(CheckpointWriteError, match="step 20.*No space left on device.*ENOSPC"):
            pending.wait_persisted(SECOND)
    assert pending.metrics.status == "failed"
    assert "ENOSPC" in (c.last_error or "")
    # elastic/chaos/timeline.py parses this line
    assert any(
        r.getMessage().startswith("checkpoint of step 20 failed on rank 0: ")
        and "ENOSPC" in r.getMessage()
        for r in caplog.records
    )
    assert list(step_dir(tmp_path, 20).iterdir()) == []  # no rank dir, no temp dir, no COMMIT
    assert c.committed_steps() == [10]
    assert c.restore().step == 10
    monkeypatch.setattr(ckpt.persist, "write_all", real)  # space freed: saving works again
    c.save_async(30, state_of(3)).wait_persisted(SECOND)
    assert c.committed_steps()[0] == 30 and c.last_error is None


def test_last_rank_to_publish_commits_the_local_step(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    r0, r1 = (checkpointers.make(config(tmp_path), rank=r, world_size=2) for r in range(2))
    r0.save_async(3, state_of(0)).wait_persisted(SECOND)
    assert r0.committed_steps() == []  # rank 1 has not published yet
    r1.save_async(3, state_of(1)).wait_persisted(SECOND)
    assert r0.committed_steps() == [3]
    commit = json.loads((step_dir(tmp_path, 3) / "COMMIT").read_text())
    assert commit["world_size"] == 2 and set(commit["manifests"]) == {"0", "1"}
    assert_same(r1.load(3), state_of(1))


def test_rank_dir_of_another_generation_is_not_counted(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    old = checkpointers.make(config(tmp_path), rank=1, world_size=2, generation="old")
    old.save_async(3, state_of(9)).wait_persisted(SECOND)  # then the old incarnation died
    new = [
        checkpointers.make(config(tmp_path), rank=r, world_size=2, generation="new")
        for r in range(2)
    ]
    new[0].save_async(3, state_of(0)).wait_persisted(SECOND)
    assert new[0].committed_steps() == []  # the stale rank 1 does not complete the step
    new[1].save_async(3, state_of(1)).wait_persisted(SECOND)
    assert new[0].committed_steps() == [3]
    assert_same(new[0].load(3, rank=1), state_of(1))


def test_generation_set_after_construction_is_recorded(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path))
    c.set_generation("agreed-7")
    c.save_async(1, state_of(1)).wait_persisted(SECOND)
    manifest = json.loads((step_dir(tmp_path, 1) / "rank_00000" / "manifest.json").read_text())
    commit = json.loads((step_dir(tmp_path, 1) / "COMMIT").read_text())
    assert manifest["generation"] == commit["generation"] == "agreed-7"


def test_on_written_runs_after_the_files_are_durable_and_before_publishing(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    seen: list[tuple[int, list[str]]] = []

    def hook(step: int) -> None:
        tmp = list(step_dir(tmp_path, step).glob(".tmp-rank_00000-*"))
        assert len(tmp) == 1
        seen.append((step, sorted(p.name for p in tmp[0].iterdir())))

    c = checkpointers.make(config(tmp_path), on_written=hook)
    c.save_async(1, state_of(1)).wait_persisted(SECOND)
    assert seen == [(1, ["manifest.json", "state.safetensors"])]
    assert c.committed_steps() == [1]


def test_rank_dir_replaced_after_commit_is_rejected(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path, keep_last=5))
    c.save_async(1, state_of(1)).wait_persisted(SECOND)
    c.save_async(2, state_of(2)).wait_persisted(SECOND)
    manifest = step_dir(tmp_path, 1) / "rank_00000" / "manifest.json"
    manifest.write_bytes((step_dir(tmp_path, 2) / "rank_00000" / "manifest.json").read_bytes())
    with pytest.raises(
        CheckpointCorruptError, match="manifest.json.*sha256 its step's COMMIT recorded"
    ):
        c.load(1)


# -- damaged checkpoints: restore falls back to the previous good one, naming the file --------


def rewrite_manifest(rank_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest and re-sign it in COMMIT, so only the edit itself can be caught."""
    path = rank_dir / "manifest.json"
    obj = json.loads(path.read_text())
    edit(obj)
    data = json.dumps(obj).encode()
    path.write_bytes(data)
    commit_path = rank_dir.parent / "COMMIT"
    commit = json.loads(commit_path.read_text())
    commit["manifests"][str(int(rank_dir.name.split("_")[1]))] = hashlib.sha256(data).hexdigest()
    commit_path.write_text(json.dumps(commit))


def replace_state_file(rank_dir: Path, data: bytes) -> None:
    """Replace the data file and fix its manifest entry (size, checksum) to match."""
    (rank_dir / "state.safetensors").write_bytes(data)
    digest = digest_parts([memoryview(data)], algorithm="sha256", chunk_bytes=64 << 20).digest

    def edit(obj: dict[str, Any]) -> None:
        entry = obj["files"]["state.safetensors"]
        entry["bytes"] = len(data)
        entry["checksum"]["digest"] = digest

    rewrite_manifest(rank_dir, edit)


def flip_bit(rank_dir: Path) -> None:
    path = rank_dir / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(rank_dir: Path) -> None:
    path = rank_dir / "state.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def escape_dir(rank_dir: Path) -> None:
    (rank_dir.parent.parent / "outside").write_bytes(b"x")

    def edit(obj: dict[str, Any]) -> None:
        obj["files"] = {"../../outside": obj["files"]["state.safetensors"]}
        for t in obj["tensors"].values():
            t["file"] = "../../outside"

    rewrite_manifest(rank_dir, edit)


def huge_header(rank_dir: Path) -> None:
    replace_state_file(rank_dir, struct.pack("<Q", 2**62) + b"\0" * 64)


def garbage_header(rank_dir: Path) -> None:
    replace_state_file(rank_dir, struct.pack("<Q", 16) + b"\xff" * 16 + b"\0" * 8)


def wrong_shape_in_header(rank_dir: Path) -> None:
    data = (rank_dir / "state.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["model/w"]["shape"] = [10, 100]  # same bytes, other shape than the manifest says
    raw_header = json.dumps(header).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    replace_state_file(rank_dir, struct.pack("<Q", len(raw_header)) + raw_header + data[8 + n :])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (flip_bit, "state.safetensors: sha256 checksum .* does not match"),
        (truncate, "state.safetensors: file is .* bytes, the manifest says .*truncated"),
        (escape_dir, "manifest.json: file entry '../../outside' is not a plain file name"),
        (
            huge_header,
            "state.safetensors: safetensors header length field says 4611686018427387904",
        ),
        (garbage_header, "state.safetensors: safetensors header is not valid JSON"),
        (
            wrong_shape_in_header,
            "state.safetensors: tensor 'model/w' is torch.float32\\[10, 100\\]",
        ),
    ],
    ids=["bit-flip", "truncated", "path-escape", "huge-header", "garbage-header", "shape-mismatch"],
)
def test_damaged_newest_checkpoint_falls_back_with_a_warning_naming_the_file(
    tmp_path: Path,
    checkpointers: Checkpointers,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path], None],
    message: str,
) -> None:
    c = checkpointers.make(config(tmp_path, keep_last=5))
    c.save_async(1, state_of(1)).wait_persisted(SECOND)
    c.save_async(2, state_of(2)).wait_persisted(SECOND)
    damage(step_dir(tmp_path, 2) / "rank_00000")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        restored = c.restore()
    assert restored is not None and restored.step == 1
    assert_same(restored.state, state_of(1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(step_dir(tmp_path, 2)) in w for w in warnings), warnings
    assert any(w.startswith("skipping checkpoint step 2: ") for w in warnings), (
        warnings
    )  # chaos parses it
    import re

    assert any(re.search(message, w) for w in warnings), warnings
    with pytest.raises(CheckpointCorruptError, match=message):
        c.load(2)


def test_restore_of_replicated_state_under_another_world_size(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    saved = [checkpointers.make(config(tmp_path), rank=r, world_size=2) for r in range(2)]
    for r, c in enumerate(saved):
        c.save_async(4, state_of(r)).wait_persisted(SECOND)
    grown = checkpointers.make(config(tmp_path), rank=2, world_size=3)
    restored = grown.restore()
    assert restored is not None and (restored.step, restored.rank, restored.own) == (4, 0, False)
    assert_same(restored.state, state_of(0))
    assert grown.restore(replicated=False) is None
    shrunk = checkpointers.make(config(tmp_path), rank=1, world_size=1 + 1)
    again = shrunk.restore()
    assert again is not None and (again.rank, again.own) == (1, True)
    single = checkpointers.make(config(tmp_path), rank=0, world_size=1)
    assert_same(single.restore().state, state_of(0))


def test_restore_with_step_and_max_step(tmp_path: Path, checkpointers: Checkpointers) -> None:
    c = checkpointers.make(config(tmp_path, keep_last=5))
    for step in (1, 2, 3):
        c.save_async(step, {"s": torch.tensor(step)}).wait_persisted(SECOND)
    assert c.restore(max_step=2).step == 2
    assert c.restore(step=1).state["s"].item() == 1
    assert c.restore(step=7) is None
    assert c.available_steps() == [3, 2, 1]


def test_tensors_are_mapped_from_the_file_not_copied(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path))
    c.save_async(1, {"w": torch.arange(1 << 16, dtype=torch.float32)}).wait_persisted(SECOND)
    a, b = c.load(1)["w"], c.load(1)["w"]
    assert torch.equal(a, torch.arange(1 << 16, dtype=torch.float32))
    a[0] = 42.0  # copy-on-write: neither the file nor another load sees it
    assert b[0].item() == 0.0 and c.load(1)["w"][0].item() == 0.0


def test_legacy_format_1_checkpoints_still_load(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path))
    c.save_async(1, state_of(1)).wait_persisted(SECOND)
    rank_dir = step_dir(tmp_path, 1) / "rank_00000"
    data = (rank_dir / "state.safetensors").read_bytes()

    def to_v1(obj: dict[str, Any]) -> None:
        obj["format_version"] = 1
        obj["files"]["state.safetensors"] = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
        }

    rewrite_manifest(rank_dir, to_v1)
    assert_same(c.load(1), state_of(1))


def test_crc32_checksum_is_recorded_and_verified(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path, checksum="crc32"))
    c.save_async(1, state_of(1)).wait_persisted(SECOND)
    rank_dir = step_dir(tmp_path, 1) / "rank_00000"
    entry = json.loads((rank_dir / "manifest.json").read_text())["files"]["state.safetensors"]
    assert entry["checksum"]["algorithm"] == "crc32"
    flip_bit(rank_dir)
    with pytest.raises(CheckpointCorruptError, match="crc32 checksum"):
        c.load(1)


def test_close_joins_threads_and_rejects_new_saves(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    before = set(threading.enumerate())  # another test's Checkpointer may still be open in this process
    c = checkpointers.make(config(tmp_path))
    c.save_async(1, state_of(1))
    assert c.close(SECOND) is True  # waits for the save in flight
    assert c.committed_steps() == [1]
    assert not [
        t for t in set(threading.enumerate()) - before if t.name.startswith("ckpt-") and t.is_alive()
    ]
    with pytest.raises(RuntimeError, match="closed"):
        c.save_async(2, state_of(2))


def test_wait_persisted_has_a_deadline(
    tmp_path: Path, checkpointers: Checkpointers, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    c = checkpointers.make(config(tmp_path))
    pending = c.save_async(1, state_of(1))
    with pytest.raises(CheckpointTimeoutError, match="step 1 was not written to tier 1 within"):
        pending.wait_persisted(timedelta(seconds=0.1))
    gate.opened.set()
    pending.wait_persisted(SECOND)


def test_unsupported_state_raises_before_anything_is_staged(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    c = checkpointers.make(config(tmp_path))
    with pytest.raises(TypeError, match="'model/act'"):
        c.save_async(1, {"model": {"act": torch.nn.ReLU()}})
    with pytest.raises(TypeError, match="'w'.*complex128"):
        c.save_async(1, {"w": torch.zeros(1, dtype=torch.complex128)})
    assert c.metrics == [] and not tmp_path.joinpath("step_000000000001").exists()


def test_new_config_fields_are_validated(tmp_path: Path) -> None:
    from ckpt import RetryConfig, SharedConfig

    with pytest.raises(ValueError, match="mode must be one of 'staged', 'overlapped', got 'fast'"):
        config(tmp_path, mode="fast")
    with pytest.raises(ValueError, match="if_busy"):
        config(tmp_path, if_busy="queue")
    with pytest.raises(ValueError, match="checksum.*md5"):
        config(tmp_path, checksum="md5")
    with pytest.raises(ValueError, match="busy_timeout must be a datetime.timedelta"):
        config(tmp_path, busy_timeout=5)
    with pytest.raises(ValueError, match="shared.run_name"):
        SharedConfig(url="s3://b/p", run_name="a/b")
    with pytest.raises(ValueError, match="shared.keep_last"):
        SharedConfig(url="s3://b/p", run_name="r", keep_last=0)
    with pytest.raises(ValueError, match="retry.maximum"):
        RetryConfig(initial=timedelta(seconds=2), maximum=timedelta(seconds=1))
    shared = SharedConfig(url=tmp_path, run_name="run-1", storage_options={"a": 1})
    assert shared.url == str(tmp_path) and shared.storage_options == {"a": 1}
