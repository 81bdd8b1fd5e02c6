"""A real process SIGKILLed in the middle of writing a checkpoint, to tier 1 and to tier 2: the
half-written checkpoint is never selected, and the next save cleans it up."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointConfig, SharedConfig
from tests import s3_fixtures
from tests.conftest import Procs
from tests.s3_fixtures import Checkpointers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# Fixtures shared with the other ckpt tests.
checkpointers = s3_fixtures.checkpointers

# The child saves step 1 completely, then step 2 (64 MiB) through a throttled writer (tier 1)
# or uploader (tier 2), and is killed by the test while that write is half done.
CHILD = r"""
import sys, time
from datetime import timedelta
import torch
import ckpt.shared, ckpt.persist
from ckpt import Checkpointer, CheckpointConfig, SharedConfig

root, shared_url, phase = sys.argv[1:4]
config = CheckpointConfig(local_dir=root, shared=SharedConfig(url=shared_url, run_name="run"))
c = Checkpointer(config, rank=0, world_size=1)
c.save_async(1, {"w": torch.full((1 << 10,), 1.0)}).wait_uploaded(timedelta(seconds=20))

def slow_write(fd, data, real=ckpt.persist.write_all):
    for start in range(0, len(data), 1 << 20):
        real(fd, data[start:start + (1 << 20)])
        time.sleep(0.02)

def slow_put(self, local, path, step):
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(local, "rb") as src, open(path, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk); dst.flush(); os.fsync(dst.fileno()); time.sleep(0.02)

if phase == "tier1":
    ckpt.persist.write_all = slow_write
else:
    ckpt.shared.SharedTier._put_file = slow_put
print("saving step 2", flush=True)
c.save_async(2, {"w": torch.full((16 << 20,), 2.0)})
time.sleep(60)  # the test kills us long before
"""


def run_and_kill(
    procs: Procs, tmp_path: Path, phase: str, partial: Callable[[], Path | None]
) -> Path:
    proc = procs.start(
        [sys.executable, "-c", CHILD, str(tmp_path / "local"), str(tmp_path / "shared"), phase]
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "saving step 2", line + (
        proc.stdout.read() if proc.poll() is not None else ""
    )
    deadline = time.monotonic() + 30
    while True:
        found = partial()
        if found is not None and (4 << 20) < found.stat().st_size < (64 << 20):
            break
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the child never got half way through step 2"
        time.sleep(0.005)
    procs.kill_group(proc, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    return found


def config(tmp_path: Path, node: str = "local") -> CheckpointConfig:
    return CheckpointConfig(
        local_dir=tmp_path / node, shared=SharedConfig(url=str(tmp_path / "shared"), run_name="run")
    )


def test_killed_during_tier1_write_is_never_selected(
    tmp_path: Path, procs: Procs, checkpointers: Checkpointers
) -> None:
    step2 = tmp_path / "local" / "step_000000000002"

    def partial() -> Path | None:
        return next(step2.glob(".tmp-rank_00000-*/state.safetensors"), None)

    half = run_and_kill(procs, tmp_path, "tier1", partial)
    assert half.exists() and not (step2 / "rank_00000").exists() and not (step2 / "COMMIT").exists()

    c = checkpointers.make(config(tmp_path))
    assert c.committed_steps() == [1] and c.available_steps() == [1]
    restored = c.restore()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["w"], torch.full((1 << 10,), 1.0))
    c.save_async(3, {"w": torch.full((4,), 3.0)}).wait_persisted()
    c.wait_uploaded()
    assert not step2.exists()  # the next commit's retention removed the leftover


def test_killed_during_tier2_upload_is_never_selected(
    tmp_path: Path, procs: Procs, checkpointers: Checkpointers
) -> None:
    shared_step2 = tmp_path / "shared" / "run" / "step_000000000002"

    def partial() -> Path | None:
        path = shared_step2 / "rank_00000" / "state.safetensors"
        return path if path.exists() else None

    run_and_kill(procs, tmp_path, "tier2", partial)
    assert (
        not (shared_step2 / "COMMIT").exists() and not (shared_step2 / "rank_00000.done").exists()
    )

    other_node = checkpointers.make(config(tmp_path, "other"))  # no local copy of anything
    assert other_node.available_steps() == [1]
    restored = other_node.restore()
    assert restored is not None and (restored.step, restored.tier) == (1, "shared")

    same_node = checkpointers.make(config(tmp_path))  # tier 1 finished step 2 before the kill
    restored = same_node.restore()
    assert restored is not None and (restored.step, restored.tier) == (2, "local")
    assert torch.equal(restored.state["w"][:4], torch.full((4,), 2.0))
