"""One variant of bench/goodput_bench.py: examples/train_gpt.py's model and loop, one way of checkpointing.

Run by the bench under a launcher (elastic-run, or torchrun where etcd is missing), one fresh
process per variant and round. It takes train_gpt.py's own flags (the same parser) plus:
  --variant        none | ours | dcp_thread | dcp_process | torch_save
  --save-every     ours: tier 0 cadence with --persist-every, else the tier-1 cadence; others: theirs
  --persist-every  ours with tier 0: the tier-1 cadence (0: tier 0 off, today's tier-1-only saves)
  --result         where this process writes its JSON (one file per restart: `{result}.r{restart}`)

The loop is train_gpt.py's: the same data (ElasticSampler + its loader), micro-batches, autocast,
clipping, AdamW, LR schedule, and `loss.item()` after every step (train_gpt.py's --log-every 1),
so each step's end is a device sync and the step times are honest. "ours" runs it through
`trainer.train_loop` with a `Resumable` (public API, default settings); the others run the same
steps in a plain loop and save in their own way after each step, as a user of them would.

What is timed (time.perf_counter, seconds):
  step_end[i]  the end of step i+1 (after its loss.item())
  save[i]      the save call after step i+1: ours `Resumable.step_done` (data position, events,
               beat and the save when one is due); dcp: the wait for the previous async_save's
               future (torchtitan's rule: one in flight) + the async_save call; torch.save: the call
  wait[i]      inside the optimizer's step of step i+1, from its first pre-hook to its last: the
               time spent waiting for a snapshot's copy before the state is mutated (ours, when
               tier 0 or overlapped mode waits there; 0 for the others)
On CUDA, per step, where its time goes on the device (CUDA events on the training stream; the stream is idle
at a step's start, after the sync that ended the step before), `split[i]`:
  cpu_fb     the loop's own time from the step's start to the optimizer's first pre-hook (the CPU's forward and
             backward: launching them, the data, the hooks that run there)
  gpu_fb     the device's time from the step's start to the same point in its stream (the end of backward
             and clipping); above cpu_fb when the device is the bound
  gpu_wait   the device's time across the optimizer's pre-hooks: a stream wait for a snapshot's copies shows here
  gpu_rest   the optimizer's step, the scaler and the scheduler on the device, to the step's end
  A step's wall time well above gpu_fb + gpu_wait + gpu_rest (with `between`) is time the device did not see:
  the host held up before the step's first event reached the stream (its record call blocked, say).
  and over the same span as cpu_fb, the training thread's own (getrusage(RUSAGE_THREAD)): cpu_fb_run (its CPU
  time: below cpu_fb when it waited, for the GIL, a lock, or the CPU), minflt (page faults), nvcsw (voluntary
  context switches: waits) and nivcsw (involuntary: preempted)
"""

from __future__ import annotations

import cProfile
import dataclasses
import faulthandler
import gc
import io
import json
import os
import platform
import pstats
import resource
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import train_gpt  # noqa: E402  (examples/train_gpt.py: the model, the data, the flags)

from ckpt import CheckpointConfig  # noqa: E402
from trainer import DataConfig, ElasticSampler, Resumable, ResumeConfig, train_loop, wrap_ddp  # noqa: E402
from trainer.accumulate import accumulate  # noqa: E402

VARIANTS = ("none", "ours", "dcp_thread", "dcp_process", "torch_save", "floor_tensors", "floor_gather", "floor_graph")


def tier0_supported() -> bool:
    """Whether this checkout has tier 0: CheckpointConfig.tier0_dir and ResumeConfig.persist_every."""
    return ("tier0_dir" in {f.name for f in fields(CheckpointConfig)}
            and ("persist_every" in {f.name for f in fields(ResumeConfig)} or hasattr(ResumeConfig, "persist_every")))


