"""elastic-chaos output and fault mechanics without a cluster: the report's schema and files, the
byte flips of corrupt-checkpoint (caught by the real checkpointer), the shared-tier outage, and the
reasons a fault is skipped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from chaos import report as rpt
from chaos.inject import Capabilities, flip_bytes, newest_committed, skip_reason
from chaos.schedule import PlannedFault
from ckpt import CheckpointConfig, Checkpointer, CheckpointError

pytestmark = pytest.mark.timeout(60)


def sample_report() -> rpt.Report:
    faults = [
        rpt.FaultRecord(0, "kill-worker", "node1", "global rank 1 (pid 42)", 12, 12, detect_s=0.03, resume_s=3.3,
                        steps_lost=2, restarts=1, injected_t=4.9),
        rpt.FaultRecord(1, "disk-full", None, "group rank 0", 20, None, skipped="no shared tier"),
    ]
    plot = rpt.Plot(steps=[(4.0 + i / 10, i, 1) for i in range(1, 13)] + [(8.0 + i / 10, i, 2) for i in range(11, 21)],
                    worlds=[(3.9, 2), (7.9, 2)], faults=[(4.9, "kill-worker")], recoveries=[8.2], end_t=11.0)
    return rpt.Report(
        passed=True, invariants={"run_completed": True}, not_checked={"final_digest_matches_reference": "world sizes"},
        invariant_details={"run_completed": "2 agents exited 0", "final_digest_matches_reference": "world sizes"},
        faults=faults, reference_digest="ab" * 32, final_digest="ab" * 32, reference_world_size=2,
        final_world_size=2, scenario="smoke", seed=0, config={"nodes": 2, "steps": 20}, duration_s=30.0, plot=plot)


def test_report_files_and_schema(tmp_path: Path) -> None:
    written = rpt.write(sample_report(), tmp_path)
    assert {p.name for p in written} == {"report.json", "report.md", "timeline.png"}
    doc = json.loads((tmp_path / "report.json").read_text())
    assert {"passed", "invariants", "faults", "reference_digest", "final_digest", "not_checked", "error"} <= set(doc)
    assert doc["passed"] is True and doc["invariants"] == {"run_completed": True}
    for fault in doc["faults"]:
        assert {"kind", "node", "at_step", "detect_s", "resume_s", "steps_lost", "skipped"} <= set(fault)
    assert doc["faults"][1]["skipped"] == "no shared tier"
    md = (tmp_path / "report.md").read_text()
    assert "# elastic-chaos: PASSED" in md and "| final_digest_matches_reference | not checked |" in md
    assert "skipped: no shared tier" in md and "![timeline](timeline.png)" in md
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_report_says_so(tmp_path: Path) -> None:
    report = sample_report()
    report.passed, report.invariants = False, {"run_completed": False}
    report.error = "the fault-free reference run failed"
    rpt.write(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "# elastic-chaos: FAILED" in md and "**BROKEN**" in md and "reference run failed" in md


def test_flipped_bytes_are_caught_by_the_checkpointer(tmp_path: Path) -> None:
    state = {"w": torch.arange(256, dtype=torch.float32), "step": 5}
    with Checkpointer(CheckpointConfig(local_dir=str(tmp_path)), rank=0, world_size=1) as ckpt:
        for step in (5, 10):
            ckpt.save(step, state)
            ckpt.commit(step)
    (tmp_path / "step_000000000015").mkdir()  # not committed: never the newest
    step, step_dir = newest_committed(tmp_path)
    assert step == 10 and step_dir is not None
    (state_file,) = step_dir.glob("rank_*/*.safetensors")
    before = state_file.read_bytes()
    offsets = flip_bytes(state_file)
    after = state_file.read_bytes()
    assert len(offsets) == 16 and len(after) == len(before)
    assert [i for i in range(len(before)) if before[i] != after[i]] == offsets
    header = int.from_bytes(before[:8], "little")
    assert min(offsets) >= 8 + header  # the tensor data, not the header
    with pytest.raises(CheckpointError):
        ckpt.load(10, rank=0)
    assert ckpt.load(5, rank=0)["step"] == 5


def test_newest_committed_of_an_empty_dir(tmp_path: Path) -> None:
    assert newest_committed(tmp_path / "missing") == (None, None)


def test_shared_storage_outage_breaks_paths_then_heals(tmp_path: Path) -> None:
    from chaos import inject

    shared = tmp_path / "shared"
    (shared / "run").mkdir(parents=True)
    (shared / "run" / "COMMIT").write_text("x")
    seen: list[bool] = []

    class FakeCluster:
        shared_dir = shared

    def during(hold_s: float) -> None:
        seen.append((shared / "run" / "COMMIT").exists())
        with pytest.raises(NotADirectoryError):
            (shared / "run" / "new").write_text("y")

    fault = PlannedFault(index=0, kind="shared-storage-outage", at_step=1, target=None, hold_s=3.0)
    target = inject.Target(FakeCluster(), None, None, sleep=during)  # type: ignore[arg-type]
    result = inject.inject(fault, target)
    assert seen == [False]
    assert (shared / "run" / "COMMIT").read_text() == "x" and result.skipped is None


def test_skip_reasons() -> None:
    caps = Capabilities(root=True, netns=None, tmpfs=None, shared_flag=None)
    assert skip_reason("kill-worker", caps) is None
    assert "no shared tier" in str(skip_reason("shared-storage-outage", caps))
    assert "no shared tier" in str(skip_reason("disk-full", caps))
    with_shared = Capabilities(root=False, netns="network namespaces need root", tmpfs="needs root",
                               shared_flag="--shared-dir")
    assert skip_reason("shared-storage-outage", with_shared) is None
    assert "needs root" in str(skip_reason("disk-full", with_shared))
    assert "need root" in str(skip_reason("partition-node", with_shared))
    assert skip_reason("partition-node", caps) is None  # root and a working `ip netns`: it runs


def test_read_samples_skips_a_torn_last_line(tmp_path: Path) -> None:
    from chaos.samples import SampleRecord, read_samples

    (tmp_path / "samples-w2-r1-c0-p4242.jsonl").write_text(
        '{"step": 1, "epoch": 0, "rank": 1, "ids": [3, 4]}\n{"step": 2, "epoch": 0, "ra')
    (tmp_path / "notes.txt").write_text("ignored")
    assert read_samples(tmp_path) == [SampleRecord(4242, 1, 1, (3, 4), world=2)]  # the world from the name
    (tmp_path / "drawn-w2-r1-c0-p4242.jsonl").write_text('{"step": 2, "micro": 0, "rank": 1, "ids": [5, 6]}\n')
    assert read_samples(tmp_path) == [SampleRecord(4242, 2, 1, (5, 6), world=2, micro=0),
                                      SampleRecord(4242, 1, 1, (3, 4), world=2)]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_fills_tier_one_then_frees_it(tmp_path: Path) -> None:
    import errno
    import subprocess

    from chaos import inject

    tier1 = tmp_path / "node0"
    tier1.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(tier1)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        class Node:
            name, local_dir = "node0", tier1

        class FakeCluster:
            def node_by_group_rank(self, target: object) -> Node:
                return Node()

        errors: list[int] = []

        def during(hold_s: float) -> None:
            try:
                (tier1 / "checkpoint").write_bytes(b"x" * 65536)
            except OSError as exc:
                errors.append(exc.errno or 0)

        fault = PlannedFault(index=0, kind="disk-full", at_step=1, target=0, hold_s=2.0)
        result = inject.inject(fault, inject.Target(FakeCluster(), None, None, sleep=during))  # type: ignore[arg-type]
        assert errors == [errno.ENOSPC]
        assert result.details["filled_bytes"] >= 3 << 20
        assert not (tier1 / ".elastic-chaos-fill").exists()
        (tier1 / "checkpoint").write_bytes(b"x" * 65536)  # room again
    finally:
        subprocess.run(["umount", "-l", str(tier1)], capture_output=True)
