"""examples/train_gpt.py on CPU for 3 steps, then again on the same checkpoint directory.

The first run commits step 2 and ends after step 3 without saving it; the second resumes from
step 2 and replays step 3. Both must end bit for bit the same: with fp16 autocast (GradScaler
state), dropout (RNG), gradient accumulation and a DataLoader worker.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

GPT = REPO / "examples" / "train_gpt.py"


def gpt(ckpt: Path) -> str:
    cmd = [sys.executable, str(GPT), "--device", "cpu", "--dtype", "fp16", "--steps", "3", "--ckpt-dir", str(ckpt),
           "--ckpt-every", "2", "--global-batch", "8", "--max-micro-batch", "3", "--num-workers", "1",
           "--layers", "1", "--d-model", "32", "--seq-len", "16", "--dataset-size", "64"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


@pytest.mark.timeout(240)
def test_gpt_example_runs_and_resumes_bitwise_on_cpu(tmp_path: Path) -> None:
    first = gpt(tmp_path)
    assert re.findall(r"^step=(\d+) loss=[\d.]+ lr=\S+ tok/s=\S+$", first, re.M) == ["1", "2", "3"]
    assert re.search(r"^tokens_per_s=\d+ over 2 steps on 1 x cpu \(fp16\)$", first, re.M)
    second = gpt(tmp_path)
    assert "resumed from step 2" in second
    assert re.findall(r"^step=(\d+) ", second, re.M) == ["3"]
    loss3 = re.compile(r"^step=3 loss=(\S+) ", re.M)
    assert loss3.findall(first) == loss3.findall(second)
    digests = [re.findall(r"^final_digest=(\w+)$", out, re.M) for out in (first, second)]
    assert digests[0] and digests[0] == digests[1]
