"""Resumable in one process: what a checkpoint restores, fallback past corruption, clear mismatches."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckpt import CheckpointVersionError
from trainer import (
    DataConfig,
    ElasticSampler,
    Resumable,
    ResumeConfig,
    StateMismatchError,
    Topology,
    training_digest,
)

_made: list[Resumable] = []


@pytest.fixture(autouse=True)
def _close_what_was_made() -> Iterator[None]:
    """Close every Resumable a test made: one left open keeps its host memory page-locked (on a GPU host) until
    it is collected, and a later test's buffer at the same address then fails to register (seen on an H200)."""
    yield
    while _made:
        _made.pop().close()


def make(
    tmp_path: Path, *, hidden: int = 8, every: int = 2, device: str = "cpu",
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = lambda p: torch.optim.Adam(p, lr=0.1),
    scheduler: Callable[[torch.optim.Optimizer], Any] = lambda o: torch.optim.lr_scheduler.StepLR(
        o, step_size=1, gamma=0.5),
    **options: Any,
) -> tuple[Resumable, nn.Module, torch.optim.Optimizer, ElasticSampler]:
    """The test run; `optimizer` and `scheduler` make another optimizer or scheduler for the same model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(0.2), nn.Linear(hidden, 1)).to(device)
    opt = optimizer(list(model.parameters()))
    sched = scheduler(opt)
    sampler = ElasticSampler(DataConfig(dataset_size=64, global_batch=8, seed=0))
    run = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=every, **options), model=model, optimizer=opt,
                    scheduler=sched, sampler=sampler, extras={"note": "x"})
    _made.append(run)
    return run, model, opt, sampler


def train(run: Resumable, model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int, *,
          settle: bool = False) -> list[float]:
    """`settle`: after each step wait until the snapshot before is checksummed (`settled`), so that a loaded
    machine skips none of a snapshot-every-step run's snapshots."""
    if not run._restored_once:  # a fresh run restores first, as any loop must (step_done refuses otherwise)
        assert run.restore() == start == 0
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).device)
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
        if settle:
            settled(run)
    run.checkpointer.wait_persisted()  # async saves: the last one reaches disk before the "crash"
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


def test_a_restore_from_tier_0_without_a_copy_resumes_bitwise_through_the_saves_that_rewrite_its_slot(
        tmp_path: Path, shm: Path) -> None:
    # The trainer restores from host memory without copying the state out of the slot (a copy-on-write
    # mapping of it); the second save after the restore rewrites that slot. The optimizer's CPU state, which
    # its load keeps as given, gets memory of its own (trainer/apply_state.py).
    ref_run, ref_model, ref_opt, _ = make(tmp_path / "ref")
    ref_losses = train(ref_run, ref_model, ref_opt, 0, 8)
    run, model, opt, _ = make(tmp_path / "cut", every=1, persist_every=100, tier0_dir=shm)
    first = train(run, model, opt, 0, 5, settle=True)  # (under two CPU hogs steps 2-5 were once all skipped)
    run.close()
    run2, model2, opt2, _ = make(tmp_path / "cut", every=1, persist_every=100, tier0_dir=shm)
    try:
        step = run2.restore()  # 5: each step_done waits for the snapshot before it, so none is skipped
        assert step == 5 and run2.restored is not None and run2.restored.tier == "memory", step
        rest = train(run2, model2, opt2, step, 8)  # the second save after it goes into the restored slot
        assert first[:step] + rest == ref_losses
        assert training_digest(model2, opt2) == training_digest(ref_model, ref_opt)
    finally:
        run2.close()  # its tier-0 thread done before `shm` is removed (it wrote into a removed directory)


def settled(run: Resumable) -> None:
    """Wait until the snapshot before is checksummed: a snapshot finished while it still is would be skipped
    (by design: the tier-0 thread takes one at a time), and these tests are about which state one holds."""
    assert run.checkpointer._writer.tier0_thread.wait_idle(60)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("then", ["forward", "optimizer step"])
