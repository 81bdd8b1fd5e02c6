"""A plain torch.distributed worker for the elastic tests (no elastic-train imports), as
bench/recovery_worker.py, plus a stop file: a test ends a job the moment it has seen what it needs,
instead of waiting out `--max-seconds`.

Every rank does an all_reduce per step; rank 0 prints `step=<n> world=<ws> t=<unix time>`. The
all_reduce carries each rank's "stop file exists" flag, so every rank stops after the same step (a
rank that stopped alone would leave its peers in a collective).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--max-seconds", type=float, default=600)
    p.add_argument("--stop-file", default=None, help="finish (exit 0) once this file exists")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    end = time.monotonic() + args.max_seconds
    step = 0
    while time.monotonic() < end:
        flag = torch.tensor([1.0 if args.stop_file and os.path.exists(args.stop_file) else 0.0])
        dist.all_reduce(flag)
        step += 1
        if rank == 0:
            print(f"step={step} world={world} t={time.time():.3f}", flush=True)
        if flag.item() > 0:
            break
        time.sleep(args.interval)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
