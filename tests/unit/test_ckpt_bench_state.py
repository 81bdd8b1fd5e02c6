"""bench/ckpt_bench.py's state: any --state-gb gives a state of that size (less a remainder under one element)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ckpt_bench.py"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gib", [0.05, 0.0625])
def test_a_state_size_that_is_not_a_multiple_of_4_bytes_is_made(gib: float) -> None:
    spec = importlib.util.spec_from_file_location("ckpt_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    total = int(gib * 2**30)  # 0.05 GiB: 53687091 bytes, 3 over a multiple of 4 (it looped for ever)
    state = bench.make_state(total, 16 << 20, torch.device("cpu"))
    made = sum(t.numel() * t.element_size() for t in state["model"].values())
    assert total - 4 < made <= total
