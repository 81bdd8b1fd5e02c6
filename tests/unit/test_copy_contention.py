"""bench/copy_contention.py: a GPU probe; on a host without CUDA it says so in its JSON and exits 0 (CI has no GPU).
The probe itself ran on one H200 (bench/results/copy_contention_h200_session43.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host the probe runs for real")
def test_without_cuda_the_probe_says_it_needs_a_gpu_and_exits_0() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "copy_contention.py")], capture_output=True,
                          text=True, timeout=120, check=True)
    assert "needs a CUDA device" in json.loads(done.stdout)["skipped"]