def test_a_snapshot_finished_after_the_step_boundary_holds_the_state_of_the_boundary(
        tmp_path: Path, then: str, device: str, shm: Path) -> None:
    # step_done takes a tier-0 snapshot's small parts (RNG, schedules, data position) at once and the rest when
    # the next forward is queued, or before the optimizer's next step (trainer/deferred.py): what happens in
    # between (RNG draws, a scheduler step, the optimizer changing the parameters) is not in the snapshot.
    run, model, opt, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm, device=device)
    train(run, model, opt, 0, 3)
    assert run._deferred is not None and run._deferred.pending == 3
    rng_now = (lambda: torch.cuda.get_rng_state()) if device == "cuda" else torch.get_rng_state
    at_boundary = (training_digest(model, opt), rng_now(), opt.param_groups[0]["lr"], dict(run.extras))
    torch.rand(5, device=device)
    run.scheduler.step()  # type: ignore[union-attr]
    opt.param_groups[0]["lr"] *= 3  # a loop that sets the lr itself before the next forward
    run.extras["note"] = "changed after the boundary"
    run.extras["added"] = [1]
    settled(run)
    if then == "forward":
        model(torch.randn(2, 4, device=device))
    else:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # changes the parameters: its pre-hook finished the snapshot first
        assert training_digest(model, opt) != at_boundary[0]
    assert run._deferred.pending is None
    run.close()
    run2, model2, opt2, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm, device=device)
    assert run2.restore() == 3 and run2.restored is not None and run2.restored.tier == "memory"
    assert training_digest(model2, opt2) == at_boundary[0]
    assert torch.equal(rng_now(), at_boundary[1]) and opt2.param_groups[0]["lr"] == at_boundary[2]
    assert run2.extras == at_boundary[3]


def test_the_first_beat_is_at_once_a_later_one_waits_for_the_next_forward_and_finish_comes_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # step_done leaves the progress beat (a file write) until the next forward is queued (trainer/deferred.py),
    # except the first: until a worker beats once, its agent cannot judge it hung.
    from elastic import progress  # noqa: PLC0415

    monkeypatch.setenv(progress.ENV_DIR, str(tmp_path / "progress"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    monkeypatch.setattr(progress, "_MIN_INTERVAL_S", 0.0)
    (tmp_path / "progress").mkdir()
    beat_file = tmp_path / "progress" / "local_rank_0"
    run, model, opt, _ = make(tmp_path, every=100)
    run.restore()
    train(run, model, opt, 0, 1)
    assert beat_file.read_text().split()[0] == "1"  # the first: at once
    train(run, model, opt, 1, 2)
    assert beat_file.read_text().split()[0] == "1"  # step 2's waits ...
    model(torch.randn(2, 4))
    assert beat_file.read_text().split()[0] == "2"  # ... for the next forward
    train(run, model, opt, 2, 3)
    run.close()
    assert beat_file.read_text() == "finished"  # step 3's beat ran before it


def test_a_model_without_forward_hooks_writes_the_metrics_file_once_per_period(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A ScriptModule runs no forward hook, and in "staged" mode no optimizer hook waits for a copy: the metrics
    # write step_done left waits for the next step_done, which must run it before judging whether the next write
    # is due (it once was judged first: written twice).
    from elastic import progress  # noqa: PLC0415

    monkeypatch.setenv(progress.ENV_DIR, str(tmp_path / "progress"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    (tmp_path / "progress").mkdir()
    torch.manual_seed(0)
    model = torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    run = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=100, mode="staged"), model=model,
                    optimizer=opt)
    _made.append(run)
    assert run.telemetry.on
    writes: list[int] = []
    flush = run.telemetry.flush
    monkeypatch.setattr(run.telemetry, "flush", lambda: (writes.append(run.step), flush())[1])
    run.restore()
    for step in range(1, 6):
        if step == 2:
            writes.clear()  # the first step's write (at once), and any at the restore
            run.telemetry._next_flush = 0.0  # due at step 2, then not for FLUSH_INTERVAL_S
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        run.step_done(step)
    assert len(writes) == 1, writes
    run.close()


class _Curriculum:
    """A user's schedule whose state_dict() is its own live dict (a Resumable `scheduler`)."""

    def __init__(self) -> None:
        self.s: dict[str, Any] = {"seq_len": 128, "history": []}

    def step(self) -> None:
        self.s["seq_len"] += 128
        self.s["history"].append(self.s["seq_len"])

    def state_dict(self) -> dict[str, Any]:
        return self.s

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s = dict(state)


def test_a_deferred_snapshot_holds_the_boundarys_live_schedule_and_tensor_lr_and_survives_an_inference_forward(
        tmp_path: Path, shm: Path) -> None:
    # What the loop changes between step_done and the next forward, where a snapshot's rest runs: a schedule whose
    # state_dict() is its live dict, an lr tensor changed in place; and that forward an evaluation's, under
    # inference_mode (what the snapshot makes there must not be inference tensors: its writes failed).
    def build() -> tuple[Resumable, nn.Module, torch.optim.Optimizer, _Curriculum]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1))
        schedule = _Curriculum()
        run = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=1, persist_every=100, tier0_dir=shm),
                        model=model, optimizer=opt, scheduler=schedule)  # type: ignore[arg-type]
        _made.append(run)
        return run, model, opt, schedule

    run, model, opt, schedule = build()
    run.restore()
    for step in range(1, 4):
        schedule.step()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        run.step_done(step)
        settled(run)
    at_boundary = (training_digest(model, opt), json.loads(json.dumps(schedule.s)), float(opt.param_groups[0]["lr"]))
    schedule.step()
    opt.param_groups[0]["lr"].mul_(3)
    with torch.inference_mode():
        model(torch.randn(2, 4))  # finishes step 3's snapshot
    assert run._deferred is not None and run._deferred.pending is None
    settled(run)
    run.close()
    assert run.checkpointer.last_error is None
    run2, model2, opt2, schedule2 = build()
    assert run2.restore() == 3 and run2.restored is not None and run2.restored.tier == "memory"
    assert training_digest(model2, opt2) == at_boundary[0]
    assert schedule2.s == at_boundary[1] and float(opt2.param_groups[0]["lr"]) == at_boundary[2]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("mode", ["overlapped", "staged"])
