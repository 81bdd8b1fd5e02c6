"""examples/train_gpt.py on CPU for 3 steps, resumed, and restarted once finished.

With fp16 autocast (GradScaler state), dropout (RNG), gradient accumulation and a DataLoader worker:
- an uninterrupted run of 3 steps (it saves step 2 and, at the end, step 3);
- a run that fails once step 3 is done (step 2 committed, step 3 lost), then the same command again:
  it resumes from step 2, replays step 3, and ends bit for bit like the uninterrupted run;
- the finished uninterrupted run restarted: it resumes from step 3 and trains nothing again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.events import EVENTS_DIR_ENV, read_events
from core.faults import FAULTS_ENV, Fault, encode
from tests.conftest import REPO

pytestmark = pytest.mark.integration

GPT = REPO / "examples" / "train_gpt.py"


def gpt(work: Path, *, fail_after: int | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(GPT), "--device", "cpu", "--dtype", "fp16", "--steps", "3", "--ckpt-dir",
           str(work / "ckpt"), "--ckpt-every", "2", "--global-batch", "8", "--max-micro-batch", "3",
           "--num-workers", "1", "--layers", "1", "--d-model", "32", "--seq-len", "16", "--dataset-size", "64"]
    env = {**os.environ, EVENTS_DIR_ENV: str(work / "events")}
    if fail_after is not None:
        env[FAULTS_ENV] = encode([Fault(point="step", step=fail_after, action="raise")])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen[str], *, ok: bool = True) -> str:
    out, _ = proc.communicate(timeout=150)  # two runs side by side, on a loaded machine
    assert (proc.returncode == 0) == ok, out[-3000:]
    return out


def events(work: Path, kind: str, *, since: float = 0.0) -> list[dict]:  # type: ignore[type-arg]
    return [e for e in read_events(str(work / "events")) if e["event"] == kind and e["ts"] >= since]


@pytest.mark.timeout(360)
def test_gpt_example_runs_and_resumes_bitwise_on_cpu(tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    first, failing = gpt(whole), gpt(cut, fail_after=3)  # side by side
    out = finish(first)
    assert re.findall(r"^step=(\d+) loss=[\d.]+ lr=\S+ tok/s=\S+$", out, re.M) == ["1", "2", "3"]
    assert re.search(r"^tokens_per_s=\d+ over 2 steps on 1 x cpu \(fp16\)$", out, re.M)
    (reference,) = [e["digest"] for e in events(whole, "final_digest")]
    loss3 = re.compile(r"^step=3 loss=(\S+) ", re.M)
    assert loss3.findall(out)

    finish(failing, ok=False)
    assert [(e["point"], e["step"]) for e in events(cut, "fault")] == [("step", 3)]
    assert not events(cut, "final_digest")
    restarted = read_events(str(cut / "events"))[-1]["ts"]
    resuming, restarting = gpt(cut), gpt(whole)  # side by side: the cut run resumed, the finished one restarted
    second = finish(resuming)
    assert [e["step"] for e in events(cut, "resumed", since=restarted)] == [2]
    assert re.findall(r"^step=(\d+) ", second, re.M) == ["3"]
    assert loss3.findall(second) == loss3.findall(out)
    assert [e["digest"] for e in events(cut, "final_digest")] == [reference]

    again = finish(restarting)
    assert [e["step"] for e in events(whole, "resumed")] == [0, 3]
    assert not re.findall(r"^step=", again, re.M)
    assert [e["digest"] for e in events(whole, "final_digest")] == [reference, reference]