def parse_args(argv: list[str] | None = None) -> Any:
    p = train_gpt.build_parser(__doc__)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--persist-every", type=int, default=0)
    p.add_argument("--tier0-slots", type=int, default=None,
                   help="CheckpointConfig.tier0_slots (default: ResumeConfig.at's)")
    p.add_argument("--no-defer", action="store_true", help="ResumeConfig.defer_snapshots=False")
    p.add_argument("--device-image", action="store_true",
                   help="CheckpointConfig.device_image=True: tier-0 snapshots staged and summed on the GPU")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval for this worker (0: Python's default, 5 ms): a probe of how much "
                        "the checkpointer's threads delay the training thread's taking the GIL back")
    p.add_argument("--result", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    return train_gpt.checked_args(p, p.parse_args(argv))


class Timings:
    """Per-step times of the loop, and the optimizer's wait (a hook pair around its pre-hooks)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.t0 = time.perf_counter()
        self.steps: list[int] = []
        self.step_end: list[float] = []
        self.between: dict[int, float] = {}
        """From the end of step k (after its device sync) to the start of step k+1's train_step: the loop's own
        time while the device waits for the next step's first kernel (step_done, data, the loop)."""
        self.save: dict[int, float] = {}
        self.save_cpu: dict[int, float] = {}
        """The training thread's own CPU time in each save call: well below `save` when the call waited (the GIL,
        a lock, a file write)."""
        self.data: dict[int, float] = {}
        """The time blocked on the loader between step k's end and step k+1's start (keyed by k, as `between`)."""
        self.wait: dict[int, float] = {}
        self.optimizer = optimizer
        self._pre = 0.0
        self._step = 0
        # Global pre-hooks run before every optimizer's own ones: the first mark.
        self._global = register_optimizer_step_pre_hook(self._first)
        self._last: Any = None
        self.split: dict[int, dict[str, float]] = {}
        self._cuda = torch.cuda.is_available() and any(
            p.is_cuda for g in optimizer.param_groups for p in g["params"])
        self._events: list[Any] = []
        self._started = 0.0
        self._cpu_fb = 0.0
        self._usage: dict[str, float] = {}
        self._usage_fb: dict[str, float] = {}
        self.gc: list[tuple[int, int, float]] = []
        """(step, generation, seconds) of each of the cyclic collector's passes (a full one can take tens of ms)."""
        self._gc_started = 0.0
        self._running = 0  # the step running (numbered as step_ended numbers it); between steps, the one ended
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc.append((self._running, info["generation"], time.perf_counter() - self._gc_started))

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _first(self, *_: Any) -> None:
        self._pre = time.perf_counter()
        self._cpu_fb = self._pre - self._started
        if self._cuda:
            self._usage_fb = _thread_usage(self._usage)
            self._events.append(self._event())

    def _after_all(self, *_: Any) -> None:
        self.wait[self._step] = time.perf_counter() - self._pre
        if self._cuda:
            self._events.append(self._event())

    def before_optimizer_step(self, step: int) -> None:
        """Re-register the closing hook, so that it runs after every pre-hook registered so far
        (the checkpointer may add its own lazily)."""
        self._step = step
        if self._last is not None:
            self._last.remove()
        self._last = self.optimizer.register_step_pre_hook(self._after_all)

    def step_started(self, step: int) -> None:
        self._started = time.perf_counter()
        self._running = step + 1
        if self._cuda:
            self._usage = _thread_usage()
        if self.steps and self.steps[-1] == step:
            self.between[step] = self._started - self.t0 - self.step_end[-1]
        if self._cuda:
            self._events = [self._event()]

    def before_sync(self) -> None:
        """After the step's last kernel is queued, before the sync that ends it."""
        if self._cuda:
            self._events.append(self._event())

    def step_ended(self, step: int) -> None:
        self.steps.append(step)
        self.step_end.append(time.perf_counter() - self.t0)
        if self._cuda and len(self._events) == 4:  # the step's end was a sync: every event has completed
            start, first, last, end = self._events
            self.split[step] = {"cpu_fb": self._cpu_fb, "gpu_fb": start.elapsed_time(first) / 1e3,
                                "gpu_wait": first.elapsed_time(last) / 1e3, "gpu_rest": last.elapsed_time(end) / 1e3,
                                **self._usage_fb}
        self._events = []

    def timed(self, step: int, fn: Callable[[], Any]) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        out = fn()
        self.save[step] = time.perf_counter() - start
        self.save_cpu[step] = time.thread_time() - cpu
        return out

    def timed_loader(self, loader: Iterable[Any]) -> Iterator[Any]:
        """`loader`'s items, the time each next() blocked added to `data` of the step between whose end and the
        next one's start it was asked for."""
        it = iter(loader)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.data[self._running] = self.data.get(self._running, 0.0) + time.perf_counter() - start
            yield item


class _Reiterable:
    """A loader that train_loop may iterate again (after a re-formation), each pass timed (Timings.timed_loader)."""

    def __init__(self, loader: Iterable[Any], timings: Timings) -> None:
        self.loader, self.timings = loader, timings

    def __iter__(self) -> Iterator[Any]:
        return self.timings.timed_loader(self.loader)


def _thread_usage(since: dict[str, float] | None = None) -> dict[str, float]:
    """The calling thread's CPU time, page faults and context switches; with `since`, the change from it."""
    u = resource.getrusage(resource.RUSAGE_THREAD)
    now = {"cpu_fb_run": u.ru_utime + u.ru_stime, "minflt": float(u.ru_minflt), "nvcsw": float(u.ru_nvcsw),
           "nivcsw": float(u.ru_nivcsw)}
    return now if since is None else {k: v - since.get(k, 0.0) for k, v in now.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, started_perf = time.time(), time.perf_counter()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.variant == "dcp_process" and (why := dcp_process_missing()):
        Path(f"{args.result}.r{restart}").write_text(json.dumps({"variant": args.variant, "skipped": why}))
        return
    if args.variant.startswith("floor_") and args.device != "cuda":
        Path(f"{args.result}.r{restart}").write_text(json.dumps({"variant": args.variant,
                                                                 "skipped": "a floor copies device memory"}))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    marks = {"imports": time.perf_counter()}  # where a (restarted) worker's start goes, before its loop
    rank, world, device = train_gpt.setup(args)
    marks["setup"] = time.perf_counter()
    torch.manual_seed(args.seed)
    with device:  # as train_gpt.py builds it: on its device
        model = train_gpt.GPT(args)
    marks["model"] = time.perf_counter()
    # train_gpt.py's choice: wrap_ddp (one bucket layout, bitwise resume) on CPU, plain DDP on CUDA
    wrap = wrap_ddp if args.deterministic or device.type == "cpu" else DDP
    ddp = wrap(model, device_ids=[device.index] if device.type == "cuda" else None) if dist.is_initialized() else model
    marks["ddp"] = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train_gpt.lr_schedule(args.warmup, args.steps))
    amp_dtype = train_gpt.DTYPES[args.dtype]
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    sampler = ElasticSampler(DataConfig(dataset_size=args.dataset_size, global_batch=args.global_batch, seed=args.seed,
                                        max_micro_batch=args.max_micro_batch))
    loader = sampler.loader(train_gpt.ProgressionTokens(args.dataset_size, args.seq_len, args.vocab, args.seed),
                            num_workers=args.num_workers, pin_memory=device.type == "cuda")
    timings = Timings(optimizer)
    run: Resumable | None = None
    result: dict[str, Any] = {"variant": args.variant, "restart": restart, "pid": os.getpid(), "rank": rank,
                              "world": world, "tier0_dir_env": os.environ.get("ELASTIC_TIER0_DIR"),
                              "machine": machine(device)}

    trace = StepTrace.from_env(args, restart, device)

    def train_step(step: int, micro_batches: list[torch.Tensor]) -> None:
        timings.step_started(step)
        optimizer.zero_grad(set_to_none=True)
        batches = run.accumulate(micro_batches) if run is not None else accumulate(
            micro_batches, sampler, ddp if isinstance(ddp, DDP) else None)
        loss_sum = train_gpt.forward_backward(ddp, batches, device=device, amp_dtype=amp_dtype, scaler=scaler)
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        timings.before_optimizer_step(step + 1)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        timings.before_sync()
        loss_sum.item()  # train_gpt.py's --log-every 1: a device sync per step
        timings.step_ended(step + 1)
        trace.step()

    ckpt_dir = Path(args.ckpt_dir)
    if args.variant == "ours":
        config = ours_config(args)
        result["config"] = {"save_every": config.save_every, "persist_every": getattr(config, "persist_every", None),
                            "mode": config.ckpt.mode, "tier0_dir": getattr(config.ckpt, "tier0_root", None),
                            "defer_snapshots": getattr(config, "defer_snapshots", None)}
        run = Resumable(config, model=ddp, optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler,
                        extras={"tokens": 0})
        restore, step_done = run.restore, run.step_done

        def timed_restore() -> int:
            start = time.perf_counter()
            step = restore()
            result["restore_s"] = round(time.perf_counter() - start, 6)
            result["resumed_from"] = step
            result["restored_tier"] = run.restored.tier if run.restored is not None else None
            return step

        profile = StepDoneProfile.from_env(args, restart)

        def timed_step_done(step: int, **kw: Any) -> bool:
            with profile.around(step):
                return bool(timings.timed(step, lambda: step_done(step, **kw)))

        # Instance attributes: train_loop calls resumable.restore() and resumable.step_done(step).
        run.restore = timed_restore  # type: ignore[method-assign]
        run.step_done = timed_step_done  # type: ignore[method-assign]
        end = train_loop(train_step, run, args.steps, loader=_Reiterable(loader, timings))
        profile.write()
        result["ckpt_saves"] = save_metrics(run)
        result["final_digest"] = run.teardown()
    else:
        saver = make_saver(args, model, optimizer, ckpt_dir)
        batches = timings.timed_loader(loader)
        step = 0
        result["resumed_from"] = 0
        while step < args.steps:
            micro = [next(batches) for _ in range(sampler.accum_steps)]
            train_step(step, micro)
            step += 1
            sampler.advance(step)
            if saver is not None and step % args.save_every == 0:
                timings.timed(step, lambda: saver.save(step))  # noqa: B023 (called at once)
        del batches
        end = step
        if saver is not None:
            saver.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    trace.close()
    result.update(
        end_step=end,
        steps=timings.steps,
        step_end_s=[round(t, 6) for t in timings.step_end],
        save_s={str(k): round(v, 6) for k, v in timings.save.items()},
        save_cpu_s={str(k): round(v, 6) for k, v in timings.save_cpu.items()},
        data_s={str(k): round(v, 6) for k, v in timings.data.items()},
        wait_s={str(k): round(v, 6) for k, v in timings.wait.items() if v > 0},
        between_s={str(k): round(v, 6) for k, v in timings.between.items()},
        split_s={str(k): {n: round(v, 6) for n, v in parts.items()} for k, parts in timings.split.items()},
        gc_s=[[step, generation, round(seconds, 6)] for step, generation, seconds in timings.gc],
        tokens_per_step=args.global_batch * args.seq_len,
        main_started_unix=round(started, 3),
        t0_unix=round(started + timings.t0 - started_perf, 4),  # step_end_s[i] is after this unix time
        loop_ready_s=round(timings.t0 - started_perf, 3),
        start_split_s={name: round(t - started_perf, 3) for name, t in marks.items()},
        max_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        cuda_max_allocated_mb=(round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                               if device.type == "cuda" else None),
    )
    out = Path(f"{args.result}.r{restart}")
    out.write_text(json.dumps(result))


def run_name(args: Any, restart: int) -> str:
    """This worker's name in the files of $GOODPUT_PROFILE and $GOODPUT_TRACE: variant, cadences, restart, pid."""
    return f"{args.variant}-s{args.save_every}-p{args.persist_every}-r{restart}-{os.getpid()}"


class StepDoneProfile:
    """$GOODPUT_PROFILE=<dir>: cProfile of `Resumable.step_done` from step $GOODPUT_PROFILE_FROM (default 12) on
    (wall time; $GOODPUT_PROFILE_CLOCK=thread: the thread's CPU time),
    written to <dir>/<variant>-s<save_every>-p<persist_every>-r<restart>-<pid>.txt (cumulative and own time).
    It slows the calls it profiles: a run with it says where the time goes, not how much there is."""

    def __init__(self, path: Path | None, first: int) -> None:
        self.path, self.first = path, first
        # $GOODPUT_PROFILE_CLOCK=thread: the training thread's own CPU time instead of wall time (the two side by
        # side say where step_done waits: for the GIL, a lock, a file write)
        clock = time.thread_time if os.environ.get("GOODPUT_PROFILE_CLOCK") == "thread" else time.perf_counter
        self.profiler = cProfile.Profile(clock) if path is not None else None
        self.calls = 0

    @staticmethod
    def from_env(args: Any, restart: int) -> StepDoneProfile:
        where = os.environ.get("GOODPUT_PROFILE")
        if not where:
            return StepDoneProfile(None, 0)
        return StepDoneProfile(Path(where) / f"{run_name(args, restart)}.txt",
                               int(os.environ.get("GOODPUT_PROFILE_FROM", "12")))

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        if self.profiler is None or step < self.first:
            yield
            return
        self.calls += 1
        self.profiler.enable()
        try:
            yield
        finally:
            self.profiler.disable()

    def write(self) -> None:
        if self.profiler is None or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        out = io.StringIO()
        out.write(f"step_done calls profiled: {self.calls}\n")
        for order in ("cumulative", "tottime"):
            pstats.Stats(self.profiler, stream=out).sort_stats(order).print_stats(45)
        self.path.write_text(out.getvalue())


class StepTrace:
    """$GOODPUT_TRACE=<dir>: torch.profiler (CPU, and CUDA on a GPU) over $GOODPUT_TRACE_STEPS (default 10) steps
    from step $GOODPUT_PROFILE_FROM (default 12) on, every variant alike: where a step's device time goes with and
    without tier 0 (issue J: the every-step snapshot's ~1% a step). Writes <dir>/<name>.txt (key averages by own
    device time and by own CPU time, and each traced step's length) and <dir>/<name>.trace.json (Chrome trace).
    Like StepDoneProfile it slows what it traces: compare traced runs with each other, not with untraced ones."""

    def __init__(self, path: Path | None, first: int, count: int, device: torch.device) -> None:
        self.path, self.device = path, device
        self.profiler: Any = None
        if path is None:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities, on_trace_ready=self._write,
                                schedule=schedule(wait=max(first - 1, 0), warmup=1, active=count, repeat=1))
        self.profiler.start()

    @staticmethod
    def from_env(args: Any, restart: int, device: torch.device) -> StepTrace:
        where = os.environ.get("GOODPUT_TRACE")
        if not where:
            return StepTrace(None, 0, 0, device)
        return StepTrace(Path(where) / run_name(args, restart), int(os.environ.get("GOODPUT_PROFILE_FROM", "12")),
                         int(os.environ.get("GOODPUT_TRACE_STEPS", "10")), device)

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def _write(self, prof: Any) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        out = io.StringIO()
        events = prof.events()
        steps = [e for e in events if e.name.startswith("ProfilerStep")]
        out.write("traced steps (ms): " + ", ".join(f"{e.cpu_time_total / 1000:.2f}" for e in steps) + "\n\n")
        out.write(per_step_cpu(steps, events))
        orders = (["self_device_time_total", "self_cuda_time_total"] if self.device.type == "cuda" else []) + [
            "self_cpu_time_total"]
        for order in orders:
            try:
                out.write(f"by {order}\n{averages.table(sort_by=order, row_limit=30)}\n")
            except (AttributeError, KeyError, ValueError) as exc:  # a torch without this column's name
                out.write(f"by {order}: not available ({exc})\n")
        self.path.with_suffix(".txt").write_text(out.getvalue())
        prof.export_chrome_trace(str(self.path.with_suffix(".trace.json")))