def test_a_torchscript_model_trains_snapshots_and_resumes(tmp_path: Path, shm: Path, mode: str) -> None:
    # A ScriptModule takes no forward hook: step_done's deferred work waits for the other flush points.
    def build() -> tuple[Resumable, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        run = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=1, persist_every=100, tier0_dir=shm,
                                        mode=mode), model=model, optimizer=opt)
        _made.append(run)
        return run, model, opt

    run, model, opt = build()
    run.restore()
    for step in range(1, 4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        run.step_done(step)
        settled(run)
    digest = training_digest(model, opt)
    run.close()
    run2, model2, opt2 = build()
    assert run2.restore() == 3 and training_digest(model2, opt2) == digest


@pytest.mark.parametrize("options", [{"persist_every": 100}, {"persist_every": 3},
                                     {"persist_every": 3, "mode": "staged"}],
                         ids=["snapshots", "with-persists", "staged-not-deferred"])
def test_a_kill_after_any_step_loses_that_step_at_most_however_slow_the_snapshots_checksum(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]) -> None:
    # A step's snapshot is launched in the next step's forward and published (checksummed) after it: a kill
    # right after step_done(k) must find step k-1 in tier 0, not k-2, even when the checksum takes longer than
    # a step (it once did in CI, under load). Also after a persisted step (its tier-0 copy is published by the
    # persist's own thread), and where snapshots are taken in step_done ("staged": nothing deferred).
    # The node's tier 0 is read as a restarted worker reads it.
    import ckpt.writer  # noqa: PLC0415
    from ckpt.tier0 import HostTier  # noqa: PLC0415

    checksum = ckpt.writer.snapshot_manifest

    def slow_checksum(*args: Any, **kwargs: Any) -> bytes:
        time.sleep(0.2)
        return checksum(*args, **kwargs)

    monkeypatch.setattr(ckpt.writer, "snapshot_manifest", slow_checksum)
    run, model, opt, _ = make(tmp_path, every=1, tier0_dir=shm, **options)
    assert run.restore() == 0 and (run._deferred is None) == ("mode" in options)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    try:
        for step in range(1, 9):
            loss = model(data[torch.tensor(run.sampler.indices())]).pow(2).mean()  # type: ignore[union-attr]
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step_done(step)
            held = HostTier(shm, read_timeout=5).committed_steps()
            assert step == 1 or (held and held[0] >= step - 1), (step, held)
    finally:
        run.close()


