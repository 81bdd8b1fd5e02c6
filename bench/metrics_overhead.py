"""What the worker metrics cost a training step (trainer/telemetry.py, elastic/worker_metrics.py).

    .venv/bin/python bench/metrics_overhead.py [--steps 100000]

1. The hooks alone: `Telemetry.step` plus one timed `next()` per step, writing the file to tmpfs once a
   second as under elastic-run, against the same loop with the recorder off (a no-op outside elastic-run).
2. The tiny model of examples/train_tiny.py (16-32-1 MLP, AdamW, 16 samples a step, one process): its
   step time, and the hooks' cost as a share of it.
3. The same training loop with the hooks on and off: the measured difference (noisy on a shared
   machine; 1. divided by 2. is the figure to quote).
All in CPU time of this process, in interleaved rounds, medians. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from elastic.worker_metrics import WorkerMetrics, file_path
from trainer.telemetry import Telemetry


def telemetry(directory: Path | None) -> Telemetry:
    recorder = WorkerMetrics(file_path(directory, 0) if directory else None, rank=0, local_rank=0, restart=0)
    t = Telemetry(recorder, samples_per_step=16, tokens_per_sample=128, cadences=(10,))
    t.resumed(0, None)
    return t


def hooks_ns(t: Telemetry, steps: int) -> float:
    loader = itertools.repeat(0)  # a loader's iterator: Resumable.accumulate takes one micro-batch a step here
    start = time.process_time_ns()
    for step in range(1, steps + 1):
        next(t.timed(loader))
        t.step(step)
    return (time.process_time_ns() - start) / steps


def train(t: Telemetry, steps: int, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> float:
    loader = itertools.repeat((x, y))
    start = time.process_time()
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        xb, yb = next(t.timed(loader))
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        t.step(step)
    return (time.process_time() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20_000, help="steps of each hooks-alone round")
    p.add_argument("--train-steps", type=int, default=500, help="steps of each training round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 16), torch.randn(16, 1)
    rounds: list[dict[str, float]] = []
    # CPU time of this process, in interleaved rounds: a shared machine's load moves wall-clock figures.
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        train(telemetry(None), 200, model, opt, x, y)  # warm-up
        for i in range(args.rounds):
            on_ns, off_ns = hooks_ns(telemetry(Path(d)), args.steps), hooks_ns(telemetry(None), args.steps)
            first, second = (Path(d), None) if i % 2 else (None, Path(d))  # alternate: no order effect
            a = train(telemetry(first), args.train_steps, model, opt, x, y)
            b = train(telemetry(second), args.train_steps, model, opt, x, y)
            on, off = (a, b) if first is not None else (b, a)
            rounds.append({"on_ns": on_ns, "off_ns": off_ns, "step_s": off, "share": (on_ns - off_ns) * 1e-9 / off,
                           "ab": on / off - 1})

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    print(json.dumps({
        "hooks_ns_per_step_on": round(med("on_ns")), "hooks_ns_per_step_off": round(med("off_ns")),
        "tiny_step_s": round(med("step_s"), 6), "hooks_share_of_tiny_step": round(med("share"), 5),
        "ab_share_measured": round(med("ab"), 4), "rounds": len(rounds),
    }, indent=1))


if __name__ == "__main__":
    main()
