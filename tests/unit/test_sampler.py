"""The global data position: exactly-once consumption, determinism, and clear errors."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from trainer import DataConfig, ElasticSampler, StateMismatchError
from trainer.errors import InvalidStateError


def consume(cfg: DataConfig, world: int, steps: int, start: dict | None = None) -> tuple[list[int], dict]:
    """Run `steps` steps on every rank of `world`; return the sample ids consumed, in order."""
    samplers = [ElasticSampler(cfg, rank=r, world_size=world) for r in range(world)]
    if start:
        for s in samplers:
            s.load_state_dict(start)
    seen: list[int] = []
    for _ in range(steps):
        for s in samplers:
            seen.extend(s.indices())
        for s in samplers:
            s.advance()
    return seen, samplers[0].state_dict()


def test_epoch_is_consumed_exactly_once() -> None:
    cfg = DataConfig(dataset_size=96, global_batch=12, seed=3)
    seen, state = consume(cfg, world=3, steps=8)
    assert sorted(seen) == list(range(96))
    assert state["epoch"] == 1 and state["position"] == 0


def test_world_size_changes_mid_epoch_keep_exactly_once() -> None:
    cfg = DataConfig(dataset_size=120, global_batch=12, seed=1)
    a, state = consume(cfg, world=2, steps=3)
    b, state = consume(cfg, world=1, steps=4, start=state)
    c, state = consume(cfg, world=3, steps=3, start=state)
    assert sorted(a + b + c) == list(range(120))
    assert state["epoch"] == 1


def test_global_order_does_not_depend_on_world_size() -> None:
    cfg = DataConfig(dataset_size=64, global_batch=8, seed=7)
    one, _ = consume(cfg, world=1, steps=5)
    four, _ = consume(cfg, world=4, steps=5)
    assert one == four


def test_order_depends_on_seed_and_epoch() -> None:
    cfg = DataConfig(dataset_size=64, global_batch=64, seed=0)
    s = ElasticSampler(cfg)
    first = s.indices()
    s.advance()
    assert s.epoch == 1 and s.indices() != first
    assert ElasticSampler(DataConfig(dataset_size=64, global_batch=64, seed=1)).indices() != first


def test_partial_last_batch_is_skipped() -> None:
    cfg = DataConfig(dataset_size=50, global_batch=16, seed=0)
    s = ElasticSampler(cfg)
    for _ in range(3):
        s.advance()
    assert (s.epoch, s.position) == (1, 0)


@pytest.mark.parametrize("global_batch,world,max_micro", [(32, 3, None), (32, 3, 4), (12, 1, 4), (12, 2, 4),
                                                          (12, 3, 4), (13, 5, 2), (7, 7, None), (30, 4, 3)])
def test_world_size_rule_splits_every_global_batch_exactly(
    global_batch: int, world: int, max_micro: int | None
) -> None:
    cfg = DataConfig(dataset_size=100, global_batch=global_batch, seed=2, max_micro_batch=max_micro)
    samplers = [ElasticSampler(cfg, rank=r, world_size=world) for r in range(world)]
    # Contiguous rank slices in rank order make up the global batch; the first G % W ranks get one more.
    assert sum((s.indices() for s in samplers), []) == samplers[0].global_indices()
    sizes = [s.local_batch for s in samplers]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= (global_batch % world > 0)
    # Equal micro-batch counts on every rank (DDP all-reduces once per step), each non-empty and within the cap.
    assert len({s.accum_steps for s in samplers}) == 1
    for s in samplers:
        micro = s.micro_batches()
        assert len(micro) == s.accum_steps and sum(micro, []) == s.indices()
        assert all(0 < len(m) <= (max_micro or global_batch) for m in micro)


@pytest.mark.parametrize("world,max_micro", [(1, None), (2, 4), (3, 4), (5, 2), (4, 3)])
def test_loss_weights_make_the_gradient_the_global_batch_mean(world: int, max_micro: int | None) -> None:
    """Simulate DDP (average of per-rank gradients) with gradient accumulation and uneven ranks."""
    cfg = DataConfig(dataset_size=64, global_batch=30, seed=0, max_micro_batch=max_micro)
    data = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    w = torch.randn(3, requires_grad=True)

    def mean_loss(ids: list[int]) -> torch.Tensor:
        return (data[ids] @ w).sin().mean()

    reference = torch.autograd.grad(mean_loss(ElasticSampler(cfg).global_indices()), w)[0]
    per_rank = []
    for rank in range(world):
        s = ElasticSampler(cfg, rank=rank, world_size=world)
        loss = sum(mean_loss(m) * s.loss_weight(len(m)) for m in s.micro_batches())
        per_rank.append(torch.autograd.grad(loss, w)[0])
    torch.testing.assert_close(torch.stack(per_rank).mean(0), reference, rtol=1e-6, atol=1e-7)


def test_even_split_weight_is_one_over_accum_steps() -> None:
    s = ElasticSampler(DataConfig(dataset_size=64, global_batch=24, max_micro_batch=4), rank=1, world_size=2)
    assert (s.local_batch, s.accum_steps) == (12, 3)
    assert [s.loss_weight(len(m)) for m in s.micro_batches()] == [1 / 3] * 3


def test_world_larger_than_global_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="global batch 4 cannot be split over world size 5"):
        ElasticSampler(DataConfig(dataset_size=64, global_batch=4), rank=0, world_size=5)


def test_micro_batch_of_one_with_a_remainder_is_rejected() -> None:
    with pytest.raises(ValueError, match="raise max_micro_batch"):
        ElasticSampler(DataConfig(dataset_size=64, global_batch=8, max_micro_batch=1), rank=0, world_size=3)


def test_max_micro_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_micro_batch"):
        DataConfig(dataset_size=64, global_batch=8, max_micro_batch=0)


def step_by_step(s: ElasticSampler, steps: int) -> list[list[int]]:
    out = []
    for _ in range(steps):
        out += s.micro_batches()
        s.advance()
    return out


def test_batch_sampler_runs_ahead_without_moving_the_committed_position() -> None:
    cfg = DataConfig(dataset_size=40, global_batch=12, seed=5, max_micro_batch=3)
    s = ElasticSampler(cfg, rank=1, world_size=2)  # 6 samples a step in 2 micro-batches; 3 steps an epoch
    expected = step_by_step(ElasticSampler(cfg, rank=1, world_size=2), 7)  # crosses two epoch boundaries
    it = iter(s.batch_sampler())
    assert [next(it) for _ in range(14)] == expected
    assert (s.epoch, s.position) == (0, 0)  # prefetching is not consuming
    s.advance()
    s.advance()  # two committed steps; a new iterator (after a restart) starts there
    assert list(itertools.islice(iter(s.batch_sampler()), 10)) == expected[4:]


def test_loader_with_workers_delivers_the_steps_and_leaves_the_global_rng_alone() -> None:
    cfg = DataConfig(dataset_size=50, global_batch=8, seed=1, max_micro_batch=2)
    s = ElasticSampler(cfg, rank=2, world_size=3)  # ranks get 3, 3, 2 samples; 2 micro-batches each
    s.advance()
    expected = step_by_step(ElasticSampler(cfg, rank=2, world_size=3), 9)[2:]
    loader = s.loader(list(range(50)), num_workers=2, prefetch_factor=4)
    before = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    it = iter(loader)
    got = [next(it).tolist() for _ in range(len(expected))]
    del it
    after = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])  # the training RNG streams are untouched
    assert got == expected


def test_loader_rejects_batching_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        ElasticSampler(DataConfig(dataset_size=8, global_batch=4)).loader(list(range(8)), batch_size=2)


@pytest.mark.parametrize("field,value", [("dataset_size", 65), ("global_batch", 4), ("seed", 9)])
def test_resuming_with_other_data_settings_says_what_differs(field: str, value: int) -> None:
    state = ElasticSampler(DataConfig(dataset_size=64, global_batch=8, seed=0)).state_dict()
    settings = {"dataset_size": 64, "global_batch": 8, "seed": 0, field: value}
    with pytest.raises(StateMismatchError, match=field):
        ElasticSampler(DataConfig(**settings)).load_state_dict(state)


@pytest.mark.parametrize("position", [640, 64, 60, -8, 4])
def test_position_beyond_dataset_is_rejected(position: int) -> None:
    s = ElasticSampler(DataConfig(dataset_size=64, global_batch=8))
    bad = {**s.state_dict(), "position": position}
    with pytest.raises(InvalidStateError, match="not a step.s start within the dataset"):  # the settings match: damage
        s.load_state_dict(bad)
    assert (s.epoch, s.position) == (0, 0)


@pytest.mark.parametrize(("epoch", "position"), [(1_000_000, 32), (0, 48), (0, 0), (1, 24)])
def test_a_position_that_is_not_where_the_steps_leave_the_data_is_damage(epoch: int, position: int) -> None:
    s = ElasticSampler(DataConfig(dataset_size=64, global_batch=8))  # 8 steps an epoch: step 4 is (0, 32)
    with pytest.raises(InvalidStateError, match="not where 4 steps leave the data \\(epoch 0, position 32\\)"):
        s.check_state({**s.state_dict(), "epoch": epoch, "position": position}, step=4)
    s.check_state({**s.state_dict(), "epoch": 0, "position": 32}, step=4)
    s.check_state({**s.state_dict(), "epoch": 2, "position": 8}, step=17)


def test_last_full_step_of_an_epoch_is_a_valid_position() -> None:
    s = ElasticSampler(DataConfig(dataset_size=64, global_batch=8))
    s.load_state_dict({**s.state_dict(), "epoch": 3, "position": 56})
    assert (s.epoch, s.position) == (3, 56)


def test_malformed_position_is_rejected() -> None:
    s = ElasticSampler(DataConfig(dataset_size=64, global_batch=8))
    with pytest.raises(InvalidStateError, match="malformed"):
        s.load_state_dict({**s.state_dict(), "epoch": -1})


def test_bad_config_values_name_the_value() -> None:
    with pytest.raises(ValueError, match="dataset_size"):
        DataConfig(dataset_size=0, global_batch=1)
    with pytest.raises(ValueError, match="global_batch"):
        DataConfig(dataset_size=4, global_batch=5)


@pytest.mark.parametrize("field,value", [("dataset_size", 10.0), ("global_batch", True), ("seed", "0"),
                                         ("max_micro_batch", 2.5)])
def test_config_values_of_another_type_are_refused_naming_the_field(field: str, value: object) -> None:
    settings: dict[str, object] = {"dataset_size": 10, "global_batch": 2, field: value}
    with pytest.raises(TypeError, match=f"DataConfig.{field} must be an int"):
        DataConfig(**settings)  # type: ignore[arg-type]