def test_a_stuck_publication_is_waited_for_once_then_the_loop_goes_on_skipping_snapshots(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint helper that stops answering (its requests time out after 30 s) must not hold every step:
    # step_done waits SNAPSHOT_WAIT once, then does not wait again until the publication is done.
    import threading  # noqa: PLC0415

    import ckpt.writer  # noqa: PLC0415
    import trainer.cadence  # noqa: PLC0415

    checksum, gate = ckpt.writer.snapshot_manifest, threading.Event()

    def stuck_at_step_3(*args: Any, **kwargs: Any) -> bytes:
        if kwargs["step"] == 3:
            assert gate.wait(60)
        return checksum(*args, **kwargs)

    monkeypatch.setattr(ckpt.writer, "snapshot_manifest", stuck_at_step_3)
    monkeypatch.setattr(trainer.cadence, "SNAPSHOT_WAIT", timedelta(seconds=0.2))
    run, model, opt, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm)
    waits: list[float] = []
    wait_snapshot = run.checkpointer.wait_snapshot

    results: list[bool] = []

    def recorded(timeout: timedelta) -> bool:
        published = wait_snapshot(timeout)
        waits.append(timeout.total_seconds())
        results.append(published)
        return published

    run.checkpointer.wait_snapshot = recorded  # type: ignore[method-assign]
    try:
        train(run, model, opt, 0, 7)  # snapshot 3 is launched in step 4's forward: step_done(4) finds it stuck
        # (A step whose snapshot before is published already does not call wait_snapshot: steps 1-3 at most.)
        calls = list(zip(waits, results, strict=True))
        assert calls[-4:] == [(0.2, False)] + [(0.0, False)] * 3, calls  # 4 waited and timed out, 5-7 did not wait
        assert all(call == (0.2, True) for call in calls[:-4]), calls
        gate.set()
        assert wait_snapshot(timedelta(seconds=30))
        before = len(calls)
        train(run, model, opt, 7, 9)
        after = list(zip(waits, results, strict=True))[before:]
        assert all(call == (0.2, True) for call in after), after  # waited for again where it had to
        assert run.checkpointer.newest_snapshot is not None and run.checkpointer.newest_snapshot.step == 8
    finally:
        gate.set()
        run.close()  # its tier-0 thread done before `shm` is removed


def test_a_persist_due_while_the_disk_is_still_writing_the_last_one_goes_to_tier_0_and_then_the_next_step(
        tmp_path: Path, shm: Path) -> None:
    # With a tier 0 holding every step, the loop does not wait for a disk slower than the persist cadence.
    import threading  # noqa: PLC0415

    run, model, opt, _ = make(tmp_path, every=1, persist_every=2, tier0_dir=shm)
    train(run, model, opt, 0, 3)  # step 2 persisted
    writer = run.checkpointer._writer.thread
    gate = threading.Event()
    writer.submit(lambda: gate.wait(20))  # the tier-1 write of a slow disk, still going
    try:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        assert run.step_done(4) is False  # returned while the write runs: not persisted, not waited for
        assert not gate.is_set() and run.checkpointer.persisting
    finally:
        gate.set()
    assert writer.wait_idle(60)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    assert run.step_done(5) is True  # the owed persist, at the first step after the write
    model(torch.randn(8, 4))  # the next forward: the persist's copies are launched once it is queued
    run.checkpointer.wait_persisted()
    on_disk = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "ckpt").glob("step_*"))
    assert on_disk == [2, 5], on_disk
    run.close()
    run2, *_ = make(tmp_path, every=1, persist_every=2, tier0_dir=shm)
    assert run2.restore() == 5


def test_a_persist_left_for_the_next_forward_is_written_at_close(tmp_path: Path, shm: Path) -> None:
    # step_done defers a persist's copies to the next forward (trainer/deferred.py); a loop that ends there still
    # has it on disk, as the state was at that step's end.
    run, model, opt, _ = make(tmp_path, every=1, persist_every=2, tier0_dir=shm)
    train(run, model, opt, 0, 1)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    assert run.step_done(2) is True
    last = run.checkpointer._writer.last_persist
    assert last is None or last.step != 2  # not launched yet: at the next forward, save or close
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    run.close()
    assert [int(p.name.removeprefix("step_")) for p in (tmp_path / "ckpt").glob("step_*")] == [2]
    run2, model2, *_ = make(tmp_path, every=1, persist_every=2, tier0_dir=None)
    assert run2.restore() == 2
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in expected.items())
    run2.close()


