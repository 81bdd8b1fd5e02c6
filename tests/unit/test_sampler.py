"""The global data position: exactly-once consumption, determinism, and clear errors."""

from __future__ import annotations

import pytest

from trainer import DataConfig, ElasticSampler, StateMismatchError


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


def test_global_batch_must_divide_world_size() -> None:
    with pytest.raises(ValueError, match="does not divide evenly over world size 3"):
        ElasticSampler(DataConfig(dataset_size=64, global_batch=8), rank=0, world_size=3)


@pytest.mark.parametrize("field,value", [("dataset_size", 65), ("global_batch", 4), ("seed", 9)])
def test_resuming_with_other_data_settings_says_what_differs(field: str, value: int) -> None:
    state = ElasticSampler(DataConfig(dataset_size=64, global_batch=8, seed=0)).state_dict()
    settings = {"dataset_size": 64, "global_batch": 8, "seed": 0, field: value}
    with pytest.raises(StateMismatchError, match=field):
        ElasticSampler(DataConfig(**settings)).load_state_dict(state)


def test_position_beyond_dataset_is_rejected() -> None:
    s = ElasticSampler(DataConfig(dataset_size=64, global_batch=8))
    bad = {**s.state_dict(), "position": 640}
    with pytest.raises(StateMismatchError, match="beyond the dataset"):
        s.load_state_dict(bad)


def test_bad_config_values_name_the_value() -> None:
    with pytest.raises(ValueError, match="dataset_size"):
        DataConfig(dataset_size=0, global_batch=1)
    with pytest.raises(ValueError, match="global_batch"):
        DataConfig(dataset_size=4, global_batch=5)
