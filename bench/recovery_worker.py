"""A plain torch.distributed script (no elastic-train imports) for bench/recovery_bench.py's torchrun mode.

Every rank does an all_reduce per step; rank 0 prints `step=<n> world=<ws> t=<unix time>` (tests read that
line too), with --every-rank every rank prints it followed by ` rank=<r> pid=<pid>`, so the bench can see
when the re-formed group makes its first step and whether the survivors' processes are the same. It keeps
no state: a restarted worker starts again at step 1.
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
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--every-rank", action="store_true", help="every rank prints its steps, with its rank and pid")
    args = p.parse_args()
    if args.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(args.backend)
    rank, world, pid = dist.get_rank(), dist.get_world_size(), os.getpid()
    t = torch.zeros(1, device="cuda" if args.backend == "nccl" else "cpu")
    end = time.monotonic() + args.max_seconds
    step = 0
    while time.monotonic() < end:
        dist.all_reduce(t)
        if args.backend == "nccl":
            torch.cuda.synchronize()  # NCCL is asynchronous: a step counts once its collective finished
        step += 1
        if args.every_rank:
            print(f"step={step} world={world} t={time.time():.3f} rank={rank} pid={pid}", flush=True)
        elif rank == 0:
            print(f"step={step} world={world} t={time.time():.3f}", flush=True)
        time.sleep(args.interval)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
