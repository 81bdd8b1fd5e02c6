"""The save-failure policy and the advice of write errors (issue G item 8, the ckpt side).

Tests run as root, so permissions do not stop a write; a regular file where a directory belongs
(ENOTDIR, EEXIST) is the real failure used here."""

from __future__ import annotations

import errno
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckpt import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    CheckpointWriteError,
)
from ckpt.fs_errors import advice
from tests.unit import test_ckpt_tier0

pytestmark = pytest.mark.timeout(60)
small_tmpfs = test_ckpt_tier0.small_tmpfs  # a real 1 MiB tmpfs
WAIT = timedelta(seconds=20)
STATE = {"w": torch.ones(16)}


def make(root: Path, **kw: object) -> Checkpointer:
    return Checkpointer(CheckpointConfig(local_dir=root, **kw), rank=0, world_size=1)  # type: ignore[arg-type]


def replace_dir_by_file(root: Path) -> None:
    """What an operator's mistake (or a broken mount) leaves: `root` is now a regular file."""
    os.rename(root, root.with_name(root.name + ".moved"))
    root.write_bytes(b"")


def failed_save(c: Checkpointer, step: int) -> CheckpointError:
    pending = c.save_async(step, STATE)
    with pytest.raises(CheckpointWriteError) as info:
        pending.wait_persisted(WAIT)
    return info.value


def test_the_save_after_max_failed_saves_raises_naming_the_directory_and_cause(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    with make(root) as c:
        c.save_async(1, STATE).wait_persisted(WAIT)
        replace_dir_by_file(root)
        for step in (2, 3, 4):
            error = failed_save(c, step)
            assert "Not a directory (ENOTDIR)" in str(error) and "is a regular file" in str(error)
            assert "disk space" not in str(error)
        with pytest.raises(CheckpointSaveError) as info:
            c.save_async(5, STATE)
        message = str(info.value)
        assert str(root) in message and "max_failed_saves=3" in message
        assert "ENOTDIR" in message and "step 4" in message
        with pytest.raises(CheckpointSaveError):
            c.check()  # the cheap per-step check says the same


def test_a_success_resets_the_count_and_none_disables_the_policy(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with make(root, max_failed_saves=2) as c:
        step_file = root / "step_000000000002"
        step_file.write_bytes(b"")  # a file where step 2's directory belongs: EEXIST
        error = failed_save(c, 2)
        assert "File exists (EEXIST)" in str(error) and "move it away" in str(error)
        c.save_async(3, STATE).wait_persisted(WAIT)  # success: the count starts again
        (root / "step_000000000004").write_bytes(b"")
        failed_save(c, 4)
        c.check()  # one failure in a row, below 2
    with make(tmp_path / "other", max_failed_saves=None) as c:
        replace_dir_by_file(tmp_path / "other")
        for step in range(1, 6):
            failed_save(c, step)
        c.check()


def test_a_checkpoint_directory_under_a_regular_file_fails_at_start(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    with pytest.raises(CheckpointWriteError) as info:
        make(plain / "ckpt")
    message = str(info.value)
    assert str(plain / "ckpt") in message and "ENOTDIR" in message and "regular file" in message
    assert "disk space" not in message


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.ENOSPC, "free space on the file system of /c"),
        (errno.EDQUOT, "free space"),
        (errno.EROFS, "/c is on a read-only file system: remount it read-write"),
        (errno.EACCES, "write permission on /c"),
        (errno.EPERM, "write permission on /c"),
        (errno.ENOTDIR, "is a regular file, not a directory"),
        (errno.EEXIST, "exists and is not what a checkpoint expects"),
        (errno.EIO, "I/O errors"),
    ],
)
def test_each_errno_gets_its_own_advice(code: int, says: str) -> None:
    text = advice(OSError(code, os.strerror(code), "/c/step_000000000001"), Path("/c"))
    assert says in text
    if code not in (errno.ENOSPC, errno.EDQUOT):
        assert "space" not in text


def test_a_re_save_that_fails_on_a_full_disk_leaves_the_committed_step(tmp_path: Path, small_tmpfs: Path) -> None:
    """The COMMIT of a step saved again was removed before the new copy was written: on a full disk the write
    failed ("nothing of this attempt is visible") and the committed step was gone, restore took the one before."""
    big = {"w": torch.arange(40_000, dtype=torch.float32)}  # 160 kB
    with make(small_tmpfs, tier0_dir="") as c:
        for step in (1, 2):
            c.save_async(step, big).wait_persisted(WAIT)
        filler = small_tmpfs / "filler"
        with open(filler, "wb") as f:  # the rest of the 1 MiB
            try:
                while True:
                    f.write(bytes(65536))
                    f.flush()
            except OSError:
                pass
        pending = c.save_async(2, {"w": torch.zeros(40_000)})
        with pytest.raises(CheckpointWriteError, match="No space left"):
            pending.wait_persisted(WAIT)
        assert c.committed_steps() == [2, 1]
        restored = c.restore()
        assert restored is not None and restored.step == 2 and torch.equal(restored.state["w"], big["w"])
        del restored  # its tensors map the file: the tmpfs could not be unmounted
