"""The worker-to-agent progress contract (`elastic/progress.py`): beats, finish, stale directories."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import owned_dir
from elastic import progress

pytestmark = pytest.mark.timeout(30)


def _age(directory: Path, local_rank: int, now: float | None = None) -> float | None:
    beat = progress.last_beat(directory, local_rank, now)
    return None if beat is None else beat.age


def test_beat_age_grows_and_a_finished_worker_is_never_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    assert _age(tmp_path, 1) is None  # not beaten yet
    progress.beat(7)
    age = _age(tmp_path, 1, time.monotonic() + 100)
    assert age is not None and 99 <= age <= 130
    progress.finish()
    assert _age(tmp_path, 1, time.monotonic() + 100) is None


def test_a_wall_clock_step_neither_ages_a_beat_nor_hides_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    # Aged by its file's mtime against time.time(), a beat looked 300 s old right after an NTP step forward (the
    # agent killed a healthy worker as hung; with --max-restarts 0 the job died), and a hung worker's beat looked
    # young for an hour after a step back. The worker's and the agent's monotonic clock moves with neither.
    monkeypatch.setenv(progress.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    progress.beat(3)
    beat_file = tmp_path / "local_rank_0"
    assert beat_file.read_text().split()[0] == "3"
    mtime = beat_file.stat().st_mtime
    os.utime(beat_file, (mtime - 3600, mtime - 3600))  # the wall clock was an hour ahead when it beat
    age = _age(tmp_path, 0)
    assert age is not None and age < 60
    os.utime(beat_file, (mtime + 3600, mtime + 3600))  # an hour behind
    age = _age(tmp_path, 0, time.monotonic() + 100)  # and no beat for 100 s
    assert age is not None and age >= 99
    beat_file.write_text("3")  # a beat without its time (another writer): its file's age
    os.utime(beat_file, (mtime - 100, mtime - 100))
    age = _age(tmp_path, 0)
    assert age is not None and age >= 99


def test_make_dir_removes_directories_of_dead_agents_only(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_dir = tmp_path / f"elastic-progress-{dead.stdout.strip()}-abc"
    live_dir = tmp_path / f"elastic-progress-{os.getpid()}-def"
    for d in (dead_dir, live_dir):
        d.mkdir()
        (d / "local_rank_0").write_text("3")
    mine = Path(progress.make_dir(tmp_path))
    assert mine.parent == tmp_path and mine.name.startswith(f"elastic-progress-{os.getpid()}-")
    assert not dead_dir.exists()
    assert live_dir.exists()


def test_a_directory_whose_owner_holds_its_lock_is_kept_whatever_its_pid_says(tmp_path: Path) -> None:
    # An agent in another PID namespace sharing /dev/shm: its pid number is dead here, but it is alive and holds
    # its directory's lock. Its tier 0 was removed by a sweep that went by the pid alone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    held = tmp_path / f"elastic-progress-{dead}-abc"
    held.mkdir()
    (held / owned_dir.OWNER_FILE).touch()
    owner = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); "
                              "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
                              str(held / owned_dir.OWNER_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "locked"
        mine = Path(progress.make_dir(tmp_path))
        assert held.exists()
        assert (mine / owned_dir.OWNER_FILE).exists()
    finally:
        owner.kill()
        owner.wait(10)
    progress.make_dir(tmp_path)  # its owner gone: removed by the next sweep
    assert not held.exists() and mine.exists()  # this process's own directory is alive by its pid


def test_clear_marks_a_worker_that_had_beaten_as_restarted_and_leaves_the_others_unjudged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Deleted, a replaced or kept worker's beat left it unjudged until its next step: one that hung before it (in
    # its restore, or blocked on such a peer) hung the job for good.
    monkeypatch.setenv(progress.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    progress.beat(5)
    monkeypatch.setenv("LOCAL_RANK", "2")
    progress.finish()
    progress.clear(tmp_path)
    beat = progress.last_beat(tmp_path, 0, time.monotonic() + 30)
    assert beat is not None and beat.restarted and 29 <= beat.age <= 60  # judged from the restart
    assert progress.last_beat(tmp_path, 1) is None  # never beat: a plain script, never judged
    assert progress.last_beat(tmp_path, 2) is None and not (tmp_path / "local_rank_2").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    progress.beat(6)  # its first step after the restart
    beat = progress.last_beat(tmp_path, 0)
    assert beat is not None and not beat.restarted and beat.age < 30
