"""A real Prometheus scrapes a real elastic-run job of 2 workers (examples/train_tiny.py) through
`--metrics-port`, with deploy/observability/alerts.yml loaded; one worker is SIGKILLed mid-run. Asserted
through Prometheus's HTTP API: the workers' series exist labelled by rank with plausible values, steps
increase, the kill is a restart by cause with its failure-to-first-step time, and the rules evaluate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.faults import Fault
from elastic.etcd_server import free_port
from tests.conftest import REPO, Procs
from tests.integration.tiny_job import TinyJob
from tests.prometheus_fixtures import PrometheusServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # a first run installs the package

KILL_AT = 12
STEPS = 40


@pytest.fixture(scope="module")
def agent_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, agent_port: int) -> Iterator[PrometheusServer]:
    """One Prometheus for the module. It finds the agent as on Slurm: deploy/slurm/node.sh writes the
    node's target file (PROM_SD_DIR; a stand-in launcher, so nothing else runs) for file-based discovery."""
    work = tmp_path_factory.mktemp("prometheus")
    launcher = work / "elastic-run"
    launcher.write_text("#!/bin/sh\nexit 0\n")
    launcher.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "SCONTROL": "/nonexistent/scontrol", "SLURM_JOB_ID": "77",
           "SLURM_NNODES": "1", "SLURMD_NODENAME": "node0", "SLURM_JOB_NODELIST": "node0", "SLURM_TMPDIR": str(work),
           "ELASTIC_RUN": str(launcher), "LOCAL_ADDR": "127.0.0.1", "METRICS_PORT": str(agent_port),
           "PROM_SD_DIR": str(work / "targets")}
    done = subprocess.run([str(REPO / "deploy" / "slurm" / "node.sh"), "run", "train.py"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    target = json.loads((work / "targets" / "elastic-train-77-node0.json").read_text())
    assert target == [{"targets": [f"127.0.0.1:{agent_port}"],
                       "labels": {"slurm_job_id": "77", "run_id": "slurm-77", "node": "node0"}}]
    scrape = {"job_name": "elastic-train", "file_sd_configs": [{"files": [str(work / "targets" / "*.json")]}]}
    server = PrometheusServer(work, [scrape], [REPO / "deploy" / "observability" / "alerts.yml"])
    try:
        yield server
    finally:
        server.stop()


def _last(prometheus: PrometheusServer, expr: str, by: str = "rank") -> dict[str, float]:
    # The job has ended by the time we look: its series went stale with the target, so take their last value.
    return prometheus.values(f"last_over_time({expr}[10m])", by)


def test_prometheus_sees_training_checkpoints_and_the_recovery(procs: Procs, tmp_path: Path,
                                                              prometheus: PrometheusServer, agent_port: int) -> None:
    job = TinyJob(procs, tmp_path, "--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
                  "--step-sleep", "0.1", launcher=("--metrics-port", str(agent_port), "--max-restarts", "1"),
                  faults=[Fault(point="step", step=KILL_AT, rank=1)])
    # While it runs (3 s of steps after the restart, several scrapes): the steps counter only goes up,
    # restart or not, and the restarted pair's steps show up.
    deadline, seen = time.monotonic() + 120, []
    while time.monotonic() < deadline and job.proc.poll() is None:
        seen += list(prometheus.values('elastic_train_steps_total{rank="0"}').values())
        if seen and seen[-1] > KILL_AT + 5 and prometheus.query("elastic_failure_to_step_seconds_count > 0"):
            break
        time.sleep(0.5)
    out = job.finish(timeout=150)
    assert seen == sorted(seen) and seen[-1] > KILL_AT + 5, (seen, out[-2000:])
    time.sleep(1.5)  # the rules' last evaluation over the final scrape

    steps = _last(prometheus, "elastic_train_steps_total")
    assert set(steps) == {"0", "1"} and all(v > KILL_AT for v in steps.values()), steps
    restarts = _last(prometheus, "elastic_restarts_total", by="cause")
    assert restarts["worker_failure"] == 1 and restarts["peer_lost"] == 0, restarts
    recovery = _last(prometheus, "elastic_failure_to_step_seconds_sum", by="job")["elastic-train"]
    assert _last(prometheus, "elastic_failure_to_step_seconds_count", by="job")["elastic-train"] == 1
    assert 0 < recovery < 120, recovery
    restores = prometheus.values("sum by (rank) (last_over_time(elastic_ckpt_restores_total[10m]))")
    assert restores == {"0": 1, "1": 1}, restores  # the restarted pair read one checkpoint each
    assert all(v >= 1 for v in _last(prometheus, 'elastic_ckpt_saves_total{outcome="ok"}').values())
    assert all(v >= 1 for v in _last(prometheus, "elastic_ckpt_persist_seconds_count").values())
    assert set(_last(prometheus, 'elastic_train_step_seconds_bucket{le="+Inf"}')) == {"0", "1"}
    assert all(v > 0 for v in _last(prometheus, "elastic_train_samples_per_second").values())
    goodput = _last(prometheus, "elastic_goodput_ratio")
    assert set(goodput) == {"0", "1"} and all(0 < v <= 1 for v in goodput.values()), goodput
    recomputed = _last(prometheus, "elastic_train_steps_recomputed_total")
    assert all(0 <= v <= KILL_AT for v in recomputed.values()), recomputed
    assert _last(prometheus, "elastic_members", by="node") == {"node0": 1}  # the label of node.sh's target file
    assert _last(prometheus, "elastic_degraded", by="job") == {"elastic-train": 0}
    assert _last(prometheus, "elastic_generation", by="job")["elastic-train"] >= 2  # the restart's new round
    # alerts.yml's recording rules ran over the real series.
    assert set(_last(prometheus, "elastic:step_seconds:mean5m")) == {"0", "1"}

    summary = job.events("job_summary")
    assert len(summary) == 1 and summary[0]["restarts"] == {"worker_failure": 1} and summary[0]["steps"] == STEPS
    assert 0 < summary[0]["goodput"] <= 1 and summary[0]["recovering_s"] == pytest.approx(recovery, abs=0.01)
    assert re.search(rf"job summary: {STEPS} steps, 1 restart \(worker_failure 1\), 0 re-formations", out), out[-2000:]
