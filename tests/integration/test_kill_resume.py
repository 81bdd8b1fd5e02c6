"""A real kill and a real resume under elastic-run: the final digest equals the uninterrupted run's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import TINY, Procs

pytestmark = pytest.mark.integration


def tiny(procs: Procs, ckpt: Path, *extra: str, steps: int = 25) -> subprocess.Popen[str]:
    return procs.elastic_run("--nproc-per-node", "2", "--max-restarts", "2", str(TINY),
                             "--steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "5", *extra)


def finish(proc: subprocess.Popen[str], timeout: float = 90) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def digest(out: str) -> str:
    found = re.findall(r"^final_digest=(\w+)$", out, re.M)
    assert len(found) == 1, out[-2000:]
    return found[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    procs = Procs()
    try:
        return digest(finish(tiny(procs, tmp_path_factory.mktemp("ref"))))
    finally:
        procs.cleanup()


@pytest.mark.timeout(150)
def test_worker_self_kill_resumes_to_identical_digest(procs: Procs, tmp_path: Path, reference: str) -> None:
    out = finish(tiny(procs, tmp_path, "--crash-at-step", "13", "--crash-rank", "1"))
    assert "fault: rank 1 kills itself (SIGKILL) at step 13" in out
    assert "resumed from step 10" in out
    assert re.search(r"worker rank=1 world=2 pid=\d+ restart=1", out)
    assert digest(out) == reference


@pytest.mark.timeout(150)
def test_external_sigkill_of_a_worker_resumes_to_identical_digest(procs: Procs, tmp_path: Path, reference: str) -> None:
    proc = tiny(procs, tmp_path, "--step-sleep", "0.05")
    assert proc.stdout is not None
    lines, victim, killed_after = [], None, None
    deadline = time.monotonic() + 90
    for line in proc.stdout:
        lines.append(line)
        if m := re.match(r"worker rank=0 world=2 pid=(\d+) restart=0", line):
            victim = int(m[1])
        if (m := re.match(r"step=(\d+) ", line)) and victim and killed_after is None and int(m[1]) >= 7:
            os.kill(victim, signal.SIGKILL)
            killed_after = int(m[1])
        assert time.monotonic() < deadline, "".join(lines[-30:])
    proc.wait(timeout=30)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert killed_after is not None
    assert re.search(r"resumed from step (5|10)\b", out)
    assert digest(out) == reference


@pytest.mark.timeout(150)
def test_restart_of_a_finished_job_resumes_at_the_end(procs: Procs, tmp_path: Path, reference: str) -> None:
    finish(tiny(procs, tmp_path))
    out = finish(tiny(procs, tmp_path))
    assert "resumed from step 25" in out
    assert not re.search(r"^step=", out, re.M)
    assert digest(out) == reference
