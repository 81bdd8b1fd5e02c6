"""Sharded training (examples/train_fsdp.py: FSDP2, TP, 2-D) under elastic-run: exact resume and resharding.

- FSDP2 at 2 ranks, a worker SIGKILLed mid-run: after the resume the global state (at the next save)
  and every loss equal the uninterrupted run's bit for bit.
- One checkpoint directory through world sizes 2 -> 3 -> 1 (1-D FSDP), another through layouts
  FSDP 2 x TP 2 -> FSDP 3 -> TP 2 alone, side by side: every sample id of an epoch consumed once by
  the committed steps, the same global batch at every step as the fixed-world run, the loss curve
  within rtol 1e-4 of it, and the state right after each restore equal to the state saved (the
  layout-independent global digest, `state_digest` events with ELASTIC_STATE_DIGESTS=1).

The model is tiny (1 block, d_model 32): the cost is process start-up, so the jobs run side by side
(one module fixture) and each job serves twice. The first phase of the 2 -> 3 -> 1 chain (FSDP 2,
uninterrupted until its fault after step 7) is the kill test's reference; the killed FSDP 2 job, which
then runs to the end, is the chains' fixed-world run. Phases end with a `raise` fault one step after a
save, so that a step is lost and replayed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
DATASET, BATCH, STEPS, EVERY = 42, 12, 11, 2  # 3 steps an epoch, 6 samples an epoch left over
MODEL = ("--layers", "1", "--heads", "4", "--d-model", "32", "--seq-len", "8", "--vocab", "64", "--warmup", "3",
         "--dropout", "0")
"""Dropout off: after a layout change the RNG streams are derived per data-parallel rank, so its draws
cannot match the fixed-world run's (tests/unit/test_trainer_sharding.py checks the RNG rules)."""
RTOL = 1e-4


def fsdp(procs: Procs, work: Path, ckpt: Path, *extra: str, nproc: int = 2, faults: tuple[Fault, ...] = (),
         launcher: tuple[str, ...] = (), samples: bool = False, digests: bool = False,
         env: dict[str, str] | None = None) -> TinyJob:
    """examples/train_fsdp.py; `samples`: with the sample log; `digests`: with `state_digest` events."""
    return TinyJob(procs, work, "--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY),
                   "--dataset-size", str(DATASET), "--global-batch", str(BATCH), "--max-micro-batch", "4", *MODEL,
                   *extra, nproc=nproc, faults=faults, launcher=launcher, script=FSDP,
                   samples=work / "samples" if samples else None,
                   env={**({STATE_DIGESTS_ENV: "1"} if digests else {}), **(env or {})})


def one(job: TinyJob, kind: str, **match: object) -> str:
    """The digest every rank reported in its `kind` event matching `match` (all ranks agree)."""
    found = {e["digest"] for e in job.events(kind, **match)}
    assert len(found) == 1, (kind, match, found, job.out[-3000:])
    return found.pop()


CHAINS: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    "world 2 -> 3 -> 1": [(2, ()), (3, ()), (1, ())],
    "FSDP 2 x TP 2 -> FSDP 3 -> TP 2": [(4, ("--tp", "2")), (3, ()), (2, ("--tp", "2"))],
}
"""Each chain's phases on one checkpoint dir: (workers, flags)."""


KILL_AT = 5
"""The killed job's rank 1 is SIGKILLed after step 5 (restarted by elastic-run, it resumes from step 4 or 2)."""


def stop_after(k: int) -> int:
    """Phases 0 and 1 end with a fault after step 2k + 7, one step after a save, which is lost if the agent
    stops the other ranks before their files of it are written: then the next phase resumes from the save
    before it. Either way a phase resumes from a save of the one before it, after two steps at least.
    Phase 0 runs uninterrupted past the killed job's first save after its resume (step 6)."""
    return 2 * k + 7


@dataclass
class Runs:
    killed: TinyJob
    """FSDP 2, rank 1 SIGKILLed after step 5, restarted by elastic-run, run to the end: the fixed-world run."""
    chains: dict[str, list[TinyJob]]


Key = str | tuple[int, int]
"""A job of the module: "killed", or (c, k), phase k of the c-th chain of CHAINS."""

PRIORITY: tuple[Key, ...] = ((1, 0), (0, 0), "killed", (1, 1), (0, 1), (1, 2), (0, 2))
MAX_WORKERS = 6
"""Jobs start in PRIORITY order as soon as the phase before them has ended and at most MAX_WORKERS workers
would run: (4 + 2), (4 + 2), (3 + 3), (3 + 2), (2 + 1) as jobs end. On 2 cores the workers are CPU-bound,
mostly start-up, so more at once would not finish sooner; starting each job as soon as it can leaves the
cores idle less often while agents start and exit."""


