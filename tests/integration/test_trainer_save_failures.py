"""A job whose checkpoints cannot be written stops with a non-zero exit and an error that names
the directory and the cause, instead of training to the end without a checkpoint.

Both jobs (one process a job after its agent's start) run side by side: a module fixture starts them,
each test waits for its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Procs
from tests.integration.tiny_job import TinyJob

pytestmark = pytest.mark.integration


def _file_instead_of_dir(ckpt: Path) -> str:
    ckpt.write_text("a regular file, not a directory\n")
    return "is a regular file, not a directory"


def _files_where_steps_go(ckpt: Path) -> str:
    ckpt.mkdir()
    for step in range(2, 41, 2):  # every step directory's place is taken: each save fails (EEXIST)
        (ckpt / f"step_{step:012d}").write_text("x")
    return "the last 3 saves to"  # ckpt's max_failed_saves policy, let through by Resumable.save


def _file_where_the_last_step_goes(ckpt: Path) -> str:
    ckpt.mkdir()
    (ckpt / f"step_{40:012d}").write_text("x")  # only the last save fails: fewer in a row than max_failed_saves
    return "the end of this run is not checkpointed"  # it used to exit 0


BLOCKS: dict[str, Callable[[Path], str]] = {"file": _file_instead_of_dir, "step-paths": _files_where_steps_go,
                                            "last-step": _file_where_the_last_step_goes}
"""How each job's checkpoint directory is made unwritable; each returns the cause its error must name."""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[TinyJob, Path, str]]]:
    """Each case's job, started at once: (job, its checkpoint dir, the cause)."""
    procs = Procs()
    try:
        started = {}
        for name, block in BLOCKS.items():
            work = tmp_path_factory.mktemp(name)
            ckpt = work / "ckpt"
            cause = block(ckpt)
            job = TinyJob(procs, work, "--steps", "40", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", nproc=1)
            started[name] = (job, ckpt, cause)
        yield started
    finally:
        procs.cleanup()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_unwritable_ckpt_dir_stops_the_job_naming_it(jobs: dict[str, tuple[TinyJob, Path, str]], name: str) -> None:
    job, ckpt, cause = jobs[name]
    out = job.finish(timeout=150, ok=False)
    assert not job.events("final_digest"), out[-3000:]  # stopped: did not train to the end uncheckpointed
    assert any(str(ckpt) in line and cause in line for line in out.splitlines()), out[-3000:]
    assert "free disk space" not in out.lower(), out[-3000:]
