"""`Resumable` and ckpt's save-failure policy: a failed save is logged and training goes on, but
`max_failed_saves` failures in a row stop the job (CheckpointSaveError from step_done or close)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from ckpt import CheckpointSaveError
from trainer import Resumable, ResumeConfig


def blocked_run(tmp_path: Path, max_failed_saves: int | None) -> Resumable:
    """A run whose every step directory's place is taken by a file: each save fails (EEXIST)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step in range(1, 11):
        (ckpt / f"step_{step:012d}").write_text("x")
    run = Resumable(ResumeConfig.at(str(ckpt), save_every=1, max_failed_saves=max_failed_saves),
                    model=nn.Linear(2, 1))
    assert run.restore() == 0
    return run


def test_the_third_failed_save_in_a_row_stops_the_loop(tmp_path: Path) -> None:
    run = blocked_run(tmp_path, 3)
    for step in (1, 2, 3):
        run.step_done(step)  # failures are logged; saves wait for the one before, so each is counted
    with pytest.raises(CheckpointSaveError) as info:
        run.step_done(4)
    assert str(tmp_path / "ckpt") in str(info.value) and "max_failed_saves=3" in str(info.value)
    with pytest.raises(CheckpointSaveError):
        run.close()


def test_failures_at_the_end_stop_the_job_at_close(tmp_path: Path) -> None:
    run = blocked_run(tmp_path, 2)
    run.step_done(1)
    run.step_done(2)  # no later save notices that this one failed too
    with pytest.raises(CheckpointSaveError, match="max_failed_saves=2"):
        run.close()


def test_without_a_limit_failed_saves_are_only_logged(tmp_path: Path) -> None:
    run = blocked_run(tmp_path, None)
    for step in range(1, 6):
        run.step_done(step)
    run.close()
    assert run.checkpointer.last_error is not None and "EEXIST" in run.checkpointer.last_error
