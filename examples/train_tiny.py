"""A tiny, deterministic, resumable DDP job on CPU (gloo). Run it under elastic-run or torchrun:

    elastic-run --nproc-per-node 2 examples/train_tiny.py --steps 60 --ckpt-dir /tmp/ckpt --ckpt-every 10

Rank 0 prints `step=<n> loss=<x>` after every step and `final_digest=<hex>` (sha256 of the model and
optimizer state) at the end; the last step is saved too, so the job restarted once finished trains
nothing again. Killed and restarted, it resumes from its newest checkpoint, and the
final digest equals that of a run that was never interrupted. Restarted with another
--nproc-per-node on the same --ckpt-dir, it continues from the same global data position with the
same global batch (see trainer/data.py for how the batch is split).

The lines it prints are for people. Tests and the chaos harness read the library's structured
events instead (ELASTIC_EVENTS_DIR, see core/events.py), inject faults through ELASTIC_FAULTS
(core/faults.py) and turn the sample log on with ELASTIC_SAMPLE_LOG_DIR (trainer/samples.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from core.numbers import at_least
from trainer import DataConfig, ElasticSampler, Resumable, ResumeConfig, wrap_ddp


def show(line: str) -> None:
    """Print a line for people, in one write: ranks share the launcher's stdout, and print() writes
    the text and the newline separately, so two ranks' lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=at_least(0), required=True, help="total optimizer steps")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory (node-local tier)")
    p.add_argument("--ckpt-every", type=at_least(1), default=10, help="save to disk (tier 1) every K steps")
    p.add_argument("--snapshot-every", type=at_least(0), default=0,
                   help="snapshot into host memory (tier 0, under elastic-run) every K steps; 0: only at --ckpt-every")
    p.add_argument("--shared-url", default=None, help="tier 2: any fsspec URL (a shared path, s3://bucket/prefix, ...)")
    p.add_argument("--run-name", default="tiny", help="run-scoped prefix under --shared-url")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset-size", type=at_least(1), default=4096)
    p.add_argument("--global-batch", type=at_least(1), default=32, help="samples per step over all ranks")
    p.add_argument("--max-micro-batch", type=at_least(1), default=None,
                   help="most samples per forward/backward on a rank; more are accumulated over micro-batches")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability (draws from the torch RNG)")
    p.add_argument("--augment", type=float, default=0.0,
                   help="std of Gaussian noise added to the inputs, drawn from the torch RNG (0: none)")
    p.add_argument("--num-workers", type=at_least(0), default=0, help="DataLoader worker processes")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slows the demo down)")
    return p.parse_args()


class Samples(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """A fixed synthetic regression set; each item carries its sample id."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 12345)
        self.x = torch.randn(size, 16, generator=g)
        w = torch.randn(16, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def train_step(run: Resumable, ddp: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any],
               augment: float) -> float:
    """One optimizer step; returns the global batch's mean loss. Its collectives (the gradients' and the
    loss's all-reduce) come before optimizer.step(): a step interrupted in them leaves the state untouched,
    so an in-process re-formation goes on from memory."""
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for (_, x, y), weight, sync in run.accumulate(batches):
        if augment:
            x = x + augment * torch.randn_like(x)
        with sync:  # no_sync on all but the last micro-batch: one all-reduce per step
            loss = nn.functional.mse_loss(ddp(x), y) * weight
            loss.backward()
        total += loss.detach()
    dist.all_reduce(total)  # each rank's weighted losses sum to world x the global batch's mean loss
    optimizer.step()
    return total.item() / dist.get_world_size()


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
    show(f"worker rank={rank} world={world} pid={os.getpid()} restart={restart}")

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(32, 1))
    ddp = wrap_ddp(model)  # one gradient-bucket layout for the whole run: bitwise resume at any world size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = Samples(args.dataset_size, args.seed)
    # Rank and world size come from the process group; the split follows trainer/data.py's rule.
    sampler = ElasticSampler(DataConfig(dataset_size=args.dataset_size, global_batch=args.global_batch,
                                        seed=args.seed, max_micro_batch=args.max_micro_batch))
    config = ResumeConfig.at(args.ckpt_dir, save_every=args.snapshot_every or args.ckpt_every,
                             persist_every=args.ckpt_every, shared_url=args.shared_url, run_name=args.run_name)
    with Resumable(config, model=ddp, optimizer=optimizer, sampler=sampler) as run:
        step = run.restore()
        if rank == 0 and run.resumed_from is not None:
            show(f"resumed from step {step}")
        batches = iter(sampler.loader(dataset, num_workers=args.num_workers))  # starts at the restored position
        while step < args.steps:
            try:
                mean = train_step(run, ddp, optimizer, batches, args.augment)
            except Exception as exc:  # a lost peer or a new round: re-form in place (re-raises anything else)
                step = run.reform(exc)
                rank, world = dist.get_rank(), dist.get_world_size()
                show(f"reformed world={world} pid={os.getpid()} step={step}")
                batches = iter(sampler.loader(dataset, num_workers=args.num_workers))
                continue
            step += 1
            if rank == 0:
                show(f"step={step} loss={mean:.6f}")
            run.step_done(step, loss=mean)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        digest = run.teardown(batches)  # saves the last step, closes, digest, ends the process group
    if rank == 0:
        show(f"final_digest={digest}")


if __name__ == "__main__":
    main()
