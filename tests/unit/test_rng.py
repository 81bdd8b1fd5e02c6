"""trainer/rng.py: a capture is each stream's state at that moment, numpy's too, though it is read again only when
its raw bytes changed (and restoring a capture gives the draws that followed it)."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from trainer import rng

pytestmark = pytest.mark.timeout(60)


def numpy_capture_is_now() -> None:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    got = rng.capture()["numpy"]
    assert (got["kind"], got["pos"], got["has_gauss"], got["cached_gaussian"]) == (kind, pos, has_gauss, cached)
    assert np.array_equal(got["keys"].numpy().view(np.uint32), keys)


OPS: list[tuple[str, Callable[[], object]]] = [
    ("nothing", lambda: None),
    ("a draw", np.random.rand),
    ("nothing again", lambda: None),
    ("a gaussian drawn (one cached)", np.random.randn),
    ("the cached gaussian used (no draw)", np.random.randn),
    ("nothing after it", lambda: None),
    ("624 words drawn (the key regenerated)", lambda: np.random.randint(0, 2**32, 624, dtype=np.uint64)),
    ("seeded", lambda: np.random.seed(7)),
    ("another stream's draw", random.random),
]


def test_each_capture_is_numpys_state_at_that_moment_through_draws_gaussians_and_seeds() -> None:
    np.random.seed(3)
    numpy_capture_is_now()
    for what, op in OPS:
        op()
        try:
            numpy_capture_is_now()
        except AssertionError as exc:
            raise AssertionError(f"after {what}: {exc}") from exc


def test_a_state_set_back_is_seen_and_a_caller_changing_a_capture_changes_no_later_one() -> None:
    np.random.seed(5)
    before = np.random.get_state()
    first = rng.capture()
    np.random.rand(10)
    rng.capture()
    np.random.set_state(before)
    numpy_capture_is_now()
    first["numpy"]["pos"] = -1
    assert rng.capture()["numpy"]["pos"] == before[2]


def test_restoring_a_capture_gives_the_draws_that_followed_it() -> None:
    np.random.seed(11)
    np.random.randn()  # a gaussian cached in the state
    state = rng.capture()
    expected = (np.random.randn(), np.random.rand(3).tolist(), random.random(), torch.rand(2).tolist())
    np.random.rand(100)
    rng.capture()
    rng.restore(state)
    assert (np.random.randn(), np.random.rand(3).tolist(), random.random(), torch.rand(2).tolist()) == expected