def per_step_cpu(steps: list[Any], events: list[Any]) -> str:
    """Each traced step's own CPU time by thread and, on the step's thread, by op (the top ones): a slow step
    next to a normal one shows which thread or op took the difference."""
    out = io.StringIO()
    for step in steps:
        begin, end = step.time_range.start, step.time_range.end
        inside = [e for e in events if e is not step and begin <= e.time_range.start < end]
        by_thread: dict[int, float] = {}
        by_op: dict[str, list[float]] = {}
        for e in inside:
            by_thread[e.thread] = by_thread.get(e.thread, 0.0) + e.self_cpu_time_total
            if e.thread == step.thread:
                row = by_op.setdefault(e.name, [0.0, 0])
                row[0] += e.self_cpu_time_total
                row[1] += 1
        out.write(f"{step.name}: {(end - begin) / 1000:.2f} ms; own CPU ms by thread: "
                  + ", ".join(f"{t}{'*' if t == step.thread else ''}={v / 1000:.2f}"
                              for t, v in sorted(by_thread.items(), key=lambda kv: -kv[1])) + "\n")
        top = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:12]
        out.write("  " + "; ".join(f"{name} {v[0] / 1000:.2f} ms x{int(v[1])}" for name, v in top) + "\n")
    return out.getvalue() + "\n"


