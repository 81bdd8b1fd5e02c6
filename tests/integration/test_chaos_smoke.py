"""`elastic-chaos run` end to end, as a real subprocess: the smoke scenario passes, its faults really
happened (counted), nothing it started is left running; a custom script after `--` works too.

The smoke run is a module fixture: the partition test runs the same job (2 nodes, 40 steps) and
reuses its fault-free reference run (`--reference`) instead of running one of its own; it starts as
soon as the smoke run has recorded that reference, beside the smoke run's chaos job. The custom
script's run starts in the background just before the smoke run: the runs wait much of the time
(agents and workers starting, faults being detected, a step sleep), so side by side they take
little longer than one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from core import procfs
from core.procfs import kill_tree

pytestmark = pytest.mark.integration

CHAOS = Path(sys.prefix) / "bin" / "elastic-chaos"
TINY = Path(__file__).resolve().parent.parent.parent / "examples" / "train_tiny.py"


def start(args: list[str], tmp_path: Path) -> subprocess.Popen[bytes]:
    """Start elastic-chaos with its work dir under tmp_path; its output goes to tmp_path/chaos.out (a file,
    so that a run nobody reads yet never blocks on a full pipe)."""
    with open(tmp_path / "chaos.out", "wb") as out:
        return subprocess.Popen([str(CHAOS), "run", "--report", str(tmp_path / "report"), "--work-dir",
                                 str(tmp_path / "work"), *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a run that is still going: SIGTERM (the harness ends everything it started), then its tree, by pid."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def collect(proc: subprocess.Popen[bytes], tmp_path: Path, timeout: float) -> tuple[int, str, dict]:
    """Wait for a run that `start` began; on timeout end it and fail with its output."""
    report = tmp_path / "report"
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out = (tmp_path / "chaos.out").read_text(errors="replace")
        pytest.fail(f"elastic-chaos did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    out = (tmp_path / "chaos.out").read_text(errors="replace")
    doc = json.loads((report / "report.json").read_text())
    if proc.returncode != 0:
        out += "\n--- report.md ---\n" + (report / "report.md").read_text()
    return proc.returncode, out, doc


def leftovers(marker: Path) -> list[str]:
    """Processes anywhere on the machine whose command line names our work dir: agents and workers."""
    found = []
    for pid in procfs.pids():
        if pid == os.getpid():
            continue
        cmd = procfs.cmdline(pid)
        if str(marker) in cmd and procfs.alive(pid):
            found.append(f"{pid} {cmd[:200]}")
    return found


@dataclass(frozen=True)
class Run:
    rc: int
    out: str
    doc: dict
    tmp_path: Path


CUSTOM = ["--nodes", "2", "--steps", "16", "--ckpt-every", "4", "--faults", "kill-worker@0", "--seed", "3",
          "--timeout", "100", "--",
          str(TINY), "--steps", "{steps}", "--ckpt-dir", "{local_dir}/ckpt", "--ckpt-every", "{ckpt_every}",
          "--global-batch", "{global_batch}", "--dataset-size", "{dataset_size}", "--step-sleep", "0.05"]


@dataclass(frozen=True)
class Started:
    proc: subprocess.Popen[bytes]
    tmp_path: Path


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """The custom script's run, started in the background (before the smoke run: `smoke` asks for it)."""
    tmp_path = tmp_path_factory.mktemp("custom")
    proc = start(CUSTOM, tmp_path)
    try:
        yield Started(proc, tmp_path)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def smoke_started(tmp_path_factory: pytest.TempPathFactory, custom: Started) -> Iterator[Started]:
    """The smoke run, started in the background (after the custom script's: `custom` asks for it first)."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    proc = start(["--scenario", "smoke"], tmp_path)
    try:
        yield Started(proc, tmp_path)
    finally:
        stop(proc)


def recorded_reference(run: Started, into: Path, timeout: float) -> list[str]:
    """`--reference DIR` with a copy of the smoke run's reference in `into`, once its report holds one (written,
    whole, before the chaos job starts), or no flag if the run ended or `timeout` passed without one (then the
    partition run makes its own). A copy: a command line naming the smoke run's directory would count as a
    process the smoke run left behind (`leftovers`)."""
    recorded = run.tmp_path / "report" / "reference.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = recorded.read_text()
            json.loads(text)
        except (OSError, ValueError):  # not there yet, or not whole yet
            if run.proc.poll() is not None:
                return []
            time.sleep(0.5)
            continue
        into.mkdir(parents=True, exist_ok=True)
        (into / "reference.json").write_text(text)
        return ["--reference", str(into)]
    return []


def _netns_works() -> bool:
    if os.geteuid() != 0:
        return False
    from chaos.inject import _probe_netns

    return _probe_netns() is None


@pytest.fixture(scope="module")
def partition(tmp_path_factory: pytest.TempPathFactory, smoke_started: Started) -> Iterator[Started | None]:
    """The partition-node run of the smoke run's job (2 nodes x 1 worker, 40 steps, checkpoint every 5),
    started once the smoke run recorded its reference, to reuse it; None where network namespaces do not work."""
    if not _netns_works():
        yield None
        return
    tmp_path = tmp_path_factory.mktemp("partition")
    proc = start(["--nodes", "2", "--steps", "40", "--faults", "partition-node@last", "--seed", "1",
                  "--timeout", "100", *recorded_reference(smoke_started, tmp_path / "reference", timeout=240)],
                 tmp_path)
    try:
        yield Started(proc, tmp_path)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def smoke(smoke_started: Started, partition: Started | None) -> Run:
    # Typically ~40 s; the harness's own deadlines (120 s per job) end a stuck run with a report first.
    rc, out, doc = collect(smoke_started.proc, smoke_started.tmp_path, timeout=300)
    return Run(rc, out, doc, smoke_started.tmp_path)


@pytest.mark.timeout(570)  # its setup may wait up to 240 s for the smoke run's reference (partition)
def test_smoke_scenario_passes_and_its_faults_happened(smoke: Run) -> None:
    rc, out, doc, tmp_path = smoke.rc, smoke.out, smoke.doc, smoke.tmp_path
    assert rc == 0, out[-4000:]
    assert doc["passed"] is True, json.dumps(doc, indent=1)[:4000]
    assert all(doc["invariants"].values()) and doc["invariants"]["no_orphan_processes"] is True
    kinds = [f["kind"] for f in doc["faults"]]
    assert kinds == ["kill-worker", "corrupt-checkpoint", "kill-node"]
    for fault in doc["faults"]:
        assert fault["skipped"] is None and fault["at_step"] is not None, fault
        assert fault["restarts"] >= 1 and fault["resume_s"] is not None and fault["detect_s"] is not None, fault
        assert fault["steps_lost"] <= (2 if fault["kind"] == "corrupt-checkpoint" else 1) * 5
    corrupt = doc["faults"][1]
    assert corrupt["details"]["exercised"] is True and corrupt["details"]["files"]
    killed = doc["faults"][2]["details"]
    assert killed["pids"] and killed["left_alive"] == []
    assert doc["reference_digest"] and doc["final_digest"]
    assert doc["final_world_size"] == 1 and doc["reference_world_size"] == 2
    assert (tmp_path / "report" / "timeline.png").stat().st_size > 10_000
    assert "PASSED" in (tmp_path / "report" / "report.md").read_text()
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(280)
def test_custom_script_after_double_dash(custom: Started) -> None:
    tmp_path = custom.tmp_path
    rc, out, doc = collect(custom.proc, tmp_path, timeout=260)
    assert rc == 0, out[-4000:]
    assert doc["passed"] is True and doc["invariants"]["final_digest_matches_reference"] is True, doc
    (fault,) = doc["faults"]
    assert fault["kind"] == "kill-worker" and fault["restarts"] >= 1 and fault["steps_lost"] <= 4
    assert any((tmp_path / "work").glob("chaos-3/node*/ckpt/step_*/COMMIT"))
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(610)  # may include the smoke fixture's run
@pytest.mark.skipif(not _netns_works(), reason="partition-node needs root and a working `ip netns`")
def test_partition_node_in_network_namespaces(partition: Started | None) -> None:
    assert partition is not None
    tmp_path = partition.tmp_path
    rc, out, doc = collect(partition.proc, tmp_path, timeout=260)
    assert rc == 0, out[-4000:]
    assert doc["passed"] is True, json.dumps(doc, indent=1)[:4000]
    (fault,) = doc["faults"]
    assert fault["skipped"] is None and fault["restarts"] >= 1 and fault["steps_lost"] <= 5
    assert fault["detect_s"] is not None and fault["detect_s"] >= 1.0  # noticed by the lease running out, not a reset
    assert doc["final_world_size"] == 1
    assert leftovers(tmp_path) == []
    # Only this run's links (its tag): another job's namespaces may exist beside us.
    tag = fault["details"]["namespace"].removeprefix("ecn").rsplit("-", 1)[0]
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    assert f"ecb{tag}" not in links and f"ecv{tag}" not in links, links
