"""A checkpoint whose state tree is malformed is skipped like a damaged file, before anything is
loaded; one that is well formed but does not fit the run is a StateMismatchError; `extras` is the
caller's own dict.

The bad checkpoints are real saves: a real state written by `Resumable`, loaded back, one value
replaced, and saved and committed again through ckpt's public API (`Checkpointer.save`/`commit`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import REPO, Procs
from tests.unit.test_resumable import make, train
from trainer import Resumable, ResumeConfig, StateMismatchError, state_digest

State = dict[str, Any]


def _set(path: str, value: Callable[[Any], Any]) -> Callable[[State], None]:
    """Replace the entry at '/'-separated `path` (int segments index the optimizer state) with value(old)."""
    *parents, leaf = [int(p) if p.isdigit() else p for p in path.split("/")]

    def change(state: State) -> None:
        node: Any = state
        for key in parents:
            node = node[key]
        node[leaf] = value(node[leaf])
    return change


def _drop(key: str) -> Callable[[State], None]:
    return lambda state: state.pop(key)


# Each one is what a damaged or crafted checkpoint can hold; none is what Resumable writes.
MALFORMED: dict[str, Callable[[State], None]] = {
    "rng-missing": _drop("rng"),
    "rng-torch-as-list": _set("rng/torch", lambda t: t.tolist()),
    "rng-torch-too-short": _set("rng/torch", lambda t: t[:100].clone()),
    "rng-python-not-a-state": _set("rng/python", lambda _: "seed 0"),
    "rng-python-short": _set("rng/python", lambda s: (s[0], s[1][:10], s[2])),
    "rng-numpy-keys-float": _set("rng/numpy/keys", lambda t: t.float()),
    "rng-cuda-not-bytes": lambda s: s["rng"].update(cuda=[torch.zeros(16)]),
    "model-as-list": _set("model", lambda m: list(m.values())),
    "model-entry-not-a-tensor": _set("model/0.weight", lambda t: t.tolist()),
    "optimizer-not-a-state-dict": _set("optimizer", lambda _: "adam"),
    "optimizer-exp-avg-wrong-shape": _set("optimizer/state/0/exp_avg", lambda _: torch.zeros(3)),
    "optimizer-step-not-scalar": _set("optimizer/state/1/step", lambda _: torch.zeros(2)),
    "optimizer-param-ids-not-ints": _set("optimizer/param_groups/0/params", lambda p: [str(i) for i in p]),
    "data-epoch-not-an-int": _set("data/epoch", lambda _: "one"),
    "scheduler-as-list": _set("scheduler", lambda _: [1, 2]),
    "extras-as-list": _set("extras", lambda _: ["x"]),
    # Values that loaded without a word and then trained on skipped or repeated samples, drew zeros (or crashed
    # numpy), or failed at the next step after the model and optimizer were loaded (session 44's audit):
    "data-position-not-the-steps": _set("data/position", lambda p: (p + 8) % 64),
    "data-epoch-far": _set("data/epoch", lambda _: 10**6),
    "rng-numpy-pos-past-624": _set("rng/numpy/pos", lambda _: 10**8),
    "rng-numpy-keys-zero": _set("rng/numpy/keys", torch.zeros_like),
    "scheduler-unknown-key": lambda s: s["scheduler"].update(optimizer="x"),
    "scheduler-step-size-str": _set("scheduler/step_size", lambda _: "1"),
    "optimizer-lr-str": _set("optimizer/param_groups/0/lr", lambda _: "0.1"),
    "optimizer-lr-negative": _set("optimizer/param_groups/0/lr", lambda _: -1.0),
    "optimizer-betas-missing": lambda s: s["optimizer"]["param_groups"][0].pop("betas"),
    "optimizer-exp-avg-int": _set("optimizer/state/0/exp_avg", lambda t: t.long()),
    "optimizer-step-str": _set("optimizer/state/0/step", lambda _: "one"),
    "layout-with-another-key": lambda s: s.update(layout={"dp": 1, "tp": 1, "pp": 1}),
    # Loaded, then failed the first step on every restart (session 44's note, left then):
    "optimizer-exp-avg-missing": lambda s: s["optimizer"]["state"][0].pop("exp_avg"),
    "scheduler-step-size-zero": _set("scheduler/step_size", lambda _: 0),
}


def craft(run: Resumable, step: int, change: Callable[[State], None]) -> None:
    """Rewrite committed `step` of `run`'s directory with `change` applied to its real state."""
    run.checkpointer.wait_persisted()
    state = run.checkpointer.load(step)
    change(state)
    run.checkpointer.save(step, state)
    run.checkpointer.commit(step)


@pytest.mark.parametrize("damage", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_newest_checkpoint_is_skipped_for_the_older_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[State], None]
) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    at_step_2 = state_digest(run.state())  # model, optimizer, scheduler, RNG, data, extras of step 2
    train(run, model, opt, 2, 4)
    craft(run, 4, damage)
    run.close()

    run2, model2, opt2, _ = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert run2.restore() == 2
    assert state_digest(run2.state()) == at_step_2  # all of step 2, nothing of step 4
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "trainer.agree"]
    assert "malformed state" in warning
    assert str(tmp_path / "ckpt" / "step_000000000004" / "rank_00000") in warning
    train(run2, model2, opt2, 2, 3)  # the optimizer steps: no bad state got into it
    run2.close()


