"""trainer/state_view.py: the cheap per-step flattening of a Resumable's state gives exactly what
`flatten(state())` gives (names, values, skeleton), while the model and optimizer keep their tensors, and
after every kind of change to them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ckpt.format import dumps
from ckpt.tree import Flat, flatten
from trainer import rng
from trainer.state_view import StateView

pytestmark = pytest.mark.timeout(60)


class Job:
    def __init__(self, model: nn.Module) -> None:
        torch.manual_seed(0)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1 / (1 + s))
        self.step = 0
        self.view = StateView(self.state, self.model, self.optimizer)

    def tree(self, model_sd: Any, optim_sd: Any) -> dict[str, Any]:
        return {"step": self.step, "model": model_sd, "optimizer": optim_sd,
                "scheduler": self.scheduler.state_dict(), "rng": rng.capture(), "extras": {"note": "x"}}

    def state(self) -> dict[str, Any]:
        return self.tree(self.model.state_dict(), self.optimizer.state_dict())

    def train(self) -> None:
        self.model(torch.randn(4, 8)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.step += 1

    def check(self) -> Flat:
        """The view's Flat equals flatten(state()) (taken right after it, with the same RNG state)."""
        before = torch.get_rng_state()
        got = self.view.flat(self.tree(None, None))
        torch.set_rng_state(before)
        tensors, skeleton = flatten(self.state())
        assert sorted(got.tensors) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(got.tensors[name], tensor), name
        assert json.loads(dumps(got.skeleton)) == json.loads(dumps(skeleton))
        assert list(got.skeleton) == list(skeleton)  # the same key order: the same manifest bytes
        return got


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4))


def test_while_the_tensors_stay_the_same_the_view_walks_the_model_once() -> None:
    job = Job(model())
    for _ in range(5):
        job.train()
        job.check()
    assert job.view.rebuilds == 1
    # The skeleton follows what changes every step (the lr in param_groups, the step, the RNG).
    flat = job.check()
    assert flat.skeleton["optimizer"]["param_groups"][0]["lr"] == job.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("change", ["new buffer", "new parameter object", "new module", "optimizer state reset"])
def test_a_change_to_the_model_or_the_optimizer_takes_the_full_walk_again(change: str) -> None:
    job = Job(model())
    job.train()
    job.check()
    changes: dict[str, Callable[[], None]] = {
        "new buffer": lambda: job.model[0].register_buffer("scale", torch.ones(3)),
        "new parameter object": lambda: setattr(job.model[3], "bias", nn.Parameter(torch.zeros(4))),
        "new module": lambda: job.model.append(nn.LayerNorm(4)),
        "optimizer state reset": lambda: job.optimizer.state.clear(),
    }
    changes[change]()
    job.check()
    assert job.view.rebuilds == 2
    job.check()
    assert job.view.rebuilds == 2  # cached again


def test_a_model_with_a_state_dict_hook_is_walked_every_time() -> None:
    m = model()
    m[0]._register_state_dict_hook(lambda module, sd, prefix, local: sd)
    job = Job(m)
    for _ in range(3):
        job.train()
        job.check()
    assert job.view.rebuilds == 3


def test_the_boundary_taken_before_a_scheduler_step_and_rng_draws_is_what_flat_gives_later() -> None:
    # A snapshot's small parts are taken at the step boundary, its tensors later (trainer/deferred.py).
    job = Job(model())
    for _ in range(2):
        job.train()
        job.check()
    before = torch.get_rng_state()
    at = job.view.boundary(job.tree(None, None), job.view.param_groups())
    expected = flatten(job.state())
    torch.rand(3)
    job.scheduler.step()  # changes param_groups' lr after the boundary
    got = job.view.flat(at)
    assert json.loads(dumps(got.skeleton)) == json.loads(dumps(expected[1]))
    assert sorted(got.tensors) == sorted(expected[0])
    assert torch.equal(got.tensors["rng/torch"], before)
    assert job.view.rebuilds == 1


@pytest.mark.parametrize("hooked", [False, True])
def test_a_plain_optimizer_is_read_without_state_dict_and_a_hooked_one_through_it(hooked: bool) -> None:
    job = Job(model())
    job.train()
    job.check()
    if hooked:  # a hook may change what state_dict() returns: the view must ask it (registered after its walk)
        job.optimizer.register_state_dict_post_hook(
            lambda opt, sd: sd["param_groups"][0].update(note="hooked") or sd)
    calls = []
    own = job.optimizer.state_dict
    job.optimizer.state_dict = lambda: calls.append(1) or own()  # type: ignore[method-assign]
    for _ in range(3):
        job.train()
        job.view.flat(job.tree(None, None))
    assert (len(calls) > 0) == hooked
    flat = job.check()
    assert ("note" in flat.skeleton["optimizer"]["param_groups"][0]) == hooked


def test_a_full_walk_after_the_boundary_keeps_the_boundary_s_rest() -> None:
    # The first snapshot (no cache yet) walks everything: what it takes of the rest is still the boundary's.
    job = Job(model())
    job.train()
    extras = {"note": "at the boundary"}
    at = job.view.boundary({**job.tree(None, None), "extras": extras}, job.view.param_groups())
    extras["note"] = "later"
    got = job.view.flat(at)
    assert job.view.rebuilds == 1 and got.skeleton["extras"] == {"note": "at the boundary"}


@pytest.mark.parametrize("change", ["hook", "empty group", "parameter moved"])
def test_param_groups_read_directly_follow_state_dict_at_once_after_a_change(change: str) -> None:
    job = Job(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
    job.train()
    job.check()
    opt = job.optimizer
    if change == "hook":
        opt.register_state_dict_post_hook(lambda o, sd: sd["param_groups"][0].update(note="hooked") or sd)
    elif change == "empty group":
        opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": []})
    else:  # the last parameter into a group of its own: the same ids in order, other group sizes
        last = opt.param_groups[0]["params"].pop()
        opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": [last]})
    job.check()  # the first snapshot after the change equals flatten(state())
