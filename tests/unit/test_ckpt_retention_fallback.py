"""Retention after a fallback restore (issue G item 3): a damaged newer step must never outrank
the fresh saves of the run that fell back past it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer, SharedConfig

pytestmark = pytest.mark.timeout(60)
WAIT = timedelta(seconds=30)
STATE = "rank_00000/state.safetensors"


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_keep_last_1_keeps_the_fresh_save_not_the_damaged_newer_step(tmp_path: Path) -> None:
    config = CheckpointConfig(local_dir=tmp_path, keep_last=2)
    with Checkpointer(config, rank=0, world_size=1) as c:
        for step in (10, 20):
            c.save_async(step, {"s": torch.tensor(step)}).wait_persisted(WAIT)
    flip_last_byte(tmp_path / "step_000000000020" / STATE)

    config = CheckpointConfig(local_dir=tmp_path, keep_last=1)
    with Checkpointer(config, rank=0, world_size=1) as c:
        restored = c.restore()
        assert restored is not None and restored.step == 10  # fell back past damaged 20
        c.save_async(15, {"s": torch.tensor(15)}).wait_persisted(WAIT)
        assert c.committed_steps() == [15]  # not [20]: the fresh save survives its commit
    with Checkpointer(config, rank=0, world_size=1) as c:
        restored = c.restore()
        assert restored is not None and restored.step == 15 and restored.state["s"].item() == 15


def test_a_readable_step_newer_than_the_restart_is_abandoned_in_both_tiers(tmp_path: Path) -> None:
    """The shared tier too: steps newer than the first save of a run that went back past them
    (here: 30, unreadable in tier 1 and tier 2) are removed, never kept in favour of new saves."""
    shared = SharedConfig(url=str(tmp_path / "shared"), run_name="run", keep_last=2)
    config = CheckpointConfig(local_dir=tmp_path / "node", keep_last=1, shared=shared)
    with Checkpointer(config, rank=0, world_size=1) as c:
        for step in (20, 30):
            c.save_async(step, {"s": torch.tensor(step)})
            c.wait_uploaded(WAIT)
    assert sorted(p.name for p in (tmp_path / "node").glob("step_*")) == ["step_000000000030"]
    flip_last_byte(tmp_path / "node" / "step_000000000030" / STATE)
    flip_last_byte(tmp_path / "shared" / "run" / "step_000000000030" / STATE)

    shared = SharedConfig(url=str(tmp_path / "shared"), run_name="run", keep_last=1)
    config = CheckpointConfig(local_dir=tmp_path / "node", keep_last=1, shared=shared)
    with Checkpointer(config, rank=0, world_size=1) as c:
        restored = c.restore()
        assert restored is not None and restored.step == 20  # 20 survives in tier 2 only
        c.save_async(25, {"s": torch.tensor(25)})
        c.wait_uploaded(WAIT)
        assert c.committed_steps() == [25]
        assert c.available_steps() == [25]
