"""ckpt's structured events (core/events.py): what the chaos harness and tests read instead of logs."""

from __future__ import annotations

import errno
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt.persist
from ckpt import CheckpointConfig, Checkpointer, CheckpointWriteError, SharedConfig
from core.events import EVENTS_DIR_ENV, read_events

pytestmark = pytest.mark.timeout(60)
WAIT = timedelta(seconds=30)


@pytest.fixture
def events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "events"
    monkeypatch.setenv(EVENTS_DIR_ENV, str(directory))
    return directory


def ckpt_events(directory: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(str(directory)) if e["event"].startswith("ckpt_")]


def test_a_commit_in_each_tier_is_a_ckpt_saved_event(tmp_path: Path, events: Path) -> None:
    shared = SharedConfig(url=str(tmp_path / "shared"), run_name="run")
    with Checkpointer(CheckpointConfig(local_dir=tmp_path / "node", shared=shared), rank=0, world_size=1) as c:
        c.save_async(3, {"x": torch.tensor(3)})
        c.wait_uploaded(WAIT)
    saved = ckpt_events(events)
    assert [(e["event"], e["step"], e["tier"]) for e in saved] == [
        ("ckpt_saved", 3, "local"),
        ("ckpt_saved", 3, "shared"),
    ]
    assert all(isinstance(e["seconds"], float) and e["seconds"] >= 0 for e in saved)


def test_only_the_rank_that_commits_reports_the_local_commit(tmp_path: Path, events: Path) -> None:
    ranks = [Checkpointer(CheckpointConfig(local_dir=tmp_path), rank=r, world_size=2) for r in range(2)]
    ranks[0].save(5, {"x": torch.tensor(0)})
    assert ckpt_events(events) == []  # rank 1 has not saved: not committed
    ranks[1].save(5, {"x": torch.tensor(1)})
    assert [(e["event"], e["step"], e["tier"]) for e in ckpt_events(events)] == [("ckpt_saved", 5, "local")]
    for c in ranks:
        c.close()


def test_a_failed_save_is_a_ckpt_failed_event(tmp_path: Path, events: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt.persist, "write_new_file", full_disk)
    with Checkpointer(CheckpointConfig(local_dir=tmp_path / "node"), rank=0, world_size=1) as c:
        with pytest.raises(CheckpointWriteError):
            c.save(7, {"x": torch.tensor(7)})
    (failed,) = ckpt_events(events)
    assert (failed["event"], failed["step"], failed["tier"]) == ("ckpt_failed", 7, "local")
    assert "No space left on device" in failed["error"]


def test_a_damaged_copy_skipped_at_restore_is_a_ckpt_skipped_event(tmp_path: Path, events: Path) -> None:
    config = CheckpointConfig(local_dir=tmp_path / "node")
    with Checkpointer(config, rank=0, world_size=1) as c:
        c.save(1, {"x": torch.tensor(1)})
        c.save(2, {"x": torch.tensor(2)})
    state = tmp_path / "node" / "step_000000000002" / "rank_00000" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    with Checkpointer(config, rank=0, world_size=1) as c:
        restored = c.restore()
        assert restored is not None and restored.step == 1
    (skipped,) = [e for e in ckpt_events(events) if e["event"] == "ckpt_skipped"]
    assert (skipped["step"], skipped["tier"], skipped["source_rank"]) == (2, "local", 0)
    assert skipped["reason"].startswith("local copy of rank 0 is unusable: ") and str(state) in skipped["reason"]


def test_a_step_tier_2_gives_up_is_a_ckpt_failed_event(tmp_path: Path, events: Path) -> None:
    shared = SharedConfig(url=str(tmp_path / "shared"), run_name="run", commit_timeout=timedelta(seconds=0.3))
    config = CheckpointConfig(local_dir=tmp_path / "node", shared=shared)
    with Checkpointer(config, rank=0, world_size=2, local_world_size=1) as c:  # rank 1 never uploads
        c.save_async(4, {"x": torch.tensor(4)})
        c.wait_uploaded(WAIT)
    assert [(e["event"], e["step"], e["tier"]) for e in ckpt_events(events)] == [
        ("ckpt_saved", 4, "local"),
        ("ckpt_failed", 4, "shared"),
    ]
    assert "ranks [1] did not upload step 4" in ckpt_events(events)[1]["error"]