def save_metrics(run: Resumable) -> list[dict[str, Any]]:
    """The checkpointer's own record of each save (ckpt.SaveMetrics): status (a tier-0 snapshot with no
    free slot is "skipped"), stall, wait_staged, and the tier-0 / tier-1 seconds after the copy."""
    out = []
    for m in run.checkpointer.metrics:
        row: dict[str, Any] = {"step": m.step, "status": m.status}
        for key in ("stall_s", "wait_staged_s", "copy_s", "tier0_s", "tier1_s"):
            value = getattr(m, key, None)
            if value is not None:
                row[key] = round(value, 6)
        if m.status == "skipped" and m.error:
            row["error"] = m.error
        out.append(row)
    return out


def dcp_process_missing() -> str | None:
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch.distributed.checkpoint async_save: {exc}"
    if not hasattr(AsyncCheckpointerType, "PROCESS"):
        return f"torch {torch.__version__} has no AsyncCheckpointerType.PROCESS"
    return None


def machine(device: torch.device) -> dict[str, Any]:
    return {"torch": torch.__version__, "device": device.type, "torch_threads": torch.get_num_threads(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(), "cuda": torch.version.cuda, "python": platform.python_version()}


def ours_config(args: Any) -> ResumeConfig:
    """Through `trainer` with default settings: tier 1 every --save-every steps (today), or tier 0
    every --save-every and tier 1 every --persist-every steps."""
    if args.persist_every:
        if not tier0_supported():
            raise SystemExit("--persist-every needs tier 0 (CheckpointConfig.tier0_dir, ResumeConfig.persist_every)")
        slots: dict[str, Any] = {} if args.tier0_slots is None else {"tier0_slots": args.tier0_slots}
        if args.device_image:
            slots["device_image"] = True
        config = ResumeConfig.at(args.ckpt_dir, save_every=args.save_every, persist_every=args.persist_every, **slots)
        return dataclasses.replace(config, defer_snapshots=False) if args.no_defer else config
    if tier0_supported():  # today's behaviour: tier 1 only, even where the agent offers a tier-0 dir
        return ResumeConfig.at(args.ckpt_dir, save_every=args.save_every, tier0_dir="")
    return ResumeConfig.at(args.ckpt_dir, save_every=args.save_every)


class TorchSave:
    """torch.save of the model's and optimizer's state, synchronously; the previous file is removed."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        self.model, self.optimizer, self.dir = model, optimizer, directory
        self.previous: Path | None = None

    def save(self, step: int) -> None:
        path = self.dir / f"step-{step}.pt"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}, path)
        if self.previous is not None:
            self.previous.unlink(missing_ok=True)
        self.previous = path

    def close(self) -> None:
        pass


class DcpAsync:
    """torch.distributed.checkpoint.async_save as torchtitan uses it: get_state_dict of model and
    optimizer, one save in flight (the next save first waits for the previous one's future), a gloo
    group for DCP's own collectives when the default group is NCCL."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, mode: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.dcp, self.get_state_dict = dcp, get_state_dict
        self.kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        self.model, self.optimizer, self.dir = model, optimizer, directory
        self.pg = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.future: Any = None
        self.previous: Path | None = None
        self.done: list[Path] = []

    def save(self, step: int) -> None:
        self._wait()
        model_sd, optim_sd = self.get_state_dict(self.model, self.optimizer)
        path = self.dir / f"step-{step}"
        self.future = self.dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path),
                                          process_group=self.pg, async_checkpointer_type=self.kind)
        self.previous = path

    def _wait(self) -> None:
        if self.future is None:
            return
        self.future.result()
        self.future = None
        # keep the newest finished checkpoint only, as the others keep one
        for old in self.done:
            shutil.rmtree(old, ignore_errors=True)
        self.done = [self.previous] if self.previous is not None else []

    def close(self) -> None:
        self._wait()
        if self.kind.value == "process":
            from torch.distributed.checkpoint import _async_process_executor as executor

            process = getattr(executor, "_CHECKPOINT_PROCESS", None)
            if process is not None:
                process.__del__()  # stops the checkpoint process now, before the process group goes
                executor._CHECKPOINT_PROCESS = None