class _OtherRankBusy(Topology):
    """Rank 0 of two whose other rank, once `busy`, answers every all_min with "my tier-1 write still runs" (-1)."""

    busy = False

    def all_min(self, value: int) -> int:
        return min(value, -1) if self.busy else value


def test_a_persist_is_postponed_on_every_rank_when_any_rank_s_disk_is_behind(tmp_path: Path, shm: Path) -> None:
    # A step commits once every rank has written it: the ranks agree, and an idle rank postpones with a busy one.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    run = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=1, persist_every=2, tier0_dir=shm),
                    model=model, optimizer=opt, topology=_OtherRankBusy(rank=0, world_size=2, local_rank=0))
    assert run.restore() == 0
    run.topology.busy = True  # type: ignore[attr-defined]
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert run.step_done(step) is False, step  # 2 due, 3 owed: the other rank's disk is still behind
        assert not run.checkpointer.persisting  # this rank's own disk is idle
    assert run._cadence.persist_owed
    run.close()
    assert not list((tmp_path / "ckpt").glob("step_*"))


def test_a_compiled_full_graph_forward_takes_the_deferred_snapshot_hook(tmp_path: Path, shm: Path) -> None:
    # The hook is a no-op inside a traced forward (no graph break); the optimizer's pre-hook finishes the snapshot.
    run, model, opt, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert run.restore() == 0
    for step in (1, 2, 3):
        compiled(torch.randn(2, 4)).sum().backward()
        opt.step()
        run.step_done(step)
    assert run._deferred is not None and run._deferred.pending == 3
    compiled(torch.randn(2, 4))
    assert run._deferred.pending == 3  # not from the traced forward
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    at_boundary = training_digest(model, opt)
    settled(run)
    opt.step()
    assert run._deferred.pending is None
    run.close()
    run2, model2, opt2, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm)
    assert run2.restore() == 3 and training_digest(model2, opt2) == at_boundary


def test_the_last_step_saved_at_teardown_is_copied_once_not_snapshotted_first(tmp_path: Path, shm: Path) -> None:
    run, model, opt, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm)
    train(run, model, opt, 0, 3)
    assert run._deferred is not None and run._deferred.pending == 3
    run.teardown(destroy_process_group=False)
    assert [m.step for m in run.checkpointer.metrics].count(3) == 1  # the persisted save, no snapshot before it
    run2, model2, opt2, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm)
    assert run2.restore() == 3 and training_digest(model2, opt2) == training_digest(model, opt)


def test_close_closes_everything_when_the_waiting_snapshot_fails(tmp_path: Path, shm: Path) -> None:
    run, model, opt, _ = make(tmp_path, every=1, persist_every=100, tier0_dir=shm)
    train(run, model, opt, 0, 2)
    assert run._deferred is not None and run._deferred.pending == 2

    def broken(*_: Any) -> None:
        raise RuntimeError("a sticky device error")

    run._deferred._finish = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="sticky"):
        run.close()
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks  # every hook removed
    assert run.checkpointer._closed


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
        ResumeConfig.at(str(tmp_path), save_every=0)


def test_rng_dependent_model_resumes_bitwise_and_the_check_can_fail(tmp_path: Path) -> None:
    """Dropout and input noise draw from the torch RNG; the resume restores it. A control run that
    perturbs the RNG after the restore must end elsewhere, so the equality is not vacuous."""

    def run_to(root: Path, stop: int, *, perturb: bool = False) -> str:
        run, model, opt, _ = make(root)
        step = run.restore()
        if perturb:
            torch.rand(1)
        data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
        while step < stop:
            x = data[run.sampler.indices()]  # type: ignore[union-attr]
            x = x + 0.3 * torch.randn_like(x)  # augmentation
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            run.step_done(step)
        run.close()  # flush the asynchronous save
        return training_digest(model, opt)

    reference = run_to(tmp_path / "ref", 6)
    run_to(tmp_path / "cut", 4)
    assert run_to(tmp_path / "cut", 6) == reference
    run_to(tmp_path / "ctl", 4)
    assert run_to(tmp_path / "ctl", 6, perturb=True) != reference


