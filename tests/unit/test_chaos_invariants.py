"""elastic-chaos judging, on synthetic event records: records to timeline events, reading the event
files, attempts and the committed line of steps, fault costs, and each invariant kept and broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos import invariants as inv
from chaos import lineage as ln
from chaos import samples as smp
from chaos import timeline as tl
from trainer.data import DataConfig

pytestmark = pytest.mark.timeout(30)

DATA = DataConfig(dataset_size=20 * 12 + 7, global_batch=12, seed=0)


class Log:
    """Builds a job's event records the way the trainer and the agents emit them (every rank emits
    its worker events; the harness keeps rank 0's), one record per tick, and the timeline events
    they stand for."""

    def __init__(self) -> None:
        self.t = 0.0
        self.world = 2
        self.records: list[tuple[str, dict[str, object]]] = []
        self.events: list[tl.Event] = []

    def emit(self, event: str, node: str = "node0", dt: float = 0.1, **fields: object) -> Log:
        self.t += dt
        record = {"event": event, "ts": self.t, "pid": 1, **fields}
        self.records.append((node, record))
        self.events.extend(tl.from_record(record, node))
        return self

    def _ranks(self, event: str, **fields: object) -> Log:
        for rank in range(self.world):
            self.emit(event, "node0" if rank == 0 else "node1", rank=rank, world=self.world, pid=100 + rank, **fields)
        return self

    def worker(self, rank: int, world: int, *, pid: int, restart: int = 0, node: str | None = None) -> Log:
        return self.emit("worker_started", node or ("node0" if rank == 0 else "node1"), rank=rank, world=world,
                         local_rank=0, restart=restart, pid=pid)

    def start(self, world: int = 2, resumed: int | None = None, node: str = "node0") -> Log:
        self.world = world
        for rank in range(world):
            self.worker(rank, world, pid=100 + rank, node=node if rank == 0 else "node1")
        if resumed is not None:
            self.resumed(resumed)
        return self

    def resumed(self, step: int) -> Log:
        return self._ranks("resumed", step=step)

    def steps(self, first: int, last: int, loss: float = 1.0) -> Log:
        for s in range(first, last + 1):
            self._ranks("step", step=s, loss=loss)
        return self

    def digest(self, digest: str) -> Log:
        return self._ranks("final_digest", step=0, digest=digest)

    def skipped(self, step: int, reason: str, node: str) -> Log:
        return self.emit("ckpt_skipped", node, rank=1, step=step, reason=reason)


def evidence(log: Log, *, steps: int = 20, faults: list[inv.FaultOutcome] | None = None,
             orphans: list[str] | None = None,
             final: str = "ab", reference: str = "ab", ref_world: int = 2, ref_loss: float = 1.0) -> inv.Evidence:
    runs = ln.attempts(log.events)
    return inv.Evidence(
        steps=steps, ckpt_every=5, data=DATA, completed=True, completion_detail="2 agents exited 0",
        lineage=ln.lineage(runs, 5), events=log.events, faults=faults or [], orphans=orphans or [],
        final_digest=final, reference_digest=reference, reference_world=ref_world,
        reference_losses={s: ref_loss for s in range(1, steps + 1)},
    )


def test_records_become_timeline_events() -> None:
    def one(**record: object) -> list[tl.Event]:
        return tl.from_record({"ts": 1.0, "pid": 77, **record}, "n")

    assert one(event="step", rank=0, step=12, loss=0.25) == [tl.Step(1.0, "n", 12, 0.25)]
    # rank 0 speaks for the group; another rank's step only fills in one rank 0 did not report (lineage.attempts)
    assert one(event="step", rank=1, step=3, loss=1.5) == [tl.PeerStep(1.0, "n", 3, 1.5, 1)]
    assert one(event="worker_started", rank=1, world=2, restart=3) == [tl.WorkerStart(1.0, "n", 1, 2, 77, 3)]
    assert one(event="resumed", rank=0, step=10) == [tl.Resumed(1.0, "n", 10)]
    assert one(event="final_digest", rank=0, step=20, digest="ABCdef01") == [tl.Digest(1.0, "n", "abcdef01")]
    skipped = one(event="ckpt_skipped", rank=1, step=15, reason="checksum of /x/state.safetensors differs")
    assert skipped == [tl.CheckpointSkipped(1.0, "n", 15, "checksum of /x/state.safetensors differs")]
    (event,) = one(event="hang_detected", local_rank=0, global_rank=1)
    assert isinstance(event, tl.AgentEvent) and event.name == "hang_detected" and event.fields["pid"] == 77
    # The agent saw the failure `recovery_s` before it reports the new workers running.
    recovered, seen = one(event="recovered", recovery_s=0.75, world_size=1)
    assert isinstance(recovered, tl.AgentEvent) and seen == tl.FailureSeen(0.25, "n")
    assert one(event="unrelated noise", step=1) == []
    assert one(event="step", rank=0) == []  # no step field: not a step
    assert tl.from_record({"event": "step", "ts": 101.5, "rank": 0, "step": 1}, "n", offset=100.0)[0].t == 1.5


def test_timeline_reads_the_event_files_of_every_node(tmp_path: Path) -> None:
    log = Log().start().steps(1, 3)
    log.emit("recovered", "node1", recovery_s=0.05, world_size=2)
    timeline = tl.Timeline(offset=0.0)
    files: dict[str, object] = {}
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
        timeline.watch(node, tmp_path / node)
        files[node] = open(tmp_path / node / "events-1.jsonl", "w")  # noqa: SIM115 - closed below
    half = len(log.records) // 2
    for node, record in log.records[:half]:
        files[node].write(json.dumps(record) + "\n")  # type: ignore[attr-defined]
    files["node0"].write('{"event": "step", "ts": 9.0, "ra')  # type: ignore[attr-defined]  # a line being written
    for f in files.values():
        f.flush()  # type: ignore[attr-defined]
    early = timeline.events()
    assert early == sorted((e for _, r in log.records[:half] for e in tl.from_record(r, _)), key=lambda e: e.t)
    files["node0"].write('nk": 0, "step": 99}\n')  # type: ignore[attr-defined]  # ... completed later
    for node, record in log.records[half:]:
        files[node].write(json.dumps(record) + "\n")  # type: ignore[attr-defined]
    for f in files.values():
        f.close()  # type: ignore[attr-defined]
    latest = timeline.latest_step()
    assert latest is not None and latest.step == 99 and latest.t == 9.0
    expected = sorted([*log.events, tl.Step(9.0, "node0", 99, None)], key=lambda e: e.t)
    assert timeline.events() == expected
    assert timeline.load() == expected  # read whole, through core.events.read_events
    assert any(isinstance(e, tl.FailureSeen) and e.node == "node1" for e in expected)
    with open(tmp_path / "node1" / "events-2.jsonl", "w") as f:
        f.write('{"event": "step", "ts": 10.0, "rank": 0, "step": 100}\n{"event": "step", "ts": 11')  # torn
    assert timeline.load()[-1] == tl.Step(10.0, "node1", 100, None)


def test_a_clean_run_keeps_every_invariant() -> None:
    log = Log().start().steps(1, 20).digest("ab")
    checks = inv.check_all(evidence(log))
    assert {k: c.ok for k, c in checks.items()} == {k: True for k in checks}, checks
    assert "20 step losses equal" in checks["data_exactly_once_per_epoch"].detail


def test_restart_cuts_the_lineage_back_and_counts_lost_steps() -> None:
    log = Log().start().steps(1, 13).start(resumed=10).steps(11, 20)
    runs = ln.attempts(log.events)
    assert [(a.world, a.resumed_from, len(a.steps)) for a in runs] == [(2, 0, 13), (2, 10, 10)]
    lin = ln.lineage(runs, 5)
    assert sorted(lin.steps) == list(range(1, 21)) and lin.problems == []
    assert [n for _, n in lin.lost] == [3]
    cost = ln.fault_cost(log.events, runs, lin, start=runs[0].steps[-1].t + 0.01, end=float("inf"))
    assert cost.steps_lost == 3 and cost.restarts == 1 and cost.resume_s is not None and cost.resume_s > 0


def test_a_step_rank_0_was_killed_in_is_committed_by_the_peers_that_completed_it() -> None:
    # World 3; rank 0 is killed after step 11's all-reduce, before it reports step 11; ranks 1 and 2 complete
    # step 11 and re-form in place from it at world 2 (the new rank 0 reports `reformed` at step 11).
    log = Log().start(world=3).steps(1, 10)
    log.emit("step", "node1", rank=1, world=3, pid=101, step=11, loss=1.0)
    log.emit("step", "node1", rank=2, world=3, pid=102, step=11, loss=1.0)
    log.world = 2
    log._ranks("reformed", step=11, generation=2)
    log.steps(12, 20)
    runs = ln.attempts(log.events)
    assert [(a.world, a.resumed_from, a.steps[-1].step) for a in runs] == [(3, 0, 11), (2, 11, 20)]
    lin = ln.lineage(runs, 5)
    assert sorted(lin.steps) == list(range(1, 21)) and lin.problems == [] and lin.steps[11].world == 3
    # Only the step right after rank 0's last one: a peer's later step is not rank 0's to have missed.
    log = Log().start().steps(1, 10)
    log.emit("step", "node1", rank=1, world=2, pid=101, step=12, loss=1.0)
    assert ln.attempts(log.events)[0].steps[-1].step == 10


def test_a_restart_without_a_resume_line_starts_from_zero() -> None:
    log = Log().start().steps(1, 13).start(world=1).steps(1, 20)
    lin = ln.lineage(ln.attempts(log.events), 5)
    assert [n for _, n in lin.lost] == [13]
    ev = evidence(log, faults=[inv.FaultOutcome(kind="kill-node", injected=True, skipped=None, steps_lost=13,
                                                lost_bound=1)])
    check = inv.steps_lost_within(ev)
    assert check.ok is False and "kill-node: 13 steps lost > 5" in check.detail


def test_steps_run_while_the_newest_save_was_being_written_are_allowed_on_top_of_the_interval() -> None:
    # Killed at step 12 while step 10's save was still being written: the restore can only use
    # step 5, so 7 steps are lost, 2 of them allowed because step 10 had not committed yet.
    log = Log().start().steps(1, 12).start(world=1, resumed=5).steps(6, 20)
    fault = inv.FaultOutcome(kind="kill-worker", injected=True, skipped=None, steps_lost=7, lost_bound=1, in_flight=2)
    check = inv.steps_lost_within(evidence(log, faults=[fault]))
    assert check.ok is True and "kill-worker 7 (2 run while a save was being written)" in check.detail
    strict = inv.FaultOutcome(**{**fault.__dict__, "in_flight": 1})
    check = inv.steps_lost_within(evidence(log, faults=[strict]))
    assert check.ok is False and "7 steps lost > 6 (5 + 1 run while a save was being written)" in check.detail


def test_a_resume_older_than_the_step_every_node_held_breaks_the_bound_even_within_the_interval() -> None:
    # The chaos mutation audit of stop 48: a restore that went one committed step too old lost fewer steps than an
    # interval, and the run passed. Killed at step 12 with step 11 in every node's tier 0: resuming from 10 is wrong.
    log = Log().start().steps(1, 12).start(world=1, resumed=10).steps(11, 20)
    fault = inv.FaultOutcome(kind="kill-worker", injected=True, skipped=None, steps_lost=2, lost_bound=1,
                             held_everywhere=11, resumed_from=10)
    check = inv.steps_lost_within(evidence(log, faults=[fault]))
    assert check.ok is False and "resumed from step 10, older than step 11" in check.detail, check
    newest = inv.FaultOutcome(**{**fault.__dict__, "resumed_from": 11})
    assert inv.steps_lost_within(evidence(log, faults=[newest])).ok is True
    # A lost node's memory goes with it: the step the others held is no promise there.
    lost_node = inv.FaultOutcome(**{**fault.__dict__, "kind": "kill-node"})
    assert inv.steps_lost_within(evidence(log, faults=[lost_node])).ok is True


def test_skipped_and_repeated_steps_break_exactly_once() -> None:
    gap = Log().start().steps(1, 12).start(resumed=10).steps(12, 20)  # step 11 never ran
    check = inv.data_exactly_once(evidence(gap))
    assert check.ok is False and "step 12 follows step 10 (steps skipped)" in check.detail

    beyond = Log().start().steps(1, 8).start(resumed=10).steps(11, 20)  # resumed past what was reached
    assert "only reached step 8" in str(inv.data_exactly_once(evidence(beyond)).detail)

    odd = Log().start().steps(1, 13).start(resumed=12).steps(13, 20)  # 12 is no checkpoint step
    assert "not a checkpoint step" in str(inv.data_exactly_once(evidence(odd)).detail)

    short = Log().start().steps(1, 18)
    assert "steps never committed: 19-20" in str(inv.data_exactly_once(evidence(short)).detail)


def test_a_different_loss_means_a_different_batch_or_state() -> None:
    log = Log().start().steps(1, 13).start(resumed=10).steps(11, 20, loss=2.0)
    check = inv.data_exactly_once(evidence(log))
    assert check.ok is False and "step 11: loss 2.0 != reference 1.0" in check.detail


def test_sampler_replay_covers_each_epoch_once() -> None:
    assert inv._replay_sampler(DATA, 60) == []  # noqa: SLF001 - the replay itself


def test_digest_is_compared_only_at_the_reference_world_size() -> None:
    same = evidence(Log().start().steps(1, 20), final="ab", reference="ab")
    assert inv.digest_matches(same).ok is True
    differs = evidence(Log().start().steps(1, 20), final="ab", reference="cd")
    assert inv.digest_matches(differs).ok is False
    shrunk = Log().start().steps(1, 13).start(world=1, resumed=10).steps(11, 20)
    check = inv.digest_matches(evidence(shrunk, final="ab", reference="cd"))
    assert check.ok is None and "world sizes [1, 2]" in check.detail
    assert inv.digest_matches(evidence(Log().start().steps(1, 20), final=None)).ok is None  # type: ignore[arg-type]


def test_resuming_from_a_corrupted_step_is_caught() -> None:
    log = Log().start().steps(1, 17)
    corrupted_at = log.t
    log.skipped(15, "checksum mismatch", node="node1").start(resumed=10).steps(11, 20)
    fault = inv.FaultOutcome(kind="corrupt-checkpoint", injected=True, skipped=None, steps_lost=7, lost_bound=2,
                             injected_t=corrupted_at, corrupted_step=15, corrupted_node="node1", exercised=True,
                             corrupted_ranks=(1,))
    assert inv.no_corrupt_restore(evidence(log, faults=[fault])).ok is True
    assert inv.steps_lost_within(evidence(log, faults=[fault])).ok is True  # 7 <= 2 intervals

    # Resumed from the corrupted step, and the state is not the one from before: corrupt data.
    bad = Log().start().steps(1, 17)
    t = bad.t
    bad.start(resumed=15).steps(16, 20, loss=9.9)
    fault = inv.FaultOutcome(kind="corrupt-checkpoint", injected=True, skipped=None, steps_lost=2, lost_bound=2,
                             injected_t=t, corrupted_step=15, corrupted_node="node1", exercised=False,
                             corrupted_ranks=(1,))
    check = inv.no_corrupt_restore(evidence(bad, faults=[fault]))
    assert check.ok is False and "resumed from step 15" in check.detail and "rank files [1]" in check.detail
    # ... but not when the damaged files belong to ranks the node no longer holds
    moved = inv.FaultOutcome(**{**fault.__dict__, "corrupted_ranks": (3,)})
    assert inv.no_corrupt_restore(evidence(bad, faults=[moved])).ok is True
    assert "no restore ever read the corrupted step 15" in inv.all_injected(evidence(bad, faults=[fault])).detail


def test_resuming_a_corrupted_step_from_an_intact_copy_is_fine() -> None:
    # The local copy is damaged and rejected; another copy (the shared tier's) serves the resume.
    log = Log().start().steps(1, 17)
    t = log.t
    log.start(resumed=None)
    log.skipped(15, "local copy of rank 1 is unusable", node="node1")
    log.resumed(15).steps(16, 20)
    fault = inv.FaultOutcome(kind="corrupt-checkpoint", injected=True, skipped=None, steps_lost=2, lost_bound=2,
                             injected_t=t, corrupted_step=15, corrupted_node="node1", exercised=True,
                             corrupted_ranks=(1,))
    check = inv.no_corrupt_restore(evidence(log, faults=[fault]))
    assert check.ok is True and "node1 rejected its damaged copy and restored another one" in check.detail

    # No rejection seen, but the steps after the resume repeat their losses: the data was intact.
    quiet = Log().start().steps(1, 17)
    t = quiet.t
    quiet.start(resumed=15).steps(16, 20)
    check = inv.no_corrupt_restore(evidence(quiet, faults=[inv.FaultOutcome(**{**fault.__dict__, "injected_t": t})]))
    assert check.ok is True and "restored from an intact copy (losses of steps [16, 17]" in check.detail


def test_a_step_written_again_after_corruption_may_be_restored() -> None:
    log = Log().start().steps(1, 17)
    t = log.t
    log.start(resumed=10).steps(11, 17).start(resumed=15).steps(16, 20)
    fault = inv.FaultOutcome(kind="corrupt-checkpoint", injected=True, skipped=None, steps_lost=7, lost_bound=2,
                             injected_t=t, corrupted_step=15, corrupted_node="node1", exercised=True,
                             corrupted_ranks=(1,))
    assert inv.no_corrupt_restore(evidence(log, faults=[fault])).ok is True


def test_a_corruption_left_unread_counts_only_when_a_newer_intact_state_was_resumed() -> None:
    # The damaged step 45 is never read: the resume went on from step 50 (another node's tier-0 snapshot).
    log = Log().start().steps(1, 50)
    t = log.t
    log.start(resumed=50).steps(51, 55)
    unread = inv.FaultOutcome(kind="corrupt-checkpoint", injected=True, skipped=None, steps_lost=1, lost_bound=2,
                              injected_t=t, corrupted_step=45, corrupted_node="node1", exercised=False,
                              corrupted_ranks=(1,))
    check = inv.all_injected(evidence(log, faults=[unread]))
    assert check.ok is False and "no restore ever read the corrupted step 45" in check.detail
    superseded = inv.FaultOutcome(**{**unread.__dict__, "superseded_by": 50})
    check = inv.all_injected(evidence(log, faults=[superseded]))
    assert check.ok is True and "step 45 by 50" in check.detail


def test_orphans_and_unfired_faults_fail() -> None:
    log = Log().start().steps(1, 20)
    assert inv.no_orphans(evidence(log, orphans=["123 python train_tiny.py"])).ok is False
    unfired = inv.FaultOutcome(kind="kill-worker", injected=False, skipped=None, steps_lost=0, lost_bound=1)
    skipped = inv.FaultOutcome(kind="disk-full", injected=False, skipped="no shared tier", steps_lost=0, lost_bound=1)
    assert inv.all_injected(evidence(log, faults=[unfired])).ok is False
    check = inv.all_injected(evidence(log, faults=[skipped]))
    assert check.ok is True and "1 skipped with a reason" in check.detail


def test_an_unfinished_run_fails() -> None:
    log = Log().start().steps(1, 20)
    ev = evidence(log)
    unfinished = inv.Evidence(**{**ev.__dict__, "completed": False, "completion_detail": "timed out"})
    assert inv.run_completed(unfinished) == inv.Check(False, "timed out")
    assert inv.run_completed(evidence(Log().start().steps(1, 12))).ok is False


def _records(log: Log, data: DataConfig, *, tamper: dict[int, list[int]] | None = None) -> list[smp.SampleRecord]:
    """What the trainer's sample log holds: per worker pid, per step, each rank's slice of the global batch."""
    from trainer.data import ElasticSampler

    runs = ln.attempts(log.events)
    pids = {i: [e.pid for e in log.events if isinstance(e, tl.WorkerStart)
                and min(range(len(runs)), key=lambda j: abs(runs[j].start_t - e.t)) == i] for i in range(len(runs))}
    out = []
    for i, attempt in enumerate(runs):
        sampler = ElasticSampler(data, rank=0, world_size=1)
        for _ in range(attempt.resumed_from):
            sampler.advance()
        for step in attempt.steps:
            ids = (tamper or {}).get(step.step, sampler.global_indices())
            half = len(ids) // 2
            for rank, pid in enumerate(pids[i]):
                out.append(smp.SampleRecord(pid, step.step, rank, tuple(ids[rank * half:(rank + 1) * half])))
            sampler.advance()
    return out


def test_logged_samples_prove_exactly_once() -> None:
    log = Log().start().steps(1, 13)
    log.worker(0, 2, pid=200, restart=1).worker(1, 2, pid=201, restart=1)
    log.resumed(10).steps(11, 20)
    runs = ln.attempts(log.events)
    lin = ln.lineage(runs, 5)
    consumed, problems = smp.consumed_by_step(log.events, runs, lin, _records(log, DATA))
    assert problems == [] and sorted(consumed) == list(range(1, 21))
    ev = inv.Evidence(**{**evidence(log).__dict__, "consumed": consumed})
    check = inv.data_exactly_once(ev)
    assert check.ok is True and "sample ids logged by the workers for 20 committed steps" in check.detail

    # The resumed attempt re-consumes step 10's samples at step 11: a data position restored wrong.
    from trainer.data import ElasticSampler

    sampler = ElasticSampler(DATA, rank=0, world_size=1)
    for _ in range(9):
        sampler.advance()
    tampered = _records(log, DATA, tamper={11: sampler.global_indices()})
    consumed, problems = smp.consumed_by_step(log.events, runs, lin, tampered)
    ev = inv.Evidence(**{**evidence(log).__dict__, "consumed": consumed})
    check = inv.data_exactly_once(ev)
    assert check.ok is False and "step 11: samples" in check.detail and "consumed twice in epoch 0" in check.detail


def test_missing_sample_records_are_reported() -> None:
    log = Log().start().steps(1, 20)
    runs = ln.attempts(log.events)
    records = [r for r in _records(log, DATA) if r.step != 7]
    consumed, problems = smp.consumed_by_step(log.events, runs, ln.lineage(runs, 5), records)
    assert problems == ["no sample record for committed step 7"] and 7 not in consumed


def test_a_rank_killed_inside_a_step_its_peers_completed_counts_with_the_samples_it_drew() -> None:
    # Rank 1 drew step 12's micro-batches (its gradients went into the all-reduce: its peer completed step 12)
    # and was killed before it recorded the step; step 13 it drew only in part, and step 13 never completed.
    log = Log().start().steps(1, 12)
    runs = ln.attempts(log.events)
    full = _records(log, DATA)
    pid1 = next(r.pid for r in full if r.rank == 1)
    step12 = next(r for r in full if r.rank == 1 and r.step == 12)
    records = [r for r in full if (r.rank, r.step) != (1, 12)]
    lin = ln.lineage(runs, 5)
    _, problems = smp.consumed_by_step(log.events, runs, lin, records)
    assert problems == ["step 12: sample records of ranks [0], expected 0..1"]
    drawn = [smp.SampleRecord(pid1, 12, 1, step12.ids[:3], micro=0), smp.SampleRecord(pid1, 12, 1, step12.ids[3:],
                                                                                         micro=1)]
    consumed, problems = smp.consumed_by_step(log.events, runs, lin, records + drawn)
    assert problems == [] and inv._check_consumed(consumed, DATA) == []
    # Micro-batch 0 alone is not the rank's part of the step: still reported.
    _, problems = smp.consumed_by_step(log.events, runs, lin, records + drawn[1:])
    assert problems == ["step 12: sample records of ranks [0], expected 0..1"]


def test_a_replacement_that_started_before_its_peer_re_formed_in_place_counts_in_that_attempt() -> None:
    # Rank 1 (pid 101) is killed after step 10; its replacement (pid 300) starts, then rank 0 (pid 100), kept,
    # re-forms in place: it says `resumed` (its restore), then `reformed`, a millisecond apart. Both are one
    # attempt; the replacement, which started before either, consumed rank 1's part of steps 9-15.
    log = Log().start().steps(1, 10)
    log.worker(1, 2, pid=300, restart=1)
    log.emit("resumed", "node0", dt=0.04, rank=0, step=8, pid=100)
    log.emit("reformed", "node0", dt=0.001, rank=0, world=2, step=8, pid=100)
    log.steps(9, 15)
    runs = ln.attempts(log.events)
    assert [(a.resumed_from, a.in_place, [s.step for s in a.steps][:1]) for a in runs] == [(0, False, [1]),
                                                                                         (8, True, [9])]
    from trainer.data import ElasticSampler

    sampler = ElasticSampler(DATA, rank=0, world_size=1)
    records = []
    for step in range(1, 16):
        ids = sampler.global_indices()
        half = len(ids) // 2
        pids = (100, 101) if step <= 10 else (100, 300)
        if step in (9, 10):  # run twice: by the first workers, then again after the resume from 8
            records += [smp.SampleRecord(pid, step, rank, tuple(ids[rank * half:(rank + 1) * half]))
                        for rank, pid in enumerate((100, 300))]
        records += [smp.SampleRecord(pid, step, rank, tuple(ids[rank * half:(rank + 1) * half]))
                    for rank, pid in enumerate(pids)]
        sampler.advance()
    consumed, problems = smp.consumed_by_step(log.events, runs, ln.lineage(runs, 5), records)
    assert problems == [] and sorted(consumed) == list(range(1, 16))


def _job(log: Log):  # type: ignore[no-untyped-def]
    from chaos.judge import JobResult

    runs = ln.attempts(log.events)
    digests = [e.digest for e in log.events if isinstance(e, tl.Digest)]
    return JobResult(log.events, runs, ln.lineage(runs, 5), True, "ok", digests[-1] if digests else None,
                     runs[-1].world, log.t, 0.0, [])


def test_reference_is_the_first_attempt_that_finished() -> None:
    from chaos.config import ChaosConfig
    from chaos.judge import ChaosError, reference_of

    config = ChaosConfig(report_dir=Path("/tmp"), steps=20)
    clean = Log().start().steps(1, 20).digest("aa")
    ref = reference_of(_job(clean), config)
    assert (ref.digest, ref.world, ref.notes) == ("aa", 2, []) and len(ref.losses) == 20

    # restarted after it had finished (e.g. hang detection during worker shutdown): the first digest counts
    after = Log().start().steps(1, 20).digest("aa")
    after.emit("hang_detected", local_rank=0, global_rank=0).start(resumed=15).steps(16, 20)
    after.digest("bb")
    ref = reference_of(_job(after), config)
    assert ref.digest == "aa" and "restarted after it had finished (hang_detected)" in ref.notes[0]

    midway = Log().start().steps(1, 12).start(resumed=10).steps(11, 20).digest("cc")
    with pytest.raises(ChaosError, match="restarted mid-run"):
        reference_of(_job(midway), config)


def _killed_worker_run(*, node0_restarts: bool, fallback: bool = False, in_place: bool = True,
                       kind: str = "kill-worker", node0_judged_hung: bool = False,
                       expected: bool = False) -> inv.Evidence:
    """2 nodes; rank 1's worker (node1) is killed (or, `kind` hang-worker, stopped) at t=5: its node replaces it,
    node0 re-forms in place (or, with `node0_restarts`, starts a new process too)."""
    log = Log().start().steps(1, 5)
    fault = inv.FaultOutcome(kind=kind, injected=True, skipped=None, steps_lost=0, lost_bound=1,
                             injected_t=log.t + 0.05, node="node1")
    if kind == "hang-worker":
        log.emit("hang_detected", "node1", local_rank=0, stopped=True)
    if node0_judged_hung:
        log.emit("hang_detected", "node0", local_rank=0, stopped=False)
    if in_place:
        log.emit("restart", "node1", replaced=[0], warm_spare=True)
        log.emit("reform", "node0")
    if fallback:
        log.emit("reform_fallback", "node0", local_rank=0)
    log.worker(0, 2, pid=300 if node0_restarts else 100, node="node0")
    log.worker(1, 2, pid=201, node="node1")
    log.steps(6, 20).digest("ab")
    return inv.Evidence(**{**evidence(log, faults=[fault]).__dict__, "in_process_expected": expected})


def test_only_the_hit_process_restarts_after_a_worker_kill() -> None:
    kept = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=False))
    assert kept.ok is True, kept
    broken = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=True))
    assert broken.ok is False and "node0" in broken.detail and "[300]" in broken.detail, broken
    excused = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=True, fallback=True))
    assert excused.ok is True and "judged stuck or hung" in excused.detail, excused
    restart_mode = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=True, in_place=False))
    assert restart_mode.ok is None, restart_mode
    # In-process expected (--reform in-process, the default script), yet every worker restarted: broken, not
    # "not checked" (the chaos mutation audit of stop 48 switched in-process off and the run still passed).
    switched_off = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=True, in_place=False,
                                                                     expected=True))
    assert switched_off.ok is False and "kill-worker" in switched_off.detail, switched_off
    kept = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=False, expected=True))
    assert kept.ok is True, kept


def test_a_stopped_workers_blocked_peer_judged_hung_is_not_excused() -> None:
    """hang-worker SIGSTOPs node1's worker: its agent judges it at half the timeout, so node0's worker, blocked in a
    collective with it, re-forms in place. node0's agent judging its own worker hung (and restarting it) broke that;
    after another fault, a worker judged hung on a node it did not hit is still excused."""
    kept = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=False, kind="hang-worker"))
    assert kept.ok is True, kept
    broken = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=True, kind="hang-worker",
                                                               node0_judged_hung=True))
    assert broken.ok is False and "hang-worker on node1" in broken.detail and "[300]" in broken.detail, broken
    other = inv.only_hit_processes_restart(_killed_worker_run(node0_restarts=True, node0_judged_hung=True))
    assert other.ok is True and "judged stuck or hung" in other.detail, other


def test_a_killed_checkpoint_helper_must_be_started_again_by_its_agent() -> None:
    log = Log().start().steps(1, 12)
    t = log.t
    log.steps(13, 20)
    fault = inv.FaultOutcome(kind="kill-ckpt-helper", injected=True, skipped=None, steps_lost=0, lost_bound=1,
                             injected_t=t, node="node1")
    check = inv.all_injected(evidence(log, faults=[fault]))
    assert check.ok is False and "the agent of node1 never started a new checkpoint helper" in check.detail
    log.events.append(tl.AgentEvent(t + 0.5, "node1", "ckpt_helper_restarted", {"dead_pid": 7}))
    assert inv.all_injected(evidence(log, faults=[fault])).ok is True


def test_a_resume_from_a_damaged_tier0_snapshot_newer_than_the_damaged_disk_step_is_caught() -> None:
    """The corruption damages the disk's newest step (15) and the node's tier-0 snapshots (16, 17). Only 15 was
    checked: a restore that loaded the damaged snapshot of 17 was judged 'superseded by 17' and passed (a
    mutation that ignored checksum mismatches went unseen)."""
    bad = Log().start().steps(1, 17)
    t = bad.t
    bad.start(resumed=17).steps(18, 20, loss=9.9)
    fault = inv.FaultOutcome(kind="corrupt-checkpoint", injected=True, skipped=None, steps_lost=0, lost_bound=2,
                             injected_t=t, corrupted_step=15, corrupted_node="node1", exercised=False,
                             corrupted_ranks=(1,), damaged_steps=(15, 16, 17))
    check = inv.no_corrupt_restore(evidence(bad, faults=[fault]))
    assert check.ok is False and "resumed from step 17" in check.detail


def test_a_corruption_is_superseded_only_by_a_step_newer_than_every_damaged_copy() -> None:
    from chaos import judge

    assert judge.damaged_steps({"corrupted_step": 15, "damaged_steps": [17, 15, 16]}) == (15, 16, 17)
    assert judge.damaged_steps({"corrupted_step": 15}) == (15,)  # a report from before tier 0 was tracked


def test_a_fault_that_landed_after_the_jobs_last_step_is_not_judged_for_restarts() -> None:
    """kill-node@last planned at step 36 of 40; on a loaded machine the harness saw the step late, and by the kill
    the survivor had done step 40: its finished worker restarted on the membership change, by design (seen in a
    stress run of the suite). The same restart before the last step still breaks the invariant."""
    def run(last_step_first: bool) -> inv.Evidence:
        log = Log().start().steps(1, 20 if last_step_first else 19)
        fault = inv.FaultOutcome(kind="kill-node", injected=True, skipped=None, steps_lost=0, lost_bound=1,
                                 injected_t=log.t + 0.05, node="node1")
        log.emit("restart", "node1", replaced=[0], warm_spare=True)  # an earlier re-formation in place
        log.worker(0, 1, pid=300, node="node0")
        if not last_step_first:
            log.steps(20, 20)
        return evidence(log.digest("ab"), faults=[fault])

    late = inv.only_hit_processes_restart(run(last_step_first=True))
    assert late.ok is True and "kill-node on node1 landed after the job's last step" in late.detail, late
    early = inv.only_hit_processes_restart(run(last_step_first=False))
    assert early.ok is False and "[300]" in early.detail, early
