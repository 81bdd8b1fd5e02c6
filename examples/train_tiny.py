"""A tiny, deterministic, resumable DDP job on CPU (gloo). Run it under elastic-run or torchrun:

    elastic-run --nproc-per-node 2 examples/train_tiny.py --steps 60 --ckpt-dir /tmp/ckpt --ckpt-every 10

Rank 0 prints `step=<n> loss=<x>` after every step and `final_digest=<hex>` (sha256 of the model and
optimizer state) at the end. Killed and restarted, it resumes from its newest checkpoint, and the
final digest equals that of a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import DataConfig, ElasticSampler, Resumable, ResumeConfig, training_digest


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory (node-local tier)")
    p.add_argument("--ckpt-every", type=int, default=10, help="save every K steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=32, help="samples per step over all ranks")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slows the demo down)")
    p.add_argument("--crash-at-step", type=int, default=None, help="fault injection: SIGKILL this worker at this step")
    p.add_argument("--crash-rank", type=int, default=0, help="the rank that --crash-at-step kills")
    p.add_argument("--crash-restart", type=int, default=0, help="only crash in this restart attempt")
    return p.parse_args()


def synthetic_dataset(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 12345)
    x = torch.randn(size, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(size, 1, generator=g)
    return x, y


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    print(f"worker rank={rank} world={world} pid={os.getpid()} restart={restart}", flush=True)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = synthetic_dataset(args.dataset_size, args.seed)
    sampler = ElasticSampler(DataConfig(dataset_size=args.dataset_size, global_batch=args.global_batch, seed=args.seed),
                             rank=rank, world_size=world)

    run = Resumable(ResumeConfig(ckpt_dir=args.ckpt_dir, save_every=args.ckpt_every),
                    model=ddp, optimizer=optimizer, sampler=sampler)
    step = run.restore()
    if rank == 0 and run.resumed_from is not None:
        print(f"resumed from step {step}", flush=True)

    while step < args.steps:
        if args.crash_at_step == step and rank == args.crash_rank and restart == args.crash_restart:
            print(f"fault: rank {rank} kills itself (SIGKILL) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        idx = torch.tensor(sampler.indices())
        loss = nn.functional.mse_loss(ddp(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        # The global mean loss, for the log; every rank holds an equal share of the global batch.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step={step} loss={mean.item() / world:.6f}", flush=True)
        run.step_done(step)
        if args.step_sleep:
            time.sleep(args.step_sleep)

    run.close()
    digest = training_digest(ddp, optimizer)
    if rank == 0:
        print(f"final_digest={digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
