"""Resumable in one process: what a checkpoint restores, fallback past corruption, clear mismatches."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainer import (
    DataConfig,
    ElasticSampler,
    Resumable,
    ResumeConfig,
    StateMismatchError,
    training_digest,
)


def make(tmp_path: Path, *, hidden: int = 8, every: int = 2) -> tuple[Resumable, nn.Module, torch.optim.Optimizer, ElasticSampler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(0.2), nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = ElasticSampler(DataConfig(dataset_size=64, global_batch=8, seed=0))
    run = Resumable(ResumeConfig(ckpt_dir=str(tmp_path / "ckpt"), save_every=every), model=model, optimizer=opt,
                    scheduler=sched, sampler=sampler, extras={"note": "x"})
    return run, model, opt, sampler


def train(run: Resumable, model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> list[float]:
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(start, stop):
        idx = torch.tensor(run.sampler.indices())  # type: ignore[union-attr]
        loss = model(data[idx]).pow(2).mean() + random.random() * 0 + float(np.random.rand()) * 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.scheduler.step()  # type: ignore[union-attr]
        losses.append(loss.item())
        run.step_done(step + 1)
    return losses


def test_fresh_start_returns_step_zero(tmp_path: Path) -> None:
    run, *_ = make(tmp_path)
    assert run.restore() == 0 and run.resumed_from is None


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    ref_run, ref_model, ref_opt, _ = make(tmp_path / "ref")
    ref_losses = train(ref_run, ref_model, ref_opt, 0, 6)

    run, model, opt, _ = make(tmp_path / "cut")
    first = train(run, model, opt, 0, 4)
    random.random(), torch.rand(3), np.random.rand()  # a crash loses RNG draws made after the save
    run2, model2, opt2, sampler2 = make(tmp_path / "cut")
    assert run2.restore() == 4
    rest = train(run2, model2, opt2, 4, 6)
    assert first + rest == ref_losses
    assert training_digest(model2, opt2) == training_digest(ref_model, ref_opt)
    assert sampler2.state_dict() == ref_run.sampler.state_dict()  # type: ignore[union-attr]
    assert run2.scheduler.state_dict() == ref_run.scheduler.state_dict()  # type: ignore[union-attr]
    assert run2.extras == {"note": "x"}


def test_rng_streams_continue_after_resume(tmp_path: Path) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    expected = (random.random(), torch.rand(2).tolist(), float(np.random.rand()))
    run2, *_ = make(tmp_path)
    random.seed(99), torch.manual_seed(99), np.random.seed(99)
    run2.restore()
    assert (random.random(), torch.rand(2).tolist(), float(np.random.rand())) == expected


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 4)  # saves steps 2 and 4
    victim = next((tmp_path / "ckpt").glob("step_000000000004/rank_00000/state.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    run2, *_ = make(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert run2.restore() == 2
    assert "state.safetensors" in caplog.text


def test_model_mismatch_lists_the_keys(tmp_path: Path) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    other, *_ = make(tmp_path, hidden=16)
    with pytest.raises(StateMismatchError) as info:
        other.restore()
    assert "0.weight" in str(info.value) and "(8, 4)" in str(info.value) and "(16, 4)" in str(info.value)


def test_save_every_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="save_every"):
        ResumeConfig(ckpt_dir=str(tmp_path), save_every=0)
