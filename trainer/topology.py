"""Where this process sits in the job, and the two group operations the trainer needs.

Works with and without an initialised process group (a single process is a group of one)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int

    @staticmethod
    def from_env() -> Topology:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return Topology(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)))

    @staticmethod
    def _grouped() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def all_min(self, value: int) -> int:
        """The minimum of `value` over all ranks."""
        if not self._grouped():
            return value
        t = torch.tensor([value], dtype=torch.int64, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather(self, value: int) -> list[int]:
        """`value` of every rank, in rank order."""
        if not self._grouped():
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=collective_device())
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [int(t.item()) for t in everyone]

    def barrier(self) -> None:
        if self._grouped():
            dist.barrier()


def collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
