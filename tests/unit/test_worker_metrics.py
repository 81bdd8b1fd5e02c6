"""Worker metrics: the worker's file (elastic/worker_metrics.py), the trainer's goodput ledger
(trainer/telemetry.py) and the agent's view of them (elastic/job_metrics.py), on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic.job_metrics import JobMetrics, WorkersCollector
from elastic.metrics import AgentMetrics
from elastic.worker_metrics import SPECS, WorkerMetrics, file_path
from trainer.telemetry import Telemetry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def recorder(tmp_path: Path, clock: Clock, *, rank: int = 0, local_rank: int = 0, wall: Clock | None = None
             ) -> WorkerMetrics:
    return WorkerMetrics(file_path(tmp_path, local_rank), rank=rank, local_rank=local_rank, restart=0,
                         wall=wall or clock)


def run_steps(t: Telemetry, clock: Clock, first: int, last: int, seconds: float = 0.5) -> None:
    for step in range(first, last + 1):
        clock.now += seconds
        t.step(step)


def test_counters_and_ledger_carry_over_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    t = Telemetry(recorder(tmp_path, clock), samples_per_step=8, tokens_per_sample=128, cadences=(10,), clock=clock)
    t.resumed(0, None)
    run_steps(t, clock, 1, 17)
    t.flush()
    first = json.loads(file_path(tmp_path, 0).read_text())
    assert first["values"]["elastic_train_steps_total"][""] == 17
    assert first["values"]["elastic_train_samples_total"][""] == 17 * 8
    assert first["values"]["elastic_train_tokens_total"][""] == 17 * 8 * 128
    assert first["hist"]["elastic_train_step_seconds"][-1] == pytest.approx(17 * 0.5)

    # The next incarnation (same local rank) resumes from step 10: steps 11..17 are run again.
    t2 = Telemetry(recorder(tmp_path, clock), samples_per_step=8, cadences=(10,), clock=clock)
    assert t2.recorder.get("elastic_train_steps_total") == 17  # carried: the counter does not go back
    assert t2.recorder.get("elastic_train_samples_per_second") == 0.0  # gauges are not carried
    t2.resumed(10, None)
    assert t2.recorder.get("elastic_train_steps_recomputed_total") == 7
    assert t2.recorder.get("elastic_train_lost_seconds_total") == pytest.approx(7 * 0.5)
    assert t2.productive == pytest.approx(10 * 0.5)
    run_steps(t2, clock, 11, 20)
    t2.flush()
    assert t2.recorder.get("elastic_train_steps_total") == 27
    assert t2.recorder.get("elastic_train_samples_per_second") == pytest.approx(16)  # 8 a step, 2 steps a second
    t2.flush()  # close()'s flush right after another: the rate stays, no zero and no spike
    assert t2.recorder.get("elastic_train_samples_per_second") == pytest.approx(16)
    assert t2.recorder.get("elastic_train_productive_seconds") == pytest.approx(20 * 0.5)


def test_restore_between_marks_is_interpolated(tmp_path: Path) -> None:
    clock = Clock()
    t = Telemetry(recorder(tmp_path, clock), cadences=(10,), clock=clock)
    t.resumed(0, None)
    run_steps(t, clock, 1, 30)
    t.resumed(15, None)  # e.g. an older checkpoint than any mark kept: between the marks of 10 and 20
    assert t.productive == pytest.approx(15 * 0.5)
    assert t.recorder.get("elastic_train_steps_recomputed_total") == 15


def test_histogram_buckets_are_le_and_a_recorder_without_a_path_is_off(tmp_path: Path) -> None:
    clock = Clock()
    r = recorder(tmp_path, clock)
    r.observe("elastic_train_step_seconds", 0.001)  # on the first bound: in its bucket
    r.observe("elastic_train_step_seconds", 1e6)  # +Inf
    counts = r.hist["elastic_train_step_seconds"]
    assert counts[0] == 1 and counts[-2] == 1 and counts[-1] == pytest.approx(1e6 + 0.001)
    off = Telemetry(WorkerMetrics(None, rank=0, local_rank=0, restart=0), clock=clock)
    off.resumed(0, None)
    off.step(1)
    off.flush()
    assert not off.on and list(tmp_path.glob("*")) == []


def scrape(collector: WorkersCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_agent_serves_every_worker_series_by_rank(tmp_path: Path) -> None:
    clock = Clock()
    for local_rank in (0, 1):
        t = Telemetry(recorder(tmp_path, clock, rank=4 + local_rank, local_rank=local_rank), samples_per_step=4,
                      tokens_per_sample=16, cadences=(10,), clock=clock)
        t.resumed(0, None)
        run_steps(t, clock, 1, 5)
        t.flush()
    series = scrape(WorkersCollector(tmp_path, started_at=0.0, clock=lambda: 10.0))
    assert {labels["rank"] for labels, _ in series["elastic_train_steps_total"]} == {"4", "5"}
    assert all(v == 5 for _, v in series["elastic_train_step"])
    assert {labels["outcome"] for labels, _ in series["elastic_ckpt_saves_total"]} >= {"ok", "failed", "skipped"}
    inf = [v for labels, v in series["elastic_train_step_seconds_bucket"] if labels["le"] == "+Inf"]
    assert inf == [5, 5]
    assert [v for _, v in series["elastic_goodput_ratio"]] == [pytest.approx(0.25)] * 2  # 2.5 s of steps in 10 s
    for name, spec in SPECS.items():  # every series of the table is exported, with its type's suffix
        if spec.kind != "gauge" or name in ("elastic_train_step", "elastic_train_productive_seconds"):
            suffix = {"counter": "", "histogram": "_count", "gauge": ""}[spec.kind]
            assert name + suffix in series, name


def test_failure_to_first_step_and_the_summary(tmp_path: Path) -> None:
    # All on the host's monotonic clock: an NTP step of the wall clock (an hour back, here) made an 8 s recovery
    # an hour long and the job's elapsed time 0 (a goodput of 1.0).
    wall, mono = Clock(), Clock()
    job = JobMetrics(tmp_path, AgentMetrics.start(None), clock=mono)
    t = Telemetry(recorder(tmp_path, mono, wall=wall), cadences=(10,), clock=mono)
    t.resumed(0, None)
    run_steps(t, mono, 1, 12)  # 6 s of steps
    mono.now += 20.0
    wall.now -= 3600.0
    job.failed(mono.now - 1.0)  # seen a second ago
    job.restarted("worker failure", reformed=False)
    mono.now += 6.5  # the restart and the restore
    t.resumed(10, None)  # the restarted worker (in this process, for the test): steps 11 and 12 are lost
    job.poll()
    assert job._failed_at is not None  # no step since the failure
    run_steps(t, mono, 11, 12)  # one more second of steps: the first after the failure 8 s after it
    job.poll()
    t.flush()  # as Resumable.close does
    mono.now += 10.0
    s = job.summary()
    assert s.recovering_s == pytest.approx(8.0) and s.restarts == {"worker_failure": 1} and s.steps == 12
    assert s.recomputed_steps == 2 and s.recomputed_s == pytest.approx(1.0)
    assert s.elapsed_s == pytest.approx(43.5) and s.goodput == pytest.approx(6.0 / 43.5)
    assert "1 restart (worker_failure 1)" in s.line() and "goodput 0.14" in s.line()


def test_a_restart_with_the_same_members_is_no_re_formation(tmp_path: Path) -> None:
    job = JobMetrics(tmp_path, AgentMetrics.start(None))
    job.restarted("membership change", reformed=False)  # the other node restarted its failed worker
    job.restarted("peer lost", reformed=True)
    s = job.summary()
    assert s.restarts == {"membership_change": 1, "peer_lost": 1} and s.reformations == 1 and s.goodput is None
    assert "2 restarts (membership_change 1, peer_lost 1), 1 re-formation," in s.line()
