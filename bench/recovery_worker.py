"""A plain torch.distributed script (no elastic-train imports) for bench/recovery_bench.py.

Every rank does an all_reduce per step; rank 0 prints `step=<n> world=<ws> t=<unix time>` so the bench
can see when the re-formed group makes its first step.
"""

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--max-seconds", type=float, default=600)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(1)
    end = time.monotonic() + args.max_seconds
    step = 0
    while time.monotonic() < end:
        dist.all_reduce(t)
        step += 1
        if rank == 0:
            print(f"step={step} world={world} t={time.time():.3f}", flush=True)
        time.sleep(args.interval)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
