"""Resumable freezes the objects alive after the first completed step (ResumeConfig.freeze_heap, core/heap.py), so
the cyclic collector's full passes no longer walk torch's, the model's and the optimizer's objects. In a fresh
interpreter: the test process itself may have frozen its heap already (any Resumable in it does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

_SCRIPT = textwrap.dedent("""
    import dataclasses, gc, json, sys
    import torch
    from torch import nn
    from trainer import DataConfig, ElasticSampler, Resumable, ResumeConfig

    config = dataclasses.replace(ResumeConfig.at(sys.argv[1], save_every=2), freeze_heap=sys.argv[2] == "on")
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())
    run = Resumable(config, model=model, optimizer=opt, sampler=ElasticSampler(DataConfig(dataset_size=16,
                                                                                           global_batch=4)))
    counts = [gc.get_freeze_count()]
    for step in (1, 2):
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        run.step_done(step)
        counts.append(gc.get_freeze_count())
    held = [[]]
    held[0].append(held)  # a cycle made after the freeze stays collectable
    del held
    counts.append(gc.collect())
    run.close()
    print(json.dumps(counts))
""")


def _freeze_counts(tmp_path: Path, setting: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / setting), setting], capture_output=True,
                         text=True, timeout=100, check=True, env={**os.environ, "ELASTIC_CKPT_HELPER": "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_heap_is_frozen_once_after_the_first_step_and_new_cycles_are_still_collected(tmp_path: Path) -> None:
    before, first, second, collected = _freeze_counts(tmp_path, "on")
    assert first > before, (before, first)  # the model's, the optimizer's state's and torch's objects
    assert second <= first  # once: not again at later steps (frozen objects freed since leave the count)
    assert collected >= 1


def test_freeze_heap_off_leaves_the_collector_alone(tmp_path: Path) -> None:
    before, first, second, _ = _freeze_counts(tmp_path, "off")
    assert before == first == second