@pytest.mark.parametrize("damage", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_only_checkpoints_stop_the_run_and_stay(tmp_path: Path, damage: Callable[[State], None]) -> None:
    """With no usable step left, the run stops naming them rather than starting over: its first save removed them
    (session 50: an optimizer's fused=True, then judged damage, had cost a whole run)."""
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 4)
    craft(run, 2, damage)
    craft(run, 4, damage)
    run.close()
    steps = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    run2, *_ = make(tmp_path)
    before = state_digest(run2.state())
    with pytest.raises(StateMismatchError, match="steps 4, 2 were judged malformed .*move that directory away"):
        run2.restore()
    assert state_digest(run2.state()) == before  # model, optimizer, RNG, data position untouched
    run2.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == steps == [
        "step_000000000002", "step_000000000004"]


def test_a_malformed_step_0_checkpoint_is_named_like_any_other(tmp_path: Path) -> None:
    """The step before 0 was asked for (restore(max_step=-1)): a bare ValueError (session 50's review)."""
    run, *_ = make(tmp_path)
    assert run.restore() == 0
    run.save(0)  # the initial weights
    craft(run, 0, MALFORMED["optimizer-lr-str"])
    run.close()
    run2, *_ = make(tmp_path)
    with pytest.raises(StateMismatchError, match="step 0 was judged malformed"):
        run2.restore()
    run2.close()


def test_reordered_optimizer_is_a_mismatch_not_damage(tmp_path: Path) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    run.close()
    torch.manual_seed(0)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt2 = torch.optim.Adam(list(model2.parameters())[::-1], lr=0.1)  # same optimizer, other parameter order
    before = state_digest({"model": model2.state_dict(), "optimizer": opt2.state_dict()})
    other = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=2), model=model2, optimizer=opt2)
    with pytest.raises(StateMismatchError, match="parameter order differs: group 0 position 0 is '0.weight'"):
        other.restore()
    assert state_digest({"model": model2.state_dict(), "optimizer": opt2.state_dict()}) == before
    other.close()


# Choices of how torch steps, made between two runs (session 50's audit: each made every checkpoint 'malformed', the
# run started over at step 0 and its first save removed them all).
HOW_TORCH_STEPS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "foreach": lambda p: torch.optim.Adam(p, lr=0.1, foreach=True),
    "no-foreach": lambda p: torch.optim.Adam(p, lr=0.1, foreach=False),
    "tensor-lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(0.1)),
}


@pytest.mark.parametrize("optimizer", HOW_TORCH_STEPS.values(), ids=HOW_TORCH_STEPS.keys())
def test_how_the_optimizer_steps_may_change_between_runs(
        tmp_path: Path, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 4)
    run.close()
    run2, model2, opt2, _ = make(tmp_path, optimizer=optimizer)
    assert run2.restore() == 4  # the saved groups' values then, as torch's load_state_dict takes them
    train(run2, model2, opt2, 4, 6)  # it steps on the loaded state
    run2.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))[-1] == "step_000000000006"


@pytest.mark.parametrize("other", ["AdamW", "LambdaLR"])
def test_another_optimizer_or_scheduler_class_stops_the_run_and_removes_nothing(tmp_path: Path, other: str) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 4)
    run.close()
    steps = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    if other == "AdamW":  # the same group keys as Adam's in this torch: it loaded, weight_decay 0 and all
        run2, *_ = make(tmp_path, optimizer=lambda p: torch.optim.AdamW(p, lr=0.1))
        expected = "the checkpoint's optimizer is Adam and this run's is AdamW: resume with Adam"
    else:
        run2, *_ = make(tmp_path, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step))
        expected = "'scheduler' state does not load into this LambdaLR .* resume with the scheduler it was written with"
    with pytest.raises(StateMismatchError, match=expected):
        run2.restore()
    run2.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == steps


def test_extras_is_the_callers_dict_saved_as_it_is_at_each_save(tmp_path: Path) -> None:
    config = ResumeConfig.at(str(tmp_path), save_every=1)
    mine: dict[str, Any] = {}
    run = Resumable(config, model=nn.Linear(2, 1), extras=mine)
    assert run.extras is mine
    assert run.restore() == 0
    mine["tokens"] = 5
    run.step_done(1)
    mine["tokens"] = 7  # after the save of step 1, before that of step 2
    run.step_done(2)
    run.checkpointer.wait_persisted()
    assert run.checkpointer.load(1)["extras"] == {"tokens": 5}
    assert run.checkpointer.load(2)["extras"] == {"tokens": 7}
    run.close()

    theirs: dict[str, Any] = {"tokens": 0, "only_here": True}
    run2 = Resumable(config, model=nn.Linear(2, 1), extras=theirs)
    assert run2.restore() == 2
    assert run2.extras is theirs and theirs == {"tokens": 7, "only_here": True}  # updated in place
    run2.close()


