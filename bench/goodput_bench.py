"""Goodput benchmark (issue J): examples/train_gpt.py's training loop on one device, checkpointed in
each way side by side in one run, against the same loop without checkpoints.

    python bench/goodput_bench.py --device cuda --out /tmp/goodput.json      # 12 layers, d 768, bf16
    python bench/goodput_bench.py --device cpu --out /tmp/goodput_cpu.json   # a tiny GPT, a few minutes
    python bench/goodput_bench.py --device cpu --launcher fork --rounds 1 --steps 16 --warmup-steps 5  # smoke

Variants (bench/goodput_worker.py runs each; same model, seed, data and steps):
  none                    no checkpoint
  ours_tier1_10           `trainer` (Resumable + train_loop, default settings), tier 1 every 10 steps
                          (ResumeConfig.at(dir, save_every=10); tier 0 off: today's behaviour)
  ours_tier0_10_tier1_10  tier 1 every 10 steps through tier 0 (the save is staged in the node's host memory and
                          written to disk by the node's helper process, ckpt/helper.py), no snapshot between
  ours_tier0_1_tier1_10   tier 0 (host shared memory) every step + tier 1 every 10 steps
  ours_tier0_1_tier1_50   tier 0 every step + tier 1 every 50 steps
  ours_tier0_1_tier1_10_2slots  the same as ours_tier0_1_tier1_10 with two tier-0 slots a rank instead of the
                          default three (CheckpointConfig.tier0_slots: with two, the snapshots are skipped
                          while a tier-1 write reads a slot; the default before 2026-12-03)
  dcp_async_thread_10     torch.distributed.checkpoint.async_save every 10 steps, thread mode
  dcp_async_process_10    the same, AsyncCheckpointerType.PROCESS
  torch_save_50           torch.save of model + optimizer state every 50 steps
Probes (not in the issue's table): ours_tier0_1_tier1_10_at_boundary (ResumeConfig.defer_snapshots=False);
  ours_tier0_1_tier1_10_gil100us and none_gil100us (sys.setswitchinterval(1e-4) in the worker: how much
  Python's 5 ms GIL hand-over costs the training thread when other threads run Python);
  ours_tier0_1_tier1_10_restart_mode (elastic-run --reform restart: no round watcher, no warm spare);
  ours_tier0_1_no_tier1 (tier 0 every step, tier 1 every 1000 steps: within a run's 111 only at its end, so the
  every-step snapshot's cost without the tier-1 writes); the node helper's settings beside every-step snapshots
  and tier-1 writes: ours_tier0_1_tier1_10_persist2 (its tier-1 pool with 2 threads instead of the snapshot
  pool's 4-8), ours_tier0_1_tier1_10_sum4 (both pools 4 threads), ours_tier0_1_tier1_10_nice19 (niceness 19,
  not 10), ours_tier0_1_tier1_10_pnice0 (the tier-1 pool at the helper's own niceness, as before session 38,
  not 9 nicer); ours_tier0_1_tier1_10_tmpfs (tier 1 written to /dev/shm: the tier-1 writes without the disk's
  writeback); ours_tier0_1_tier1_10_nospare and none_nospare (elastic-run without its warm spare, whose
  warm-up runs beside the first steps: ELASTIC_WARM_SPARE=0); ours_tier0_1_tier1_10_buffered (the helper's tier-1
  writes through the page cache, as before session 42: ELASTIC_DIRECT_IO=0, ckpt/direct_io.py).
Floors (CUDA only; skipped on CPU): floor_tensors_1, floor_graph_1 and floor_gather_1 copy the model's and
  optimizer's device tensors into page-locked host memory after every step on a side stream, nothing else
  (goodput_worker.Floor): one copy per tensor, the same copies replayed from a CUDA graph, or one
  device-to-device gather then one copy; the floor the issue's 0.995 came from, measured beside the others.
Per step of every variant, `between_steps_s`: from the end of a step (after its device sync) to the start of
the next step's train_step, the loop's own time while the device waits (step_done, the data, the loop).
Each variant runs in a fresh process per round, under `--launcher`: elastic-run (--standalone,
--nproc-per-node 1, as a user runs it: tier 0 is the agent's directory), torchrun where no etcd
binary is found (the bench then makes the tier-0 directory in /dev/shm and removes it), or fork
(children of a preloaded forkserver, the bench restarting a killed one as an agent would: quick,
for tests). Rounds (--rounds) run every variant once, in reverse order every other round, so that
each ratio compares runs made under about the same machine load; ratios are per round, then
the median over rounds. The kill runs come after round 0 (so that a --time-budget cut keeps both).

Per variant: tokens/s over the steady steps (after --warmup-steps; the first save of the 10-step
variants falls in the warm-up: DCP's process mode starts its process there), the ratio to `none`,
the number of saves in the steady window, and the time the loop was blocked per save (median,
p90): the save call (ours: `step_done`; DCP: the wait for the previous save + async_save; torch.save)
plus any wait inside the next optimizer step before the state is mutated (bench/goodput_worker.py).

Kills (`ours_*` variants, --kill-variants): the same job with `--max-restarts 1` and the library's
fault injector (ELASTIC_FAULTS, core/faults.py) SIGKILLing the worker after step K, K drawn from
--seed (the same K for every variant). From the events (core/events.py): the step resumed from and
its tier (`restored`, `resumed`), steps lost = K - resumed step, seconds from the kill (`fault`) to
the restarted worker's first step, and its restore (Resumable.restore, timed in the worker).

One JSON object on stdout (also written to --out, after every run, so a cut-short run leaves its
figures): the machine, every setting, per variant the raw per-round figures and the summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from core.events import read_events  # noqa: E402
from core.procfs import kill_tree  # noqa: E402

if str(REPO / "bench") not in sys.path:  # for the forkserver's preload of goodput_worker too (Launcher)
    sys.path.insert(0, str(REPO / "bench"))
from goodput_pool import SLOW_OVER  # noqa: E402
from gpu_telemetry import GpuTelemetry  # noqa: E402

WORKER = REPO / "bench" / "goodput_worker.py"
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Variant:
    kind: str
    """goodput_worker.py --variant"""
    save_every: int = 0
    persist_every: int = 0
    """ours with tier 0: the tier-1 cadence (0: tier 0 off)"""
    tier0_slots: int | None = None
    """ours with tier 0: CheckpointConfig.tier0_slots (None: ResumeConfig.at's default, 3 with snapshots between
    persists, else 2)"""
    device_image: bool = False
    """ours with tier 0: CheckpointConfig.device_image (True: snapshots staged and summed on the GPU)"""
    defer: bool = True
    """ours: ResumeConfig.defer_snapshots (False: a snapshot's bookkeeping all in step_done)"""
    switch_interval: float = 0.0
    """the worker's sys.setswitchinterval (0: Python's 5 ms)"""
    launcher_args: tuple[str, ...] = ()
    """more elastic-run flags (the other launchers ignore them)"""
    env: tuple[tuple[str, str], ...] = ()
    """more environment for the launcher and the worker (a probe of a setting that has no flag)"""
    ckpt_in_memory: bool = False
    """tier 1 (and the rest of the checkpoint directory) in /dev/shm, not on the disk: a probe of what the
    tier-1 writes cost through the disk's writeback rather than through reading, hashing and copying the state"""
    probe: str = ""
    """a directory of bench/probes put first on every process's PYTHONPATH: its sitecustomize.py changes the
    product for a probe of what a part costs (never a kill variant: a probe's checkpoints need not restore)"""

    @property
    def tier0(self) -> bool:
        return self.persist_every > 0


VARIANTS = {
    "none": Variant("none"),
    "ours_tier1_10": Variant("ours", 10),
    "ours_tier0_10_tier1_10": Variant("ours", 10, 10),
    "ours_tier0_1_tier1_10": Variant("ours", 1, 10),
    "ours_tier0_1_tier1_50": Variant("ours", 1, 50),
    "ours_tier0_1_tier1_10_2slots": Variant("ours", 1, 10, 2),
    "ours_tier0_1_tier1_10_at_boundary": Variant("ours", 1, 10, defer=False),
    "ours_tier0_1_tier1_10_gil100us": Variant("ours", 1, 10, switch_interval=1e-4),
    "none_gil100us": Variant("none", switch_interval=1e-4),
    "ours_tier0_1_tier1_10_restart_mode": Variant("ours", 1, 10, launcher_args=("--reform", "restart")),
    "ours_tier0_1_no_tier1": Variant("ours", 1, 1000),
    "ours_tier0_1_tier1_10_persist2": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_PERSIST_THREADS", "2"),)),
    "ours_tier0_1_tier1_10_sum4": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_THREADS", "4"),)),
    "ours_tier0_1_tier1_10_sum2": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_THREADS", "2"),)),
    "ours_tier0_1_tier1_10_nice19": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_NICE", "19"),)),
    "ours_tier0_1_tier1_10_pnice0": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_PERSIST_NICE", "0"),)),
    "ours_tier0_1_tier1_10_keep2": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_KEEP_CORES", "2"),)),
    "ours_tier0_1_tier1_10_keep4": Variant("ours", 1, 10, env=(("ELASTIC_HELPER_KEEP_CORES", "4"),)),
    "ours_tier0_1_tier1_10_tmpfs": Variant("ours", 1, 10, ckpt_in_memory=True),
    "ours_tier0_1_tier1_10_device_image": Variant("ours", 1, 10, device_image=True),
    "ours_tier0_1_tier1_10_skip_sum64": Variant("ours", 1, 10, probe="skip_sum64"),
    "none_repeat": Variant("none"),
    "ours_tier0_1_tier1_10_nospare": Variant("ours", 1, 10, env=(("ELASTIC_WARM_SPARE", "0"),)),
    "ours_tier0_1_tier1_10_buffered": Variant("ours", 1, 10, env=(("ELASTIC_DIRECT_IO", "0"),)),
    "none_nospare": Variant("none", env=(("ELASTIC_WARM_SPARE", "0"),)),
    "floor_tensors_1": Variant("floor_tensors", 1),
    "floor_gather_1": Variant("floor_gather", 1),
    "floor_graph_1": Variant("floor_graph", 1),
    "dcp_async_thread_10": Variant("dcp_thread", 10),
    "dcp_async_process_10": Variant("dcp_process", 10),
    "torch_save_50": Variant("torch_save", 50),
}
KILL_VARIANTS = ("ours_tier1_10", "ours_tier0_1_tier1_10", "ours_tier0_1_tier1_50", "ours_tier0_1_tier1_10_2slots")
# issue J's table: one H200, GPT 12 x 768, seq 1024, vocab 8192, bf16, global batch 64
MODEL_DEFAULTS = {
    "cuda": {"layers": 12, "heads": 12, "d_model": 768, "seq_len": 1024, "vocab": 8192, "global_batch": 64,
             "max_micro_batch": 16, "dtype": "bf16", "steps": 111, "warmup_steps": 11, "threads": 0},
    "cpu": {"layers": 2, "heads": 2, "d_model": 128, "seq_len": 64, "vocab": 512, "global_batch": 8,
            "max_micro_batch": 4, "dtype": "fp32", "steps": 61, "warmup_steps": 11, "threads": 1},
}
TARGETS = {"ours_tier0_1_tier1_10": 0.99, "kill_steps_lost": 1, "kill_to_first_step_s": 5.0, "restore_s": 0.5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=None, help="steps per run (cuda 111, cpu 61)")
    p.add_argument("--warmup-steps", type=int, default=None, help="first steps not timed (11: the first save's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--kill-variants", nargs="*", choices=KILL_VARIANTS, default=list(KILL_VARIANTS))
    p.add_argument("--kill-window", type=int, default=30,
                   help="the kill step K is drawn from warmup+1 .. warmup+this")
    p.add_argument("--steps-after-kill", type=int, default=5, help="a kill run ends at K + this")
    p.add_argument("--launcher", choices=["auto", "elastic-run", "torchrun", "fork"], default="auto",
                   help="auto: elastic-run where an etcd binary is found, else torchrun")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp dir, removed)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per run (cpu 300, cuda 400)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole bench: a run that would likely end past it (by the longest run "
                        "so far) is not started and says so; the summary keeps what ran")
    for flag in ("layers", "heads", "d-model", "seq-len", "vocab", "global-batch", "max-micro-batch"):
        p.add_argument(f"--{flag}", type=int, default=None, help="examples/train_gpt.py's flag")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None)
    p.add_argument("--tree-digest", action="store_true", help="print the digest of the code (see the JSON's code)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of the worker (cpu default 1: the other cores stay free for "
                        "the checkpointers' threads, as a GPU host's do; cuda: torch's default)")
    args = p.parse_args(argv)
    if args.tree_digest:
        print(tree_digest())
        raise SystemExit(0)
    for key, value in MODEL_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.run_timeout = args.run_timeout or (400.0 if args.device == "cuda" else 300.0)
    if not 0 < args.warmup_steps < args.steps:
        p.error(f"--warmup-steps {args.warmup_steps} must be in 1..--steps-1 ({args.steps - 1})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if "none" not in args.variants:
        args.variants = ["none", *args.variants]  # the anchor of every ratio
    return args


# -- launching one run -------------------------------------------------------------------------


def pick_launcher(choice: str) -> tuple[str, str | None]:
    """The launcher to use and, where auto fell back, why."""
    if choice != "auto":
        return choice, None
    try:
        from elastic.etcd_server import find_etcd_binary

        find_etcd_binary()
        import etcd3  # noqa: F401  (the agent's etcd client)
    except Exception as exc:  # any reason elastic-run cannot start a private etcd
        return "torchrun", f"elastic-run needs etcd: {exc}"
    return "elastic-run", None


def tier0_available() -> str | None:
    """None when this checkout's ckpt and trainer have tier 0; else why not (read from the source, so
    the bench itself does not import torch)."""
    ckpt_config = (REPO / "ckpt" / "config.py").read_text()
    trainer_config = (REPO / "trainer" / "config.py").read_text()
    if "tier0_dir" not in ckpt_config or "persist_every" not in trainer_config:
        return "tier 0 not available"
    return None


def agent_has_tier0() -> bool:
    """Whether elastic-run's agent makes the node's tier-0 directory (ELASTIC_TIER0_DIR) itself."""
    return any("tier0_dir" in path.read_text() for path in (REPO / "elastic").glob("*.py"))


class Launcher:
    def __init__(self, kind: str, device: str, work: Path) -> None:
        self.kind, self.device, self.work = kind, device, work
        self.bench_tier0 = kind != "elastic-run" or not agent_has_tier0()
        self._ctx: Any = None
        if kind == "fork":
            ctx = mp.get_context("forkserver")
            # torch._inductor: train_gpt.setup's use_deterministic_algorithms imports it (2.5 s a process)
            ctx.set_forkserver_preload(["torch", "torch._inductor", "torch.distributed.checkpoint", "goodput_worker"])
            self._ctx = ctx

    def run(self, run_dir: Path, argv: list[str], env: dict[str, str | None], *, restarts: int,
            timeout: float, launcher_args: tuple[str, ...] = ()) -> dict[str, Any]:
        """Run the worker (restarted up to `restarts` times after a failure); rc, seconds, log tail."""
        tier0 = Path(tempfile.mkdtemp(prefix="goodput-tier0-", dir=SHM if SHM.is_dir() else None)) \
            if self.bench_tier0 else None
        env = {**env, "ELASTIC_TIER0_DIR": str(tier0) if tier0 is not None else None}
        log = run_dir / "log.txt"
        started = time.perf_counter()
        try:
            if self.kind == "fork":
                rc = self._fork(argv, env, log, restarts=restarts, timeout=timeout)
            else:
                rc = self._launch(argv, env, log, restarts=restarts, timeout=timeout, launcher_args=launcher_args)
        finally:
            if tier0 is not None:
                shutil.rmtree(tier0, ignore_errors=True)
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        return {"rc": rc, "wall_s": round(time.perf_counter() - started, 2), "log_tail": tail if rc else None}

    def _launch(self, argv: list[str], env: dict[str, str | None], log: Path, *, restarts: int,
                timeout: float, launcher_args: tuple[str, ...]) -> int:
        module = "elastic.launcher" if self.kind == "elastic-run" else "torch.distributed.run"
        ours = list(launcher_args) if self.kind == "elastic-run" else []
        cmd = [sys.executable, "-m", module, "--standalone", "--nproc-per-node", "1", "--max-restarts",
               str(restarts), *ours, str(WORKER), *argv]
        full = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        for key, value in env.items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full, start_new_session=True,
                                    cwd=REPO)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                out.write(f"\n# goodput_bench: killed after {timeout:.0f} s\n")
                return -1
            finally:
                kill_tree(proc.pid, signal.SIGKILL)  # the agent, its workers and its etcd
                proc.wait(timeout=30)

    def _fork(self, argv: list[str], env: dict[str, str | None], log: Path, *, restarts: int,
              timeout: float) -> int:
        deadline = time.monotonic() + timeout
        # One rank, the store's own: port 0 lets it bind a free port itself (a port picked here and bound later
        # could be taken in between by another process on a busy machine).
        base = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
                "TORCHELASTIC_RUN_ID": f"goodput-{uuid.uuid4().hex[:8]}", **env}
        for restart in range(restarts + 1):
            child_env = {**base, "TORCHELASTIC_RESTART_COUNT": str(restart)}
            proc = self._ctx.Process(target=_fork_target, args=(child_env, argv, str(log)))
            proc.start()
            proc.join(max(1.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                if proc.pid is not None:  # where it hangs, into its log (goodput_worker.fork_entry), then the kill
                    os.kill(proc.pid, signal.SIGUSR1)
                    proc.join(2.0)
                proc.kill()
                proc.join()
                return -1
            if proc.exitcode == 0:
                return 0
        return int(proc.exitcode)


def _fork_target(env: dict[str, str | None], argv: list[str], log: str) -> None:
    import goodput_worker  # preloaded in the forkserver

    goodput_worker.fork_entry(env, argv, log)


def ckpt_dir(variant: Variant, run_dir: Path) -> Path:
    """Where a run's checkpoints go: in the run's directory, or in /dev/shm for a `ckpt_in_memory` probe."""
    return SHM / f"goodput-ckpt-{os.getpid()}-{run_dir.name}" if variant.ckpt_in_memory else run_dir / "ckpt"


def worker_argv(args: argparse.Namespace, variant: Variant, run_dir: Path, steps: int) -> list[str]:
    argv = ["--device", args.device, "--steps", str(steps), "--ckpt-dir", str(ckpt_dir(variant, run_dir)),
            "--variant", variant.kind, "--result", str(run_dir / "result.json"), "--seed", str(args.seed),
            "--layers", str(args.layers), "--heads", str(args.heads), "--d-model", str(args.d_model),
            "--seq-len", str(args.seq_len), "--vocab", str(args.vocab), "--global-batch", str(args.global_batch),
            "--max-micro-batch", str(args.max_micro_batch), "--dtype", args.dtype, "--threads", str(args.threads)]
    if variant.save_every:
        argv += ["--save-every", str(variant.save_every)]
    if variant.persist_every:
        argv += ["--persist-every", str(variant.persist_every)]
    if variant.tier0_slots is not None:
        argv += ["--tier0-slots", str(variant.tier0_slots)]
    if not variant.defer:
        argv += ["--no-defer"]
    if variant.device_image:
        argv += ["--device-image"]
    if variant.switch_interval:
        argv += ["--switch-interval", str(variant.switch_interval)]
    return argv


def read_results(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The worker's result files, by restart."""
    out = {}
    for path in sorted(run_dir.glob("result.json.r*")):
        out[int(path.suffix.removeprefix(".r"))] = json.loads(path.read_text())
    return out


# -- figures -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation (q=0.5 is the median); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return round(s[lo] + (s[hi] - s[lo]) * (pos - lo), 6)


def dist_of(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "median": pct(values, 0.5), "p90": pct(values, 0.9),
            "max": round(max(values), 6) if values else None}


def device_split(split: dict[int, dict[str, float]], duration: dict[int, float]) -> dict[str, Any]:
    """Where the steps' time went on the device (bench/goodput_worker.py, Timings): each part's median over the
    window, and its mean over the slow steps (3 ms or more above the median step) against the others: the part
    that grows in the slow steps is where they lose their time."""
    parts = sorted({name for v in split.values() for name in v})
    median = statistics.median(duration.values()) if duration else 0.0
    slow = [s for s, d in duration.items() if d >= median + SLOW_OVER]
    rest = [s for s in duration if s not in slow]

    def mean(steps: list[int], name: str) -> float | None:
        return round(statistics.fmean(split[s][name] for s in steps), 6) if steps else None

    return {"median": {n: round(statistics.median(v[n] for v in split.values()), 6) for n in parts},
            "slow_steps": slow, "mean_slow": {n: mean(slow, n) for n in parts},
            "mean_others": {n: mean(rest, n) for n in parts},
            "raw": {n: [round(split[s][n], 5) for s in sorted(split)] for n in parts}}


def steady(result: dict[str, Any], variant: Variant, warmup: int) -> dict[str, Any]:
    """Figures of one run's steady window: from the end of step `warmup` to the end of the last step."""
    steps, ends = result["steps"], result["step_end_s"]
    end_of = dict(zip(steps, ends, strict=True))
    last = steps[-1]
    window = end_of[last] - end_of[warmup]
    timed = last - warmup
    durations = [end_of[s] - end_of[s - 1] for s in steps if s > warmup and s - 1 in end_of]
    save_s = {int(k): v for k, v in result["save_s"].items()}
    wait_s = {int(k): v for k, v in result["wait_s"].items()}
    every = variant.save_every
    # The save after step k runs between the ends of steps k and k+1: in the window for warmup <= k < last.
    saves = [k for k in sorted(save_s) if every and k % every == 0 and warmup <= k < last]
    blocked = [save_s[k] + wait_s.get(k + 1, 0.0) for k in saves]
    fig: dict[str, Any] = {
        "tokens_per_s": round(timed * result["tokens_per_step"] / window, 1),
        "timed_steps": timed,
        "step_s": dist_of(durations),
        "saves": len(saves),
        "blocked_per_save_s": dist_of(blocked),
        "save_call_s": dist_of([save_s[k] for k in saves]),
        "wait_before_optimizer_step_s": dist_of([wait_s.get(k + 1, 0.0) for k in saves]),
        "between_steps_s": dist_of([v for k, v in ((int(k), v) for k, v in result.get("between_s", {}).items())
                                    if warmup <= k < last]),
        "blocked_total_s": round(sum(blocked), 4),
        "blocked_share_of_window": round(sum(blocked) / window, 4),
        "first_save_s": round(save_s[min(k for k in save_s if every and k % every == 0)], 4) if saves else None,
    }
    if variant.tier0:  # tier 0 every step: the steps that also persist, apart
        persist = [k for k in saves if k % variant.persist_every == 0]
        fig["blocked_tier0_only_s"] = dist_of([save_s[k] + wait_s.get(k + 1, 0.0) for k in saves if k not in persist])
        fig["blocked_with_tier1_s"] = dist_of([save_s[k] + wait_s.get(k + 1, 0.0) for k in persist])
        fig["tier1_saves"] = len(persist)
    if "ckpt_saves" in result:  # ours: what the checkpointer itself recorded of the saves in the window
        rows = [m for m in result["ckpt_saves"] if warmup <= m["step"] < last]
        statuses: dict[str, int] = {}
        for m in rows:
            statuses[m["status"]] = statuses.get(m["status"], 0) + 1
        fig["ckpt_status"] = statuses
        reasons: dict[str, int] = {}  # why snapshots were skipped (the error's first words name the cause)
        for m in rows:
            if m["status"] == "skipped":
                reason = " ".join(str(m.get("error", "?")).split()[:6])
                reasons[reason] = reasons.get(reason, 0) + 1
        if reasons:
            fig["ckpt_skipped_why"] = reasons
        fig["saves"] = sum(n for s, n in statuses.items() if s not in ("skipped", "failed"))
        for key in ("stall_s", "wait_staged_s", "copy_s", "tier0_s", "tier1_s"):
            values = [m[key] for m in rows if key in m and m["status"] not in ("skipped", "failed")]
            if values:
                fig[f"ckpt_{key}"] = dist_of(values)
    if variant.kind == "ours" and every > 1:  # step_done without a save: the trainer's own per-step cost
        fig["step_done_no_save_s"] = dist_of([v for k, v in save_s.items() if k % every and warmup <= k < last])
    split = {int(k): v for k, v in result.get("split_s", {}).items() if warmup < int(k) <= last}
    if split:
        fig["split_s"] = device_split(split, {s: end_of[s] - end_of[s - 1] for s in split if s - 1 in end_of})
    if "gc_s" in result:  # the cyclic collector's passes in the window: a full one stops the loop for tens of ms
        passes = [(step, gen, sec) for step, gen, sec in result["gc_s"] if warmup < step <= last]
        fig["gc"] = {f"gen{g}": {"n": sum(1 for _, gen, _ in passes if gen == g),
                                 "total_s": round(sum(sec for _, gen, sec in passes if gen == g), 4)}
                     for g in (0, 1, 2)}
        fig["gc"]["full_passes"] = [[step, sec] for step, gen, sec in passes if gen == 2]
    fig["raw"] = {  # per step of the window: its time, the save call after it, the wait inside its optimizer step
        "step_s": [round(x, 5) for x in durations],
        "save_s": {str(k): round(v, 5) for k, v in sorted(save_s.items()) if warmup <= k < last},
        "wait_s": {str(k): round(v, 5) for k, v in sorted(wait_s.items()) if k > warmup and v >= 1e-3},
        # between step k's end and step k+1's start: all of it, the save call's own CPU time, the loader's wait
        **{name: {k: round(v, 5) for k, v in sorted(((int(k), v) for k, v in result.get(name, {}).items()))
                  if warmup <= k < last} for name in ("between_s", "save_cpu_s", "data_s")},
    }
    if "t0_unix" in result:  # for the GPU's telemetry (bench/gpu_telemetry.py): the window and each step's end
        fig["window_unix"] = [result["t0_unix"] + end_of[warmup], result["t0_unix"] + end_of[last]]
        fig["step_end_unix"] = [result["t0_unix"] + end_of[s] for s in steps if s > warmup and s - 1 in end_of]
    for key in ("max_rss_mb", "cuda_max_allocated_mb", "loop_ready_s", "config", "tier0_dir_env"):
        if key in result:
            fig[key] = result[key]
    return fig


def events_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Saves by outcome and tier; and the steps the agent's warm spare started and was warm after (its warm-up,
    a second process's imports, CUDA context and page-locking of the tier-0 slots, runs beside the training)."""
    counts: dict[str, Any] = {}
    for e in events:
        if e["event"] in ("ckpt_saved", "ckpt_failed", "ckpt_skipped"):
            key = f"{e['event']}_{e.get('tier', '?')}"
            counts[key] = counts.get(key, 0) + 1
    steps = [(e["ts"], int(e["step"])) for e in events if e["event"] == "step" and e.get("rank", 0) == 0]

    def after(ts: float) -> int:
        return max((step for at, step in steps if at <= ts), default=0)

    kept = {e["pid"] for e in events if e["event"] == "spare_started"}
    for name in ("spare_started", "spare_ready", "spare_premapped"):
        for e in events:
            if e["event"] == name and e.get("pid") in kept:
                counts[f"{name}_after_step"] = after(e["ts"])
                # A part of its warm-up (elastic/spare.py warm): its CUDA context.
                if e.get("cuda_at") is not None:
                    counts["spare_cuda_after_step"] = after(float(e["cuda_at"]))
                break
    return counts


def kill_figures(events: list[dict[str, Any]], results: dict[int, dict[str, Any]], kill_step: int) -> dict[str, Any]:
    """Steps lost and the time from the kill to the restarted worker's first step, from the events."""
    def first(name: str, restart: int | None = None) -> dict[str, Any] | None:
        return next((e for e in events if e["event"] == name and (restart is None or e.get("restart") == restart)),
                    None)

    fault = first("fault")
    started = first("worker_started", 1)
    restored = first("restored", 1)
    resumed = first("resumed", 1)
    first_step = first("step", 1)
    agent_restart = first("restart")
    # The kept warm spares' (the launcher's processes started ahead for the first workers say `spare_ready` too).
    kept = {e["pid"] for e in events if e["event"] == "spare_started"}
    spares_ready = [e for e in events if e["event"] == "spare_ready" and e.get("pid") in kept]
    fig: dict[str, Any] = {"kill_step": kill_step, "fault_fired": fault is not None}
    if fault is None or resumed is None:
        fig["error"] = "no fault event" if fault is None else "no resumed event from the restarted worker"
        return fig
    resumed_step = int(resumed["step"])
    fig.update(
        resumed_from=resumed_step,
        restored_tier=restored.get("tier") if restored else None,
        steps_lost=kill_step - resumed_step,
        kill_to_first_step_s=round(first_step["ts"] - fault["ts"], 3) if first_step else None,
        kill_to_agent_restart_s=round(agent_restart["ts"] - fault["ts"], 3) if agent_restart else None,
        kill_to_worker_started_s=round(started["ts"] - fault["ts"], 3) if started else None,
        worker_started_to_restored_s=round(restored["ts"] - started["ts"], 3) if restored and started else None,
        restore_s=results.get(1, {}).get("restore_s"),
        restore_prepare_s=resumed.get("prepare_s"),  # of restore_s: the tier-0 slots mapped and page-locked
        # where the restarted worker's start goes: interpreter and imports, then setup, model and DDP
        kill_to_worker_main_s=round(results[1]["main_started_unix"] - fault["ts"], 3)
        if "main_started_unix" in results.get(1, {}) else None,
        worker_main_to_loop_ready_s=results.get(1, {}).get("loop_ready_s"),
        # of it, cumulative from the worker's main(): imports, train_gpt.setup (the process group), model, DDP
        worker_main_split_s=results.get(1, {}).get("start_split_s"),
        restored_to_first_step_s=round(first_step["ts"] - restored["ts"], 3) if restored and first_step else None,
        # elastic-run's agent: the crashed worker's place taken by a warm spare, one still warming up, or a new
        # process (elastic/spare.py: the agent's restart event says which), and when the spare was started
        replaced_by=None if agent_restart is None else (
            "a new process" if not agent_restart.get("warm_spare") else
            "a warm spare" if agent_restart.get("spare_ready") else "a spare still warming up"),
        spare_started_before_kill_s=next((round(fault["ts"] - e["ts"], 3) for e in events
                                          if e["event"] == "spare_started" and e["ts"] < fault["ts"]), None),
        # the first spare's warm-up (from its main(), after its interpreter's start and imports) and when it was
        # ready, from the kill (negative: before it; a spare started ~7 s before the kill can still be warming)
        spare_warm_s=next((e.get("warm_s") for e in spares_ready), None),
        spare_ready_from_kill_s=next((round(e["ts"] - fault["ts"], 3) for e in spares_ready), None),
        events=events_summary(events),
    )
    return fig


# -- the bench ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    launcher_kind, fallback = pick_launcher(args.launcher)
    no_tier0 = tier0_available()
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # a --dir that did not exist yet was a FileNotFoundError
    work = Path(tempfile.mkdtemp(prefix="goodput-bench-", dir=args.dir))
    launcher = Launcher(launcher_kind, args.device, work)
    rng = random.Random(args.seed)
    kill_step = rng.randint(args.warmup_steps + 1, args.warmup_steps + args.kill_window)
    result: dict[str, Any] = {
        "what": "goodput: examples/train_gpt.py's loop with each way of checkpointing vs none (issue J)",
        "machine": {"cpu_count": os.cpu_count(), "loadavg_1m_before": round(os.getloadavg()[0], 2)},
        "settings": {
            "device": args.device, "steps": args.steps, "warmup_steps": args.warmup_steps, "rounds": args.rounds,
            "seed": args.seed, "layers": args.layers, "heads": args.heads, "d_model": args.d_model,
            "seq_len": args.seq_len, "vocab": args.vocab, "global_batch": args.global_batch,
            "max_micro_batch": args.max_micro_batch, "dtype": args.dtype, "threads": args.threads or "torch default",
            "tokens_per_step": args.global_batch * args.seq_len,
            "launcher": launcher_kind, "launcher_fallback_reason": fallback,
            "tier0_dir_from": None if no_tier0 else ("bench (/dev/shm)" if launcher.bench_tier0 else "agent"),
            "kill_step": kill_step, "kill_run_steps": kill_step + args.steps_after_kill,
            "timing": "perf_counter; a device sync per step (loss.item(), train_gpt.py --log-every 1)",
        },
        "code": code_version(),
        "variants": {},
    }
    variants: dict[str, Any] = result["variants"]
    names = list(args.variants)
    for name in names:
        spec = VARIANTS[name]
        variants[name] = {"kind": spec.kind, "save_every": spec.save_every, "persist_every": spec.persist_every or None,
                          **({"env": dict(spec.env)} if spec.env else {}),
                          **({"probe": spec.probe} if spec.probe else {}), "rounds": []}
        if spec.tier0 and no_tier0:
            variants[name]["skipped"] = no_tier0
    started = time.perf_counter()
    budget = Budget(args.time_budget)
    telemetry = GpuTelemetry(work / "nvidia_smi.csv") if args.device == "cuda" else None
    if telemetry is not None:
        result["settings"]["gpu_telemetry"] = telemetry.why_not or "nvidia-smi every 100 ms"
    try:
        # Round 0, then the kills, then the other rounds: a --time-budget cut keeps one of each.
        result["kills"] = {}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                entry = variants[name]
                if "skipped" in entry:
                    continue
                if (why := budget.refuse()) is not None:
                    entry["rounds"].append({"not_run": why})
                    continue
                with budget.timing():
                    figures = one_run(args, launcher, work / f"{name}-r{r}", VARIANTS[name], telemetry)
                entry["rounds"].append(figures)
                machine = figures.pop("machine", None)
                if machine is not None:
                    result["machine"].update(machine)
                if "skipped" in figures:
                    entry["skipped"] = figures["skipped"]
                progress(f"round {r} {name}: {figures.get('tokens_per_s', figures.get('error'))} tokens/s")
                write_partial(result, args.out)
            if r == 0:
                run_kills(args, launcher, work, kill_step, no_tier0, budget, result)
    finally:
        if telemetry is not None:
            telemetry.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["summary"] = summarize(variants, result.get("kills", {}), args.warmup_steps)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


class Budget:
    """--time-budget: whether one more run likely ends in time, judged by the longest run so far."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.started, self.longest = seconds, time.monotonic(), 0.0

    def refuse(self, factor: float = 1.0) -> str | None:
        if self.seconds is None:
            return None
        left = self.seconds - (time.monotonic() - self.started)
        if left < self.longest * factor:
            return f"--time-budget {self.seconds:.0f} s: {left:.0f} s left, the longest run took {self.longest:.0f} s"
        return None

    @contextmanager
    def timing(self) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.longest = max(self.longest, time.monotonic() - start)


def run_kills(args: argparse.Namespace, launcher: Launcher, work: Path, kill_step: int, no_tier0: str | None,
              budget: Budget, result: dict[str, Any]) -> None:
    for name in args.kill_variants:
        if VARIANTS[name].tier0 and no_tier0:
            result["kills"][name] = {"skipped": no_tier0}
            continue
        if (why := budget.refuse(factor=2.0)) is not None:  # two incarnations
            result["kills"][name] = {"not_run": why}
            continue
        with budget.timing():
            result["kills"][name] = kill_run(args, launcher, work / f"{name}-kill", VARIANTS[name], kill_step)
        progress(f"kill {name}: {result['kills'][name].get('steps_lost')} steps lost")
        write_partial(result, args.out)


@contextmanager
def events_dir_in_memory() -> Iterator[Path]:
    """The run's ELASTIC_EVENTS_DIR, in tmpfs: an event appended to a file on the checkpoints' disk
    waits behind a tier-1 fsync there (up to seconds), a stall a user's loop, without the bench's
    events, would not have."""
    path = Path(tempfile.mkdtemp(prefix="goodput-events-", dir=SHM if SHM.is_dir() else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def checkpoints_removed(variant: Variant, run_dir: Path) -> Iterator[None]:
    """On the way out (an error too), remove a run's checkpoints where they are not in its directory (a probe's,
    in /dev/shm: ckpt_dir)."""
    try:
        yield
    finally:
        if variant.ckpt_in_memory:
            shutil.rmtree(ckpt_dir(variant, run_dir), ignore_errors=True)


def variant_env(variant: Variant) -> dict[str, str | None]:
    """The environment a variant adds: its own, and its probe's directory first on PYTHONPATH."""
    env: dict[str, str | None] = dict(variant.env)
    if variant.probe:
        path = [str(REPO / "bench" / "probes" / variant.probe), str(REPO), os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


def one_run(args: argparse.Namespace, launcher: Launcher, run_dir: Path, variant: Variant,
            telemetry: GpuTelemetry | None = None) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    env: dict[str, str | None] = {"ELASTIC_FAULTS": None, **variant_env(variant)}
    with checkpoints_removed(variant, run_dir), events_dir_in_memory() as events_dir:
        env["ELASTIC_EVENTS_DIR"] = str(events_dir)
        run = launcher.run(run_dir, worker_argv(args, variant, run_dir, args.steps), env, restarts=0,
                           timeout=args.run_timeout, launcher_args=variant.launcher_args)
        events = read_events(str(events_dir))
    results = read_results(run_dir)
    figures: dict[str, Any] = {"rc": run["rc"], "wall_s": run["wall_s"]}
    if 0 in results and "skipped" in results[0]:
        return {**figures, "skipped": results[0]["skipped"]}
    if run["rc"] != 0 or 0 not in results:
        return {**figures, "error": f"exit status {run['rc']}", "log_tail": run["log_tail"]}
    figures["machine"] = results[0].get("machine")
    figures.update(steady(results[0], variant, args.warmup_steps))
    figures["events"] = events_summary(events)
    ends = figures.pop("step_end_unix", None)
    if telemetry is not None and ends is not None:
        figures["gpu"] = telemetry.window(*figures["window_unix"])
        figures["raw"]["sm_mhz"] = telemetry.per_step(ends)
    shutil.rmtree(run_dir, ignore_errors=True)  # the checkpoints: disk and page cache for the next run
    return figures


def kill_run(args: argparse.Namespace, launcher: Launcher, run_dir: Path, variant: Variant,
             kill_step: int) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    faults = json.dumps([{"point": "step", "step": kill_step, "action": "sigkill"}])
    steps = kill_step + args.steps_after_kill
    with checkpoints_removed(variant, run_dir), events_dir_in_memory() as events_dir:
        env: dict[str, str | None] = {"ELASTIC_EVENTS_DIR": str(events_dir), "ELASTIC_FAULTS": faults,
                                      **variant_env(variant)}
        run = launcher.run(run_dir, worker_argv(args, variant, run_dir, steps), env, restarts=1,
                           timeout=args.run_timeout)
        events = read_events(str(events_dir))
    figures = {"rc": run["rc"], "wall_s": run["wall_s"], **kill_figures(events, read_results(run_dir), kill_step)}
    if run["rc"] != 0:
        figures["log_tail"] = run["log_tail"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return figures


SLOW_STEP = 1.15
"""A step this many times the no-checkpoint run's median step (same round) counts as slow."""


def _step_times(fig: dict[str, Any] | None) -> list[float]:
    raw = (fig or {}).get("raw") or {}
    return [t for t in raw.get("step_s") or [] if t > 0]


def _after_spare(fig: dict[str, Any], base: dict[str, Any] | None, warmup: int) -> float | None:
    """`base`'s mean step over `fig`'s: both over the steps after `fig`'s warm spare was warm (its warm-up, a
    second process's CUDA context and page-locking of the tier-0 slots, is a burst of slow steps once a start)."""
    ready = (fig.get("events") or {}).get("spare_ready_after_step")
    if ready is None or base is None:
        return None
    first = max(0, ready - warmup)  # raw step_s[i] is step warmup + 1 + i
    mine = ((fig.get("raw") or {}).get("step_s") or [])[first:]
    theirs = ((base.get("raw") or {}).get("step_s") or [])[first:]
    return statistics.mean(theirs) / statistics.mean(mine) if len(mine) > 10 and len(theirs) > 10 else None


def summarize(variants: dict[str, Any], kills: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Per variant: median tokens/s, the median over rounds of its ratio to `none` of the same round,
    blocking per save pooled over rounds; and the kill figures with the issue's targets."""
    anchor = variants["none"]["rounds"]
    out: dict[str, Any] = {}
    for name, entry in variants.items():
        if "skipped" in entry:
            out[name] = {"skipped": entry["skipped"]}
            continue
        # Against none's round of the same index: tokens/s, and the median step, which a few slow steps (a noisy
        # host, a stall) do not move, with how many steps were slow; and the mean step once the spare was warm.
        ratios, step_ratios, slow, warm = [], [], [], []
        for i, fig in enumerate(entry["rounds"]):
            base = anchor[i] if i < len(anchor) else None
            if base and "tokens_per_s" in base and "tokens_per_s" in fig:
                ratios.append(fig["tokens_per_s"] / base["tokens_per_s"])
            mine, theirs = _step_times(fig), _step_times(base)
            if mine and theirs:
                anchor_step = statistics.median(theirs)
                step_ratios.append(anchor_step / statistics.median(mine))
                slow.append(sum(1 for t in mine if t > SLOW_STEP * anchor_step))
            if (after := _after_spare(fig, base, warmup)) is not None:
                warm.append(after)
        ok = [f for f in entry["rounds"] if "tokens_per_s" in f]
        blocked = [f["blocked_per_save_s"]["median"] for f in ok if f["blocked_per_save_s"]["median"] is not None]
        p90 = [f["blocked_per_save_s"]["p90"] for f in ok if f["blocked_per_save_s"]["p90"] is not None]
        out[name] = {
            "tokens_per_s_median": pct([f["tokens_per_s"] for f in ok], 0.5),
            "ratio_to_none_median": round(statistics.median(ratios), 4) if ratios else None,
            "ratio_to_none_per_round": [round(x, 4) for x in ratios],
            "median_step_ratio_per_round": [round(x, 4) for x in step_ratios],
            "ratio_after_spare_warm_per_round": [round(x, 4) for x in warm],
            "slow_steps_per_run": slow,
            "saves_per_run": [f["saves"] for f in ok],
            "blocked_per_save_median_s": pct(blocked, 0.5),
            "blocked_per_save_p90_s": pct(p90, 0.5),
            "failed_rounds": sum(1 for f in entry["rounds"] if "error" in f),
            "rounds_not_run": sum(1 for f in entry["rounds"] if "not_run" in f),
        }
        gpu = [f["gpu"] for f in ok if f.get("gpu")]
        if gpu:  # the GPU's own clock per round: a lowered clock slows a round whatever its checkpointing
            out[name].update({f"gpu_{key}_per_round": [g[key] for g in gpu]
                              for key in ("sm_mhz_median", "power_w_median", "clock_lowered_share")})
    if kills:
        keys = ("steps_lost", "resumed_from", "restored_tier", "kill_to_first_step_s", "restore_s",
                "restore_prepare_s", "replaced_by", "error", "skipped", "not_run")
        out["kills"] = {name: {k: fig[k] for k in keys if fig.get(k) is not None} for name, fig in kills.items()}
    t0 = out.get("ours_tier0_1_tier1_10", {})
    k0 = kills.get("ours_tier0_1_tier1_10", {})
    out["targets"] = {
        "ours_tier0_1_tier1_10 ratio >= 0.99": None if t0.get("ratio_to_none_median") is None
        else t0["ratio_to_none_median"] >= TARGETS["ours_tier0_1_tier1_10"],
        "kill: steps lost <= 1": None if k0.get("steps_lost") is None else k0["steps_lost"] <= 1,
        "kill: kill -> first step <= 5 s": None if k0.get("kill_to_first_step_s") is None
        else k0["kill_to_first_step_s"] <= TARGETS["kill_to_first_step_s"],
        "kill: restore <= 0.5 s": None if k0.get("restore_s") is None else k0["restore_s"] <= TARGETS["restore_s"],
    }
    return out


def code_version() -> dict[str, Any]:
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    # The digest of the code that ran (a copied tree may carry stale git metadata): compare with
    # `python bench/goodput_bench.py --tree-digest` in a checkout.
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None,
            "uncommitted": git("status", "--porcelain", "--", *CODE_DIRS).splitlines(),
            "tree_digest": tree_digest()}


CODE_DIRS = ("ckpt", "trainer", "elastic", "core", "bench", "examples")


def tree_digest() -> str:
    h = hashlib.sha256()
    for top in CODE_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def progress(line: str) -> None:
    print(f"# goodput_bench: {line}", file=sys.stderr, flush=True)


def write_partial(result: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps({**result, "partial": True}, indent=2) + "\n")


if __name__ == "__main__":
    main()
