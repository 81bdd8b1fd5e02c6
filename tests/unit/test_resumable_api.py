"""Resumable's surface: ResumeConfig around a CheckpointConfig, events, the sample log, overlapped
mode's hooks, the context manager, accumulate, save_final and teardown."""

from __future__ import annotations

import json
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ckpt import CheckpointConfig, SharedConfig
from core.events import EVENTS_DIR_ENV, read_events
from core.faults import FAULTS_ENV, Fault, InjectedFault, encode
from trainer import (
    DataConfig,
    ElasticSampler,
    Resumable,
    ResumeConfig,
    Topology,
    training_digest,
    wrap_ddp,
)
from trainer.accumulate import accumulate
from trainer.errors import TrainerError
from trainer.samples import SAMPLE_LOG_ENV

DATA = torch.randn(24, 4, generator=torch.Generator().manual_seed(5))


def build(root: Path, **options: Any) -> tuple[Resumable, nn.Module, torch.optim.Optimizer, ElasticSampler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sampler = ElasticSampler(DataConfig(dataset_size=24, global_batch=6, seed=1, max_micro_batch=4))
    run = Resumable(ResumeConfig.at(root, save_every=2, **options), model=model, optimizer=opt, sampler=sampler)
    return run, model, opt, sampler


def train(run: Resumable, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> int:
    step = run.restore()
    batches = iter(run.sampler.loader(DATA)) if run.sampler else iter(())
    while step < steps:
        opt.zero_grad()
        for x, weight, sync in run.accumulate(batches):
            with sync:
                loss = model(x).pow(2).mean() * weight
                loss.backward()
        opt.step()
        step += 1
        run.step_done(step, loss=loss.detach())
    return step


def test_resume_config_holds_a_checkpoint_config_and_reaches_every_option(tmp_path: Path) -> None:
    config = ResumeConfig.at(tmp_path, save_every=5, shared_url=str(tmp_path / "pfs"), run_name="job-1",
                             mode="overlapped", if_busy="skip", checksum="crc32", keep_every=100)
    assert isinstance(config.ckpt, CheckpointConfig) and config.ckpt_dir == str(tmp_path)
    assert (config.ckpt.mode, config.ckpt.if_busy, config.ckpt.checksum, config.ckpt.keep_every) == \
        ("overlapped", "skip", "crc32", 100)
    assert config.ckpt.shared == SharedConfig(url=str(tmp_path / "pfs"), run_name="job-1")
    full = ResumeConfig(ckpt=CheckpointConfig(local_dir=str(tmp_path), keep_last=1), save_every=3)
    assert full.ckpt.keep_last == 1
    with pytest.raises(TypeError, match="keep_lats is not a CheckpointConfig option"):
        ResumeConfig.at(tmp_path, save_every=5, keep_lats=2)
    with pytest.raises(ValueError, match="ResumeConfig.ckpt must be a ckpt.CheckpointConfig"):
        ResumeConfig(ckpt=str(tmp_path), save_every=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        ResumeConfig.at(tmp_path, save_every=5, shared_url="x", shared=SharedConfig(url="y"))


def test_a_replicated_state_sends_no_peer_replicas(tmp_path: Path) -> None:
    # Whole on every rank: any surviving node's own tier 0 serves, so the copy to a peer would be waste.
    run, *_ = build(tmp_path, replicas=2, replica_every=5)
    with run:
        assert not run.sharded and run.checkpointer.config.replicas == 0
        assert run.config.ckpt.replicas == 2 and run.checkpointer.config.replica_every == 5
    with pytest.raises(ValueError, match="replica_every"):
        ResumeConfig.at(tmp_path, save_every=5, replica_every=0)


def test_the_worker_events_of_a_run_and_of_its_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENTS_DIR_ENV, str(tmp_path / "events"))
    run, model, opt, _ = build(tmp_path / "ckpt")
    with run:
        train(run, model, opt, 3)
        digest = run.teardown()
    assert digest == training_digest(model, opt)
    run, model, opt, _ = build(tmp_path / "ckpt")
    with run:
        assert train(run, model, opt, 3) == 3  # saved at the end: nothing to redo
    got = [(e["event"], e.get("step")) for e in read_events(str(tmp_path / "events"))
           if e["event"] in ("worker_started", "restored", "resumed", "step", "final_digest")]
    assert got == [("worker_started", None), ("resumed", 0), ("step", 1), ("step", 2), ("step", 3),
                   ("final_digest", 3), ("worker_started", None), ("restored", 3), ("resumed", 3)]
    events = read_events(str(tmp_path / "events"))
    (restored,) = [e for e in events if e["event"] == "restored"]
    assert (restored["tier"], restored["source_rank"]) == ("local", 0)
    assert restored["path"].startswith(str(tmp_path / "ckpt" / "step_000000000003"))
    assert all(isinstance(e["loss"], float) for e in events if e["event"] == "step")
    assert [e["digest"] for e in events if e["event"] == "final_digest"] == [digest]


def test_the_sample_log_records_each_steps_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SAMPLE_LOG_ENV, str(tmp_path / "samples"))
    run, model, opt, sampler = build(tmp_path / "ckpt")
    probe = ElasticSampler(sampler.config)
    expected = []
    for step in range(1, 6):
        expected.append({"step": step, "epoch": probe.epoch, "rank": 0, "ids": probe.indices()})
        probe.advance()
    with run:
        train(run, model, opt, 5)  # through the loader, which prefetches ahead of the steps
    (log,) = (tmp_path / "samples").glob("samples-w1-r0-c0-p*.jsonl")
    assert [json.loads(line) for line in log.read_text().splitlines()] == expected
    # Each micro-batch as it was handed out, with the step it is for (the loader runs ahead: later steps too).
    (drawn,) = (tmp_path / "samples").glob("drawn-w1-r0-c0-p*.jsonl")
    by_step: dict[int, list[int]] = {}
    for line in drawn.read_text().splitlines():
        rec = json.loads(line)
        by_step.setdefault(rec["step"], []).extend(rec["ids"])
    assert [{**e, "ids": by_step[e["step"]]} for e in expected] == expected


def test_overlapped_mode_waits_for_the_copy_before_the_optimizer_step(tmp_path: Path) -> None:
    run, model, opt, _ = build(tmp_path / "over", mode="overlapped")
    waits = []
    wait_staged = run.checkpointer.wait_staged
    run.checkpointer.wait_staged = lambda *a: (waits.append(run.step), wait_staged(*a))  # type: ignore[method-assign]
    with run:
        train(run, model, opt, 4)
    assert waits == [0, 1, 2, 3]  # before every optimizer step
    overlapped = training_digest(model, opt)
    run, model, opt, _ = build(tmp_path / "staged")
    with run:
        train(run, model, opt, 4)
    assert training_digest(model, opt) == overlapped
    restored = []
    for root in ("over", "staged"):  # the same checkpoints, bit for bit
        run, model, opt, _ = build(tmp_path / root)
        with run:
            assert run.restore() == 4
        restored.append(training_digest(model, opt))
    assert restored == [overlapped, overlapped]


def test_the_context_manager_closes_and_lets_the_loops_error_through(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    run, model, opt, _ = build(tmp_path)
    monkeypatch.setenv(FAULTS_ENV, encode([Fault(point="step", step=3, action="raise")]))
    with pytest.raises(InjectedFault), run:
        train(run, model, opt, 5)
    assert run._closed
    monkeypatch.delenv(FAULTS_ENV)
    run, model, opt, _ = build(tmp_path)
    with run:
        assert run.restore() == 2  # step 2 was flushed on the way out; step 3 is lost


def test_accumulate_weights_each_micro_batch_and_syncs_only_the_last() -> None:
    sampler = ElasticSampler(DataConfig(dataset_size=40, global_batch=10, max_micro_batch=3), rank=1, world_size=3)
    assert sampler.micro_batch_sizes == [2, 1]  # rank 1 of 3 takes 3 of 10 (remainder rule), in 2 micro-batches

    class FakeDDP:
        def __init__(self) -> None:
            self.calls = 0

        def no_sync(self) -> nullcontext[None]:
            self.calls += 1
            return nullcontext()

    fake = FakeDDP()
    got = list(accumulate(iter(["a", "b", "c"]), sampler, fake))  # type: ignore[arg-type]
    assert [(b, w) for b, w, _ in got] == [("a", 2 * 3 / 10), ("b", 1 * 3 / 10)]
    assert fake.calls == 1 and isinstance(got[1][2], nullcontext)
    with pytest.raises(ValueError, match="ran out after 1 of the 2 micro-batches"):
        list(accumulate(iter(["a"]), sampler))


def test_save_final_saves_the_tail_once(tmp_path: Path) -> None:
    run, model, opt, _ = build(tmp_path)
    with run:
        train(run, model, opt, 3)
        assert run.save_final() is True and run.save_final() is False
    run, model, opt, _ = build(tmp_path)
    with run:
        assert run.restore() == 3 and run.save_final() is False


def test_the_sampler_takes_its_place_from_the_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = ElasticSampler(DataConfig(dataset_size=24, global_batch=6))
    assert (sampler.rank, sampler.world_size) == (1, 2)
    with pytest.raises(ValueError, match="the sampler is for rank 0 of 1, but this process is rank 1 of 2"):
        Resumable(ResumeConfig.at(tmp_path, save_every=2), model=nn.Linear(4, 1),
                  sampler=ElasticSampler(DataConfig(dataset_size=24, global_batch=6), rank=0, world_size=1))
    assert Topology.from_env() == Topology(rank=1, world_size=2, local_rank=0)
    monkeypatch.setenv("RANK", "abc")  # was int()'s "invalid literal for int() with base 10: 'abc'"
    with pytest.raises(TrainerError, match=r"\$RANK is 'abc', not a count"):
        Topology.from_env()


def test_teardown_ends_the_process_group_after_the_digest(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        ddp = wrap_ddp(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = ElasticSampler(DataConfig(dataset_size=24, global_batch=6))
        with Resumable(ResumeConfig.at(tmp_path / "ckpt", save_every=10), model=ddp, optimizer=opt,
                       sampler=sampler) as run:
            step = run.restore()
            batches = iter(sampler.loader(DATA))
            while step < 3:
                for x, weight, sync in run.accumulate(batches):
                    with sync:
                        (ddp(x).pow(2).mean() * weight).backward()
                opt.step()
                step += 1
                run.step_done(step)
            digest = run.teardown(batches)
        assert not dist.is_initialized()
        assert "reducer" not in ddp.__dict__ and "process_group" not in ddp.__dict__
        assert digest == training_digest(model, opt)
        assert (tmp_path / "ckpt" / "step_000000000003" / "COMMIT").exists()  # the last step, saved at the end
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


def test_arguments_of_the_wrong_kind_are_named_before_anything_is_made(tmp_path: Path) -> None:
    """Session 50's audit: each failed as a bare AttributeError, some after the checkpointer and its directory lock
    were made, and a scheduler without state_dict after the model and optimizer were loaded."""
    model = nn.Linear(2, 1)
    config = ResumeConfig.at(str(tmp_path / "ckpt"))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"config": CheckpointConfig(local_dir=str(tmp_path / "ckpt"))}, "config=...\\) must be a ResumeConfig"),
        ({"config": str(tmp_path)}, "config=...\\) must be a ResumeConfig"),
        ({"model": model.state_dict()}, "model=...\\) must be a torch.nn.Module .*not its state_dict"),
        ({"optimizer": list(model.parameters())}, "optimizer=...\\) must be a torch.optim.Optimizer"),
        ({"scheduler": object()}, "scheduler=...\\) must be an object with state_dict\\(\\) and load_state_dict"),
        ({"scaler": 1.0}, "scaler=...\\) must be an object with state_dict"),
        ({"sampler": DataConfig(dataset_size=8, global_batch=2)}, "sampler=...\\) must be an ElasticSampler"),
    ]
    for change, message in cases:
        arguments: dict[str, Any] = {"config": config, "model": model, **change}
        with pytest.raises(TypeError, match=message):
            Resumable(arguments.pop("config"), **arguments)
    assert not (tmp_path / "ckpt").exists()  # no checkpointer was made, no lock taken
    with pytest.raises(TypeError, match="ckpt_dir must be a path"):
        ResumeConfig.at(None)  # type: ignore[arg-type]


def test_a_loop_out_of_order_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A step count that is not the next one, a save before restore(), a call after close(): each wrote a
    checkpoint whose step is not the state's; the next restart refused it as damaged, started over at step 0 and
    replaced the committed steps. Now UsageError, naming the step expected, and nothing is written."""
    from trainer import UsageError

    run, model, opt, _ = build(tmp_path)
    with pytest.raises(UsageError, match=r"step_done\(1\) before restore\(\)"):
        run.step_done(1)  # a run that forgot restore() on a directory with checkpoints would overwrite them
    with pytest.raises(UsageError, match=r"save\(0\) before restore\(\)"):
        run.save(0)
    assert train(run, model, opt, 4) == 4
    for wrong in (4, 6, 0, True, 5.0):  # repeated, skipped, 0-based, a bool, a float
        with pytest.raises(UsageError, match=r"expected 5, the run having completed 4 steps"):
            run.step_done(wrong)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"save\(3\): expected 4"):
        run.save(3)
    run.step_done(np.int64(5))  # the right one goes through, a numpy int too
    run.close()
    with pytest.raises(UsageError, match="closed"):
        run.step_done(6)
    assert _steps_on_disk(tmp_path) == [2, 4]
    run2, *_ = build(tmp_path)
    with run2:
        assert run2.restore() == 4  # the committed steps, untouched


def test_extras_with_a_key_a_checkpoint_cannot_keep_are_refused_naming_the_key(tmp_path: Path) -> None:
    """An int key of extras was saved as a str; restore then refused every checkpoint as damaged, started over
    and replaced them. Now ExtrasError at construction or at the save, naming the entry."""
    from trainer import ExtrasError

    with pytest.raises(ExtrasError, match=r"extras\[0\] is not a str key"):
        Resumable(ResumeConfig.at(tmp_path, save_every=1), model=nn.Linear(2, 1), extras={0: "notes"})
    shared = [1, 2]  # one list under two keys is no cycle
    Resumable(ResumeConfig.at(tmp_path / "ok", save_every=1), model=nn.Linear(2, 1), extras={"a": shared, "b": shared})
    run = Resumable(ResumeConfig.at(tmp_path, save_every=1), model=nn.Linear(2, 1), extras={"ok": 1})
    with run:
        assert run.restore() == 0
        run.extras["nested"] = {"by_rank": {1: 0.5}}
        with pytest.raises(ExtrasError, match=r"extras\['nested'\]\['by_rank'\]\[1\] is not a str key"):
            run.step_done(1)
    assert _steps_on_disk(tmp_path) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_made_before_restore_is_refused_not_replayed(tmp_path: Path, workers: int) -> None:
    """An iterator made before restore() handed out the epoch from its start again (samples trained twice, others
    never). Now the first batch it is asked for after the position moved raises StaleIteratorError."""
    from trainer import StaleIteratorError

    run, model, opt, _ = build(tmp_path)
    with run:
        train(run, model, opt, 4)
    run, model, opt, sampler = build(tmp_path)
    with run:
        early = iter(sampler.loader(DATA, num_workers=workers))
        assert run.restore() == 4
        with pytest.raises(StaleIteratorError, match="made before the data position moved"):
            for _ in range(4):
                next(early)
        fresh = iter(sampler.loader(DATA, num_workers=workers))
        assert torch.equal(next(fresh), DATA[sampler.micro_batches()[0]])  # made after restore: its place


def test_a_loader_over_a_dataset_of_another_size_is_refused() -> None:
    sampler = ElasticSampler(DataConfig(dataset_size=24, global_batch=6))
    with pytest.raises(ValueError, match="the dataset has 30 samples but DataConfig.dataset_size is 24"):
        sampler.loader(torch.zeros(30, 2))
    assert len(list(zip(range(2), sampler.loader(torch.zeros(24, 2)), strict=False))) == 2


def test_a_re_formation_with_no_state_to_go_on_from_restarts_the_worker_not_the_count(tmp_path: Path) -> None:
    """A re-formation after every rank's optimizer had stepped (no live step) and before any checkpoint: the
    restore path started over at step 0 with the stepped model kept (trained twice) and the step count left as it
    was (the next step_done(1) refused). Now it raises, and the agent restarts the worker from step 0."""
    run, model, opt, _ = build(tmp_path)  # save_every=2
    with run:
        assert train(run, model, opt, 1) == 1  # no checkpoint yet
        opt.step()  # the interrupted step's optimizer step, before its collective failed
        with pytest.raises(RuntimeError, match="re-formed with no state to go on from"):
            run._restore_from_checkpoints()  # what reform() runs when catch_up finds no live step


def test_a_fresh_node_does_not_start_over_while_the_shared_tier_cannot_be_listed(tmp_path: Path) -> None:
    """With no step in its own tiers and the shared tier unreadable, the run started from step 0, and its first
    save removed every committed step there. Now, when no rank has a state to send, restore raises."""
    from ckpt import RetryConfig, SharedConfig, SharedStorageError

    fast = RetryConfig(attempts=2, initial=timedelta(seconds=0.01), maximum=timedelta(seconds=0.02),
                       jitter=timedelta(seconds=0.01), deadline=timedelta(seconds=1))
    shared = tmp_path / "shared"
    config = {"shared": SharedConfig(url=str(shared), retry=fast, run_name="r")}
    run, model, opt, _ = build(tmp_path / "node", **config)
    with run:
        assert train(run, model, opt, 4) == 4
        run.checkpointer.wait_uploaded(timedelta(seconds=30))
    (shared / "r").rename(tmp_path / "away")
    (shared / "r").write_bytes(b"")  # the run's directory there is not one: it cannot be listed
    fresh, *_ = build(tmp_path / "fresh", **config)
    with fresh:
        with pytest.raises(SharedStorageError, match="cannot tell whether run .* has checkpoints in the shared"):
            fresh.restore()
    (shared / "r").unlink()
    (tmp_path / "away").rename(shared / "r")
    again, *_ = build(tmp_path / "fresh", **config)
    with again:
        assert again.restore() == 4