def test_grad_scaler_and_extras_round_trip(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    saved = {"scale": 77.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 2}
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(saved)
    run = Resumable(ResumeConfig.at(str(tmp_path), save_every=1), model=model, scaler=scaler,
                    extras={"tokens": 123, "phase": ["warmup", 1.5]})
    assert run.restore() == 0
    run.step_done(1)
    run.close()  # flush the asynchronous save
    fresh = torch.amp.GradScaler("cpu")
    run2 = Resumable(ResumeConfig.at(str(tmp_path), save_every=1), model=nn.Linear(2, 1), scaler=fresh)
    assert run2.restore() == 1
    assert fresh.state_dict() == saved
    assert run2.extras == {"tokens": 123, "phase": ["warmup", 1.5]}


def test_extras_must_be_json_able(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON-able"):
        Resumable(ResumeConfig.at(str(tmp_path), save_every=1), model=nn.Linear(2, 1), extras={"t": torch.ones(1)})
    run = Resumable(ResumeConfig.at(str(tmp_path), save_every=1), model=nn.Linear(2, 1))
    assert run.restore() == 0
    run.extras["bad"] = {1, 2}
    with pytest.raises(ValueError, match=r"extras\['bad'\] is not JSON-able"):
        run.step_done(1)


@pytest.mark.parametrize("field,value", [("dataset_size", 72), ("global_batch", 16), ("seed", 1)])
def test_other_data_settings_say_what_differs_and_change_nothing(tmp_path: Path, field: str, value: int) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    torch.manual_seed(5)
    other_model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    before = training_digest(other_model)
    settings = {"dataset_size": 64, "global_batch": 8, "seed": 0, field: value}
    sampler = ElasticSampler(DataConfig(**settings))
    other = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=2), model=other_model, sampler=sampler)
    with pytest.raises(StateMismatchError, match=f"checkpoint step 2, \\w+ copy \\S+: .*{field}: checkpoint "
                                                 f".*, now {value}"):
        other.restore()
    assert training_digest(other_model) == before  # checked before anything was loaded


def test_other_optimizer_class_is_named(tmp_path: Path) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    torch.manual_seed(0)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    sgd = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    other = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=2), model=model2, optimizer=sgd)
    with pytest.raises(StateMismatchError, match="SGD.*betas.*momentum"):
        other.restore()


def test_checkpoint_of_a_newer_format_stops_the_resume(tmp_path: Path) -> None:
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 4)  # steps 2 and 4 committed
    commit = next((tmp_path / "ckpt").glob("step_000000000004/COMMIT"))
    marker = json.loads(commit.read_text())
    marker["format_version"] += 1
    commit.write_text(json.dumps(marker))
    run2, *_ = make(tmp_path)
    with pytest.raises(CheckpointVersionError) as info:
        run2.restore()  # must not fall back to step 2 silently
    message = str(info.value)
    assert "cannot resume from" in message and "newer elastic-train" in message and "COMMIT" in message


def test_new_rank_gets_derived_deterministic_rng(tmp_path: Path) -> None:
    """A rank that did not exist when the checkpoint was written (the world grew)."""
    run, model, opt, _ = make(tmp_path)
    train(run, model, opt, 0, 2)
    own = torch.rand(4)  # rank 0's stream right after the checkpoint of step 2

    def restored_stream(rank: int) -> torch.Tensor:
        torch.manual_seed(1234)
        r = Resumable(ResumeConfig.at(str(tmp_path / "ckpt"), save_every=2),
                      model=nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1)),
                      topology=Topology(rank=rank, world_size=3, local_rank=rank))
        assert r.restore() == 2
        return torch.rand(4)

    assert torch.equal(restored_stream(0), own)
    one, two = restored_stream(1), restored_stream(2)
    assert torch.equal(one, restored_stream(1))  # deterministic
    assert not torch.equal(one, two) and not torch.equal(one, own)


def test_init_from_starts_from_another_runs_checkpoint(tmp_path: Path) -> None:
    run, model, opt, _ = make(tmp_path / "a")  # run "default" in a/ckpt
    train(run, model, opt, 0, 4)
    run.close()
    torch.manual_seed(1)
    tuned_model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    config = ResumeConfig.at(str(tmp_path / "b"), save_every=2, run_name="fine-tune",
                          init_from=str(tmp_path / "a" / "ckpt"))
    tuned = Resumable(config, model=tuned_model, optimizer=torch.optim.Adam(tuned_model.parameters(), lr=0.1))
    assert tuned.restore() == 4
    assert training_digest(tuned_model) == training_digest(model)
    tuned.close()
