"""World-size changes 2 -> 1 -> 3 across restarts under elastic-run, on one checkpoint directory.

Checks the two promises of the elastic data position:
- every sample id of an epoch is consumed exactly once by the committed steps, and each step's
  global batch is the one the fixed-world run consumes at that step;
- the optimisation is the same: the loss curve follows the fixed-world (2 workers) run within
  rtol 1e-4 (only the order of floating-point sums differs).

The global batch of 12 divides over 1, 2 and 3 ranks; with --max-micro-batch 4 the ranks
accumulate 3, 2 and 1 micro-batches per step. Dropout and augmentation are off: their random
draws are per rank, so they cannot match across world sizes (see the README's limits).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from core.faults import Fault
from tests.conftest import Procs
from tests.integration.tiny_job import TinyJob

pytestmark = pytest.mark.integration

DATASET, BATCH, STEPS = 126, 12, 30  # 10 steps an epoch; 6 samples an epoch are left over
RTOL = 1e-4


def tiny(procs: Procs, nproc: int, steps: int, work: Path, ckpt: Path, *extra: str,
         faults: tuple[Fault, ...] = (), launcher: tuple[str, ...] = ()) -> TinyJob:
    return TinyJob(procs, work, "--steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "5",
                   "--dataset-size", str(DATASET), "--global-batch", str(BATCH), "--max-micro-batch", "4",
                   "--dropout", "0", *extra, nproc=nproc, faults=faults, samples=work / "samples", launcher=launcher)


def batches(log: Path) -> dict[int, tuple[int, list[int]]]:
    """Step -> (epoch, the step's global batch: the ranks' ids in rank order), of the newest attempt in `log`."""
    newest: dict[tuple[int, int], tuple[int, int, list[int]]] = {}
    for path in log.glob("samples-w*-r*-c*-p*.jsonl"):
        restart = int(re.search(r"-c(\d+)-", path.name)[1])  # type: ignore[index]
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            key = (rec["step"], rec["rank"])
            if key not in newest or restart >= newest[key][0]:
                newest[key] = (restart, rec["epoch"], rec["ids"])
    by_step: dict[int, list[tuple[int, int, list[int]]]] = defaultdict(list)
    for (step, rank), (_, epoch, ids) in newest.items():
        by_step[step].append((rank, epoch, ids))
    return {step: (recs[0][1], [i for _, _, ids in sorted(recs) for i in ids]) for step, recs in by_step.items()}


@pytest.mark.timeout(240)
def test_world_size_2_1_3_consumes_each_sample_once_and_follows_the_fixed_world_run(
    procs: Procs, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    # A job that finishes saves its last step: phases 1 and 2 fail right after their last step instead,
    # so that it is lost. Phase 1 commits 5, 10 and loses 11-13; phase 2 commits 15, 20 and loses 21-22.
    stop = ("--max-restarts", "0")
    phase1 = tiny(procs, 2, 13, tmp_path / "p1", ckpt, launcher=stop,
                  faults=(Fault(point="step", step=13, action="raise"),))
    phase1.finish(ok=False)
    assert [e["step"] for e in phase1.events("fault")] == [13, 13]
    # The fixed-world run goes beside phase 2, whose one worker would leave a core idle.
    reference = tiny(procs, 2, STEPS, tmp_path / "ref", tmp_path / "ref-ckpt")
    phase2 = tiny(procs, 1, 22, tmp_path / "p2", ckpt, "--num-workers", "2", launcher=stop,
                  faults=(Fault(point="step", step=22, action="raise"),))
    phase2.finish(ok=False)
    assert phase2.resumed_from(restart=0) == 10 and phase2.events("worker_started", rank=0, world=1)
    phase3 = tiny(procs, 3, STEPS, tmp_path / "p3", ckpt)
    phase3.finish()
    assert phase3.resumed_from(restart=0) == 20 and phase3.events("worker_started", rank=2, world=3)
    reference.finish()

    # The committed history: each phase up to where the next one resumed (later phases replace replays).
    got = {**batches(tmp_path / "p1" / "samples"), **batches(tmp_path / "p2" / "samples"),
           **batches(tmp_path / "p3" / "samples")}
    assert sorted(got) == list(range(1, STEPS + 1))
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for step, (epoch, ids) in got.items():
        assert len(ids) == BATCH, (step, ids)
        assert epoch == (step - 1) // (DATASET // BATCH), (step, epoch)
        per_epoch[epoch] += ids
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)) == DATASET - DATASET % BATCH, f"epoch {epoch}: a sample twice or skipped"
        assert set(ids) <= set(range(DATASET))
    assert got == batches(tmp_path / "ref" / "samples")  # the same global batch at every step as the fixed-world run
    # The lost steps 11-13 of phase 1 were replayed on the same samples by phase 2.
    lost = {s: b for s, b in batches(tmp_path / "p1" / "samples").items() if s > 10}
    assert lost == {s: got[s] for s in (11, 12, 13)}

    curve = {**phase1.losses(), **phase2.losses(), **phase3.losses()}
    ref_curve = reference.losses()
    assert sorted(curve) == sorted(ref_curve) == list(range(1, STEPS + 1))
    worst = max(abs(curve[s] - ref_curve[s]) / abs(ref_curve[s]) for s in ref_curve)
    assert worst <= RTOL, f"loss curve differs from the fixed-world run by rtol {worst:.2e}"
    assert ref_curve[STEPS] < ref_curve[1]  # it trains: the curve is not flat
