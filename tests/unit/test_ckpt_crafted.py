"""Crafted checkpoints must not hang a restore (issue G item 4): every count is bounded by what
is on disk, only regular files are opened, every read has a deadline. Each test has a short
timeout, so a hang fails it."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer, CheckpointTimeoutError, SharedConfig
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
