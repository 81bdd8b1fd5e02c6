"""train_loop: the loop written once; it resumes like a hand-written loop with Resumable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from core.faults import FAULTS_ENV, Fault, InjectedFault, encode
from trainer import DataConfig, ElasticSampler, Resumable, ResumeConfig, train_loop, training_digest

DATA = torch.randn(48, 4, generator=torch.Generator().manual_seed(3))


def build(
    root: Path, *, max_micro: int | None = 2
) -> tuple[Resumable, nn.Module, torch.optim.Optimizer, ElasticSampler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(DataConfig(dataset_size=48, global_batch=6, seed=4, max_micro_batch=max_micro))
    run = Resumable(ResumeConfig.at(str(root), save_every=2), model=model, optimizer=opt, sampler=sampler)
    return run, model, opt, sampler


def step_fn(
    model: nn.Module, opt: torch.optim.Optimizer, sampler: ElasticSampler, calls: list[int]
) -> Callable[[int, list[Any]], None]:
    def train_step(step: int, micro_batches: list[Any]) -> None:
        calls.append(step)
        opt.zero_grad()
        for batch in micro_batches:
            x = DATA[batch] if isinstance(batch, list) else batch
            (model(x).pow(2).mean() * sampler.loss_weight(len(x))).backward()
        opt.step()
    return train_step


def test_train_loop_resumes_where_it_stopped_and_ends_bitwise_equal(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    run, model, opt, sampler = build(tmp_path / "ref")
    assert train_loop(step_fn(model, opt, sampler, []), run, 7) == 7
    reference = training_digest(model, opt)

    run, model, opt, sampler = build(tmp_path / "cut")
    with monkeypatch.context() as env:  # the job fails once step 5 is done: step 4 committed, step 5 lost
        env.setenv(FAULTS_ENV, encode([Fault(point="step", step=5, action="raise")]))
        with pytest.raises(InjectedFault):
            train_loop(step_fn(model, opt, sampler, []), run, 7)
    calls: list[int] = []
    run, model, opt, sampler = build(tmp_path / "cut")
    assert train_loop(step_fn(model, opt, sampler, calls), run, 7) == 7
    assert calls == [4, 5, 6] and run.resumed_from == 4
    assert training_digest(model, opt) == reference


def test_a_finished_train_loop_restarted_does_not_redo_its_tail(tmp_path: Path) -> None:
    run, model, opt, sampler = build(tmp_path)
    assert train_loop(step_fn(model, opt, sampler, []), run, 5) == 5  # saves 2, 4 and the last step, 5
    finished = training_digest(model, opt)
    calls: list[int] = []
    run, model, opt, sampler = build(tmp_path)
    assert train_loop(step_fn(model, opt, sampler, calls), run, 5) == 5
    assert calls == [] and run.resumed_from == 5
    assert training_digest(model, opt) == finished


def test_train_loop_with_a_loader_matches_the_index_lists(tmp_path: Path) -> None:
    run, model, opt, sampler = build(tmp_path / "ids")
    train_loop(step_fn(model, opt, sampler, []), run, 4)
    by_ids = training_digest(model, opt)
    run, model, opt, sampler = build(tmp_path / "loader")
    train_loop(step_fn(model, opt, sampler, []), run, 4, loader=sampler.loader(DATA))
    assert training_digest(model, opt) == by_ids


def test_train_loop_hands_each_step_its_micro_batches(tmp_path: Path) -> None:
    run, model, opt, sampler = build(tmp_path, max_micro=4)  # 6 samples a step: 2 micro-batches of 3
    seen: list[list[list[int]]] = []
    expected = []
    probe = ElasticSampler(sampler.config)
    for _ in range(3):
        expected.append(probe.micro_batches())
        probe.advance()
    train_loop(lambda step, micro: seen.append(micro), run, 3)
    assert seen == expected and all(len(m) == 2 for m in seen)


def test_train_loop_closes_on_error_and_needs_a_sampler(tmp_path: Path) -> None:
    run, *_ = build(tmp_path)
    closed = []
    run.close = lambda: closed.append(True)  # type: ignore[method-assign]

    def boom(step: int, micro: list) -> None:  # type: ignore[type-arg]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train_loop(boom, run, 3)
    assert closed == [True]
    bare = Resumable(ResumeConfig.at(str(tmp_path / "b"), save_every=1), model=nn.Linear(1, 1))
    with pytest.raises(ValueError, match="sampler"):
        train_loop(boom, bare, 3)
