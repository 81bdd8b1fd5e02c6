"""Sharded training (examples/train_fsdp.py: FSDP2, TP, 2-D) under elastic-run: exact resume and resharding.

- FSDP2 at 2 ranks, a worker SIGKILLed mid-run: the final global digest equals the uninterrupted
  run's bit for bit (dropout on: the RNG streams are restored exactly on the saved layout).
- One checkpoint directory through world sizes 2 -> 3 -> 1 (1-D FSDP), another through layouts
  FSDP 2 x TP 2 -> FSDP 3 -> TP 2 alone, side by side: every sample id of an epoch consumed once by
  the committed steps, the same global batch at every step as the fixed-world run, the loss curve
  within rtol 1e-4 of it, and the state right after each restore equal to the state saved (the
  layout-independent global digest, `state_digest` events with ELASTIC_STATE_DIGESTS=1).

The model is tiny (1 block, d_model 32): the cost is process start-up, so jobs run side by side.
Phases end with a `raise` fault one step after a save, so that a step is lost and replayed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from core.faults import Fault
from tests.conftest import REPO, Procs
from tests.integration.test_trainer_world_size import batches
from tests.integration.tiny_job import TinyJob
from trainer.digest import STATE_DIGESTS_ENV

pytestmark = pytest.mark.integration

FSDP = REPO / "examples" / "train_fsdp.py"
DATASET, BATCH, STEPS, EVERY = 42, 12, 9, 2  # 3 steps an epoch, 6 samples an epoch left over
MODEL = ("--layers", "1", "--heads", "4", "--d-model", "32", "--seq-len", "8", "--vocab", "64", "--warmup", "3",
         "--dropout", "0")
"""Dropout off but where a test turns it on: its draws are per data-parallel rank and differ across layouts."""
RTOL = 1e-4


def fsdp(procs: Procs, work: Path, ckpt: Path, *extra: str, nproc: int = 2, faults: tuple[Fault, ...] = (),
         launcher: tuple[str, ...] = (), samples: bool = False) -> TinyJob:
    return TinyJob(procs, work, "--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY),
                   "--dataset-size", str(DATASET), "--global-batch", str(BATCH), "--max-micro-batch", "4", *MODEL,
                   *extra, nproc=nproc, faults=faults, launcher=launcher, script=FSDP,
                   samples=work / "samples" if samples else None, env={STATE_DIGESTS_ENV: "1"})


def one(job: TinyJob, kind: str, **match: object) -> str:
    """The digest every rank reported in its `kind` event matching `match` (all ranks agree)."""
    found = {e["digest"] for e in job.events(kind, **match)}
    assert len(found) == 1, (kind, match, found, job.out[-3000:])
    return found.pop()


@pytest.mark.timeout(240)
def test_fsdp_worker_killed_mid_run_resumes_to_the_same_global_digest(procs: Procs, tmp_path: Path) -> None:
    dropout = ("--dropout", "0.2")
    ref = fsdp(procs, tmp_path / "ref", tmp_path / "ref" / "ckpt", *dropout)
    kill = fsdp(procs, tmp_path / "kill", tmp_path / "kill" / "ckpt", *dropout, launcher=("--max-restarts", "2"),
                faults=(Fault(point="step", step=5, rank=1),))
    ref.finish(timeout=200)
    kill.finish(timeout=200)
    fault = kill.events("fault", point="step", step=5)
    assert [(e["rank"], e["action"]) for e in fault] == [(1, "sigkill")], kill.out[-3000:]
    assert kill.resumed_from() in {2, 4}, kill.out[-3000:]  # step 4's save may not have committed yet
    assert kill.digest() == ref.digest()


CHAINS = {
    "world 2 -> 3 -> 1": [(2, ()), (3, ()), (1, ())],
    "FSDP 2 x TP 2 -> FSDP 3 -> TP 2": [(4, ("--tp", "2")), (3, ()), (2, ("--tp", "2"))],
}
"""Each chain's phases on one checkpoint dir: (workers, flags). Phases 0 and 1 end with a fault after step
2k + 3, one step after the save of step 2k + 2, which the next phase resumes from."""


@pytest.mark.timeout(420)
def test_world_size_and_layout_changes_reshard_and_follow_the_fixed_world_run(procs: Procs, tmp_path: Path) -> None:
    ref = fsdp(procs, tmp_path / "ref", tmp_path / "ref" / "ckpt", samples=True)
    phases: dict[str, list[TinyJob]] = defaultdict(list)
    for k in range(3):  # the chains side by side, phase by phase
        started = {}
        for c, (name, chain) in enumerate(CHAINS.items()):
            nproc, flags = chain[k]
            stop = (Fault(point="step", step=2 * k + 3, action="raise"),) if k < 2 else ()
            started[name] = fsdp(procs, tmp_path / f"chain{c}-phase{k}", tmp_path / f"chain{c}-ckpt", *flags,
                                 nproc=nproc, faults=stop, launcher=("--max-restarts", "0"), samples=True)
        for name, job in started.items():
            job.finish(timeout=240, ok=k == 2)
            phases[name].append(job)
    ref.finish(timeout=60)

    reference = batches(ref.events_dir.parent / "samples")
    ref_curve = ref.losses()
    assert sorted(ref_curve) == list(range(1, STEPS + 1)) and ref_curve[STEPS] < ref_curve[1]
    for name, jobs in phases.items():
        # Phase k resumed from the save before its predecessor's fault, and restored exactly what was saved.
        for k in (1, 2):
            saved = 2 * k
            assert jobs[k].resumed_from(restart=0) == saved, (name, jobs[k].out[-3000:])
            assert one(jobs[k], "state_digest", point="restore", step=saved) == \
                one(jobs[k - 1], "state_digest", point="save", step=saved), (name, k)
        got: dict[int, tuple[int, list[int]]] = {}
        for job in jobs:  # later phases replace the steps they replayed
            got.update(batches(job.events_dir.parent / "samples"))
        assert got == reference, f"{name}: another global batch than the fixed-world run's at some step"
        per_epoch: dict[int, list[int]] = defaultdict(list)
        for epoch, ids in got.values():
            per_epoch[epoch] += ids
        for epoch, ids in per_epoch.items():
            assert len(ids) == len(set(ids)) == DATASET - DATASET % BATCH, f"{name} epoch {epoch}"
        curve = {step: loss for job in jobs for step, loss in job.losses().items()}
        assert sorted(curve) == sorted(ref_curve)
        worst = max(abs(curve[s] - ref_curve[s]) / abs(ref_curve[s]) for s in ref_curve)
        assert worst <= RTOL, f"{name}: the loss curve differs from the fixed-world run by rtol {worst:.2e}"