class Floor:
    """The physical floor of a snapshot every step (issue J's 0.995, measured beside the others): the model's and
    the optimizer's device tensors copied into preallocated page-locked host memory on a side stream after the
    step, overlapping the next one; the optimizer's next step waits, on the device, for the copy out of the state.
    No bookkeeping, no data position, nothing persisted or verified. `how`: "tensors", one device-to-host copy per
    tensor (~600 driver calls); "graph", the same copies captured once as a CUDA graph, one replay per step;
    "gather", first a device-to-device copy of the whole state into one device buffer (a multi-tensor kernel per
    dtype), then one device-to-host copy of it (the optimizer waits only for the first)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, how: str) -> None:
        self.model, self.optimizer, self.how = model, optimizer, how
        self.graph: torch.cuda.CUDAGraph | None = None
        self.srcs: list[torch.Tensor] = []
        self.stream = torch.cuda.Stream()
        self.done: torch.cuda.Event | None = None
        optimizer.register_step_pre_hook(self._before_mutation)

    def _setup(self) -> None:
        tensors = list(self.model.state_dict().values()) + [
            t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        self.srcs = [t for t in tensors if t.is_cuda]
        offsets, total = [], 0
        for t in self.srcs:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 16) * 16
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self.bounce = (torch.empty(total, dtype=torch.uint8, device=self.srcs[0].device) if self.how == "gather"
                       else None)
        into = self.bounce if self.bounce is not None else self.host
        views = [into[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                 for o, t in zip(offsets, self.srcs, strict=True)]
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for view, src in zip(views, self.srcs, strict=True):
            dsts, srcs = groups.setdefault(src.dtype, ([], []))
            dsts.append(view)
            srcs.append(src)
        self.groups = list(groups.values())

    def save(self, step: int) -> None:
        if not self.srcs:
            self._setup()
        taken = torch.cuda.Event()
        taken.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(taken)
            if self.how == "graph":
                if self.graph is None:
                    self.graph = torch.cuda.CUDAGraph()
                    self.graph.capture_begin(capture_error_mode="thread_local")
                    self._copy()
                    self.graph.capture_end()
                self.graph.replay()
            else:
                self._copy()
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
            if self.bounce is not None:
                self.host.copy_(self.bounce, non_blocking=True)

    def _copy(self) -> None:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def _before_mutation(self, *_: Any) -> None:
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
            self.done = None

    def close(self) -> None:
        self.stream.synchronize()


def make_saver(args: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
               directory: Path) -> TorchSave | DcpAsync | Floor | None:
    directory.mkdir(parents=True, exist_ok=True)
    if args.variant.startswith("floor_"):
        return Floor(model, optimizer, how=args.variant.removeprefix("floor_"))
    if args.variant == "torch_save":
        return TorchSave(model, optimizer, directory)
    if args.variant in ("dcp_thread", "dcp_process"):
        return DcpAsync(model, optimizer, directory, args.variant.removeprefix("dcp_"))
    return None


def fork_entry(env: dict[str, str | None], argv: list[str], log_path: str) -> None:
    """The bench's --launcher fork: a child of its preloaded forkserver becomes the worker, with
    the environment an agent would give it and its output in `log_path` (the bench's stdout is
    its JSON)."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # The bench sends SIGUSR1 to a run past its timeout before it kills it: every thread's stack, into the log.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    main(argv)


if __name__ == "__main__":
    main()