_TWO_RANKS = """
import sys, torch, torch.distributed as dist
from torch import nn
from trainer import Resumable, ResumeConfig

dist.init_process_group("gloo")
rank = dist.get_rank()

def make():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt, Resumable(ResumeConfig.at(sys.argv[1], save_every=2), model=model, optimizer=opt)

model, opt, run = make()
run.restore()
for step in range(4):
    opt.zero_grad(); model(torch.ones(3, 4)).sum().backward(); opt.step(); run.step_done(step + 1)
run.checkpointer.wait_persisted()
for step in ((4,) if sys.argv[2] == "newest" else (2, 4)) if rank == 1 else ():
    # only rank 1's copies are bad: their Adam state does not fit the parameter
    state = run.checkpointer.load(step)
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    run.checkpointer.save(step, state)
    run.checkpointer.commit(step)
run.close()
dist.barrier()
model, opt, run = make()
print(f"rank={rank} restored={run.restore()}", flush=True)
opt.zero_grad(); model(torch.ones(3, 4)).sum().backward(); opt.step()
run.close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bad", ["newest", "all"])
def test_one_rank_with_a_malformed_copy_takes_the_whole_group_back(tmp_path: Path, procs: Procs, bad: str) -> None:
    """Rank 1's newest copy malformed: every rank resumes from the older step. All of rank 1's copies malformed: rank
    0 sends its newest state (a peer's state, not a stop: session 50's stop for malformed steps comes after it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    workers = [procs.start([sys.executable, "-c", _TWO_RANKS, str(tmp_path / f"node{r}"), bad],
                           env={**env, "RANK": str(r)}, cwd=str(REPO)) for r in range(2)]
    outputs = [w.communicate(timeout=150)[0] for w in workers]
    for r, (w, out) in enumerate(zip(workers, outputs, strict=True)):
        assert w.returncode == 0, out
        assert f"rank={r} restored={2 if bad == 'newest' else 4}" in out, out
    assert f"{tmp_path / 'node1' / 'step_000000000004' / 'rank_00001'}" in outputs[1]
    assert "malformed state" in outputs[1] and "malformed state" not in outputs[0]


class _Decay:
    """A callable LambdaLR factor with state (LambdaLR saves its __dict__)."""

    def __init__(self) -> None:
        self.k = 0.9

    def __call__(self, epoch: int) -> float:
        return float(self.k**epoch)


def _schedules(opt: torch.optim.Optimizer) -> dict[str, Any]:
    lr = torch.optim.lr_scheduler
    return {"multistep": lr.MultiStepLR(opt, [2, 4]),  # milestones: a Counter with int keys
            "sequential": lr.SequentialLR(opt, [lr.LinearLR(opt), lr.StepLR(opt, 1)], [2]),
            "lambda-object": lr.LambdaLR(opt, _Decay()),
            "plateau": lr.ReduceLROnPlateau(opt),
            # Stepped to its last step, where its next step raises ValueError: still a good checkpoint.
            "one-cycle-at-its-end": lr.OneCycleLR(opt, max_lr=0.1, total_steps=3),
            "cosine-restarts": lr.CosineAnnealingWarmRestarts(opt, T_0=2),
            "cyclic": lr.CyclicLR(opt, 0.01, 0.1, step_size_up=5),
            # A user's scale function that ends with the run (a table of 4): at its end, its next step would fail.
            "cyclic-table-at-its-end": lr.CyclicLR(opt, 0.01, 0.1, scale_fn=lambda i: [1.0, 0.9, 0.8, 0.7][i],
                                                   scale_mode="iterations"),
            "polynomial": lr.PolynomialLR(opt, total_iters=2)}


@pytest.mark.parametrize("kind", ["multistep", "sequential", "lambda-object", "plateau", "one-cycle-at-its-end",
                                  "cosine-restarts", "cyclic", "cyclic-table-at-its-end", "polynomial"])
def test_legitimate_scheduler_states_pass_and_checking_them_changes_nothing_live(kind: str) -> None:
    # The first version of these checks refused MultiStepLR's state (every checkpoint 'malformed': the run started
    # over), and its trial load went into the live nested schedulers and lambdas.
    from trainer.validate import _check_stateful

    def fresh() -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
        return opt, _schedules(opt)[kind]

    opt, saved = fresh()
    for _ in range(3):
        opt.step()
        saved.step(1.0) if kind == "plateau" else saved.step()
    state = dict(saved.state_dict())
    state["verbose"] = False  # what torch 2.4-2.6 saved
    live_opt, live = fresh()
    before = json.dumps([live.state_dict(), live_opt.state_dict()], default=repr, sort_keys=True)
    _check_stateful("scheduler", live, state)  # (OneCycleLR's and CyclicLR's get_lr set their optimizer's momentum)
    assert json.dumps([live.state_dict(), live_opt.state_dict()], default=repr, sort_keys=True) == before
    _check_stateful("scaler", torch.amp.GradScaler("cpu", enabled=False),  # saved enabled, resumed disabled
                    torch.amp.GradScaler("cpu").state_dict())
