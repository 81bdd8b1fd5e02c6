"""Sharded training (examples/train_fsdp.py: FSDP2, TP, 2-D) under elastic-run: exact resume and resharding.

- FSDP2 at 2 ranks, a worker SIGKILLed mid-run: the final global digest equals the uninterrupted
  run's bit for bit.
- One checkpoint directory through world sizes 2 -> 3 -> 1 (1-D FSDP), another through layouts
  FSDP 2 x TP 2 -> FSDP 3 -> TP 2 alone, side by side: every sample id of an epoch consumed once by
  the committed steps, the same global batch at every step as the fixed-world run, the loss curve
  within rtol 1e-4 of it, and the state right after each restore equal to the state saved (the
  layout-independent global digest, `state_digest` events with ELASTIC_STATE_DIGESTS=1).

The model is tiny (1 block, d_model 32): the cost is process start-up, so the jobs run side by side
(one module fixture), and the uninterrupted FSDP 2 run is both the kill test's reference and the
chains' fixed-world run. Phases end with a `raise` fault one step after a save, so that a step is
lost and replayed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
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
"""Dropout off: after a layout change the RNG streams are derived per data-parallel rank, so its draws
cannot match the fixed-world run's (tests/unit/test_trainer_sharding.py checks the RNG rules)."""
RTOL = 1e-4


def fsdp(procs: Procs, work: Path, ckpt: Path, *extra: str, nproc: int = 2, faults: tuple[Fault, ...] = (),
         launcher: tuple[str, ...] = (), samples: bool = False, digests: bool = False) -> TinyJob:
    """examples/train_fsdp.py; `samples`: with the sample log; `digests`: with `state_digest` events."""
    return TinyJob(procs, work, "--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY),
                   "--dataset-size", str(DATASET), "--global-batch", str(BATCH), "--max-micro-batch", "4", *MODEL,
                   *extra, nproc=nproc, faults=faults, launcher=launcher, script=FSDP,
                   samples=work / "samples" if samples else None, env={STATE_DIGESTS_ENV: "1"} if digests else None)


def one(job: TinyJob, kind: str, **match: object) -> str:
    """The digest every rank reported in its `kind` event matching `match` (all ranks agree)."""
    found = {e["digest"] for e in job.events(kind, **match)}
    assert len(found) == 1, (kind, match, found, job.out[-3000:])
    return found.pop()


CHAINS = {
    "world 2 -> 3 -> 1": [(2, ()), (3, ()), (1, ())],
    "FSDP 2 x TP 2 -> FSDP 3 -> TP 2": [(4, ("--tp", "2")), (3, ()), (2, ("--tp", "2"))],
}
"""Each chain's phases on one checkpoint dir: (workers, flags)."""


def stop_after(k: int) -> int:
    """Phases 0 and 1 end with a fault after step 2k + 5, one step after a save, which is lost if the agent
    stops the other ranks before their files of it are written: then the next phase resumes from the save
    before it. Either way a phase resumes from a save of the one before it, after two steps at least."""
    return 2 * k + 5


@dataclass
class Runs:
    reference: TinyJob
    """FSDP 2, never interrupted."""
    killed: TinyJob
    """FSDP 2, rank 1 SIGKILLed after step 5, restarted by elastic-run."""
    chains: dict[str, list[TinyJob]]


ROUNDS: tuple[tuple[str | tuple[int, int], ...], ...] = (
    ("reference", (0, 0)), ((1, 0),), ((0, 1),), ((1, 1), (0, 2)), ("killed", (1, 2)))
"""The module's jobs in five rounds of at most 4 workers (2 + 2, 4, 3, 3 + 1, 2 + 2; six before): (c, k) is
phase k of the c-th chain of CHAINS, a chain's phases in order; the reference and the kill test's job fill
rounds. On 2 cores the workers are CPU-bound, mostly start-up, so more at once would not finish sooner;
fewer rounds leave the cores idle less often while agents start and exit."""


