"""A checkpoint step this process may not read (its owner or mode) is not damage: a restore neither falls back to
an older step nor lets retention or a re-save remove it; it stops, naming the file (an audit reproduced an intact
newest step removed after an EACCES). Real files, and a real process without the capability that lets root read
any file (as the job of a user who does not own the directory)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer, SharedConfig
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CHILD = """
import sys
from pathlib import Path
import torch
from ckpt import CheckpointAccessError, CheckpointConfig, Checkpointer
c = Checkpointer(CheckpointConfig(local_dir=Path(sys.argv[1]), keep_last=2), rank=0, world_size=1)
try:
    restored = c.restore()
    print("RESTORED", None if restored is None else restored.step)
except CheckpointAccessError as exc:
    print("DENIED", exc)
c.save_async(3, {"w": torch.full((64,), 3.0)}).wait_persisted()  # retention runs: step 2 must stay
c.close()
"""


def as_another_user() -> list[str]:
    """The command prefix of a process that file modes apply to: root without its read-anything capabilities."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: root would read any file")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, "--bounding-set", drop, "--inh-caps", drop]


@pytest.mark.parametrize("unreadable", ["COMMIT", "step directory", "data file"])
def test_a_step_that_may_not_be_read_is_neither_skipped_nor_removed(tmp_path: Path, unreadable: str) -> None:
    root = tmp_path / "ckpt"
    c = Checkpointer(CheckpointConfig(local_dir=root, keep_last=2), rank=0, world_size=1)
    for step in (1, 2):
        c.save_async(step, {"w": torch.full((64,), float(step))}).wait_persisted()
    c.close()
    step_dir = root / "step_000000000002"
    target = {"COMMIT": step_dir / "COMMIT", "step directory": step_dir,
              "data file": next(step_dir.glob("rank_00000/*.safetensors"))}[unreadable]
    mode = target.stat().st_mode
    target.chmod(0)
    try:
        out = subprocess.run([*as_another_user(), sys.executable, "-c", CHILD, str(root)], cwd=REPO, text=True,
                             capture_output=True, timeout=90, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        target.chmod(mode)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESTORED" not in out.stdout, out.stdout  # not step 1 in step 2's place
    assert "DENIED" in out.stdout and "Permission denied" in out.stdout and str(step_dir) in out.stdout, out.stdout
    # Nothing removed: step 2 restores as it was once the job may read it.
    assert {step_dir.name, "step_000000000003"} <= {p.name for p in root.glob("step_*")}
    c = Checkpointer(CheckpointConfig(local_dir=root, keep_last=2), rank=0, world_size=1)
    restored = c.restore(step=2)
    c.close()
    assert restored is not None and torch.equal(restored.state["w"], torch.full((64,), 2.0))


def test_a_copy_that_may_not_be_read_gives_way_to_another_tiers_copy_of_the_same_step(tmp_path: Path) -> None:
    def config() -> CheckpointConfig:
        return CheckpointConfig(local_dir=tmp_path / "local", keep_last=2,
                                shared=SharedConfig(url=str(tmp_path / "shared"), run_name="r"))

    c = Checkpointer(config(), rank=0, world_size=1)
    for step in (1, 2):
        c.save_async(step, {"w": torch.full((64,), float(step))}).wait_persisted()
    c.close()
    denied = next((tmp_path / "local" / "step_000000000002").glob("rank_00000/*.safetensors"))
    denied.chmod(0)
    child = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ckpt import CheckpointConfig, Checkpointer, SharedConfig\n"
        "root = Path(sys.argv[1])\n"
        "shared = SharedConfig(url=str(root / 'shared'), run_name='r')\n"
        "config = CheckpointConfig(local_dir=root / 'local', keep_last=2, shared=shared)\n"
        "c = Checkpointer(config, rank=0, world_size=1)\n"
        "r = c.restore()\n"
        "print('RESTORED', r.step, r.tier, float(r.state['w'][0]))\n"
        "c.close()\n"
    )
    try:
        out = subprocess.run([*as_another_user(), sys.executable, "-c", child, str(tmp_path)], cwd=REPO, text=True,
                             capture_output=True, timeout=90, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        denied.chmod(0o644)
    assert "RESTORED 2 shared 2.0" in out.stdout, out.stdout + out.stderr[-3000:]