def _start(procs: Procs, tmp: Path, key: Key) -> TinyJob:
    if key == "killed":
        return fsdp(procs, tmp / "kill", tmp / "kill" / "ckpt", launcher=("--max-restarts", "2"), samples=True,
                    digests=True, faults=(Fault(point="step", step=KILL_AT, rank=1),))
    assert isinstance(key, tuple)
    c, k = key
    nproc, flags = list(CHAINS.values())[c][k]
    stop = (Fault(point="step", step=stop_after(k), action="raise"),) if k < 2 else ()
    return fsdp(procs, tmp / f"chain{c}-phase{k}", tmp / f"chain{c}-ckpt", *flags, nproc=nproc, faults=stop,
                launcher=("--max-restarts", "0"), samples=True, digests=True)


def _workers(key: Key) -> int:
    if isinstance(key, tuple):
        return list(CHAINS.values())[key[0]][key[1]][0]
    return 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Every job of this module, each started as soon as it may (PRIORITY), each waited for by a thread."""
    procs = Procs()
    tmp = tmp_path_factory.mktemp("sharded")
    try:
        jobs: dict[Key, TinyJob] = {}
        pending, done = list(PRIORITY), set()
        running: dict[Future[str], Key] = {}
        with ThreadPoolExecutor(max_workers=len(PRIORITY)) as pool:
            while pending or running:
                for key in list(pending):
                    after = (key[0], key[1] - 1) if isinstance(key, tuple) and key[1] > 0 else None
                    busy = sum(_workers(k) for k in running.values())
                    if (after is None or after in done) and busy + _workers(key) <= MAX_WORKERS:
                        pending.remove(key)
                        jobs[key] = _start(procs, tmp, key)
                        # a chain's last phase and the killed job finish; the others end with their fault
                        ok = not isinstance(key, tuple) or key[1] == 2
                        running[pool.submit(jobs[key].finish, 300, ok=ok)] = key
                ended, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in ended:
                    future.result()
                    done.add(running.pop(future))
        chains = {name: [jobs[(c, k)] for k in range(3)] for c, name in enumerate(CHAINS)}
        yield Runs(killed=jobs["killed"], chains=chains)
    finally:
        procs.cleanup()


@pytest.mark.timeout(600)  # the first test waits for the module's jobs
def test_fsdp_worker_killed_mid_run_resumes_to_the_same_global_digest(runs: Runs) -> None:
    job, uncut = runs.killed, list(runs.chains.values())[0][0]  # FSDP 2, the same flags, uninterrupted to step 7
    fault = job.events("fault", point="step", step=KILL_AT)
    assert [(e["rank"], e["action"]) for e in fault] == [(1, "sigkill")], job.out[-3000:]
    # Rank 0 survives: its process runs main() again in place (trainer.run_elastic), only rank 1 restarts.
    [reformed] = job.events("reformed", rank=0)
    assert reformed["step"] in {2, 4}, reformed  # the newest save every rank has (step 4's may not be done yet)
    assert {e["pid"] for e in job.events("step", rank=0)} == {reformed["pid"]}, "rank 0's process was restarted"
    assert f"reformed world=2 pid={reformed['pid']} step={reformed['step']}" in job.out
    assert {e["restart"] for e in job.events("worker_started", rank=1)} == {0, 1}, job.out[-6000:]
    # Bit for bit after the resume: the global state saved at step 6 (after the kill) and the loss of every
    # step the uninterrupted run made.
    assert all(e["ts"] > fault[0]["ts"] for e in job.events("state_digest", point="save", step=6))
    assert one(job, "state_digest", point="save", step=6) == one(uncut, "state_digest", point="save", step=6)
    uncut_curve = uncut.losses()
    assert sorted(uncut_curve) == list(range(1, stop_after(0) + 1))
    assert {s: loss for s, loss in job.losses().items() if s in uncut_curve} == uncut_curve
    job.digest()  # it ran to the end: every rank reported the same final digest


@pytest.mark.timeout(600)
def test_world_size_and_layout_changes_reshard_and_follow_the_fixed_world_run(runs: Runs) -> None:
    ref = runs.killed  # FSDP 2 throughout; bitwise equal to an uninterrupted run (the test above)
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