def _start(procs: Procs, tmp: Path, key: str | tuple[int, int]) -> TinyJob:
    if key == "reference":
        return fsdp(procs, tmp / "ref", tmp / "ref" / "ckpt", samples=True)
    if key == "killed":
        return fsdp(procs, tmp / "kill", tmp / "kill" / "ckpt", launcher=("--max-restarts", "2"),
                    faults=(Fault(point="step", step=5, rank=1),))
    assert isinstance(key, tuple)
    c, k = key
    nproc, flags = list(CHAINS.values())[c][k]
    stop = (Fault(point="step", step=stop_after(k), action="raise"),) if k < 2 else ()
    return fsdp(procs, tmp / f"chain{c}-phase{k}", tmp / f"chain{c}-ckpt", *flags, nproc=nproc, faults=stop,
                launcher=("--max-restarts", "0"), samples=True, digests=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Every job of this module, round by round (ROUNDS)."""
    procs = Procs()
    tmp = tmp_path_factory.mktemp("sharded")
    try:
        jobs: dict[str | tuple[int, int], TinyJob] = {}
        for keys in ROUNDS:
            started = {key: _start(procs, tmp, key) for key in keys}
            assert sum(job.nproc for job in started.values()) <= 4, keys
            for key, job in started.items():  # a chain's last phase finishes; the others end with their fault
                job.finish(timeout=300, ok=not isinstance(key, tuple) or key[1] == 2)
            jobs.update(started)
        chains = {name: [jobs[(c, k)] for k in range(3)] for c, name in enumerate(CHAINS)}
        yield Runs(reference=jobs["reference"], killed=jobs["killed"], chains=chains)
    finally:
        procs.cleanup()


@pytest.mark.timeout(600)  # the first test waits for the module's jobs
def test_fsdp_worker_killed_mid_run_resumes_to_the_same_global_digest(runs: Runs) -> None:
    job = runs.killed
    fault = job.events("fault", point="step", step=5)
    assert [(e["rank"], e["action"]) for e in fault] == [(1, "sigkill")], job.out[-3000:]
    assert job.resumed_from() in {2, 4}, job.out[-3000:]  # step 4's save may not have committed yet
    assert job.digest() == runs.reference.digest()


@pytest.mark.timeout(600)
def test_world_size_and_layout_changes_reshard_and_follow_the_fixed_world_run(runs: Runs) -> None:
    ref = runs.reference
    reference = batches(ref.events_dir.parent / "samples")
    ref_curve = ref.losses()
    assert sorted(ref_curve) == list(range(1, STEPS + 1)) and ref_curve[STEPS] < ref_curve[1]
    for name, jobs in runs.chains.items():
        # Phase k resumed from a save before the fault of phase k - 1, and restored exactly what was saved.
        for k in (1, 2):
            resumed = jobs[k].resumed_from(restart=0)
            assert resumed in {stop_after(k - 1) - 1, stop_after(k - 1) - 3}, (name, jobs[k].out[-3000:])
            saved_by = [job for job in jobs[:k] if job.events("state_digest", point="save", step=resumed)][-1]
            assert one(jobs[k], "state_digest", point="restore", step=resumed) == \
                one(saved_by, "state_digest", point="save", step=resumed), (name, k)
        got: dict[int, tuple[int, list[int]]] = {}
        for job in jobs:  # later phases replace the steps they replayed
            got.update(batches(job.events_dir.parent / "samples"))
        assert got == reference, f"{name}: another global batch than the fixed-world run's at some step"
        per_epoch: dict[int, list[int]] = defaultdict(list)
        for epoch, ids in got.values():
            per_epoch[epoch] += ids
        for epoch, ids in per_epoch.items():
            assert len(ids) == len(set(ids)), f"{name}: a sample twice in epoch {epoch}"
            assert len(ids) == DATASET - DATASET % BATCH or epoch == max(per_epoch), f"{name}: epoch {epoch}"
        curve = {step: loss for job in jobs for step, loss in job.losses().items()}
        assert sorted(curve) == sorted(ref_curve)
        worst = max(abs(curve[s] - ref_curve[s]) / abs(ref_curve[s]) for s in ref_curve)
        assert worst <= RTOL, f"{name}: the loss curve differs from the fixed-world run by rtol {worst:.2e}"
