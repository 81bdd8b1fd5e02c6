"""Where this process sits in the job, and the two group operations the trainer needs.

Works with and without an initialised process group (a single process is a group of one)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.numbers import decimal
from trainer.errors import TrainerError


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
            rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        return Topology(rank=rank, world_size=world, local_rank=_env_int("LOCAL_RANK", 0))

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


def _env_int(name: str, default: int) -> int:
    """$name as a count (what a launcher sets); junk is an error naming the variable, not int()'s."""
    text = os.environ.get(name)
    if text is None:
        return default
    value = decimal(text)
    if value is None:
        raise TrainerError(f"${name} is {text[:40]!r}, not a count: run under elastic-run or torchrun, or unset it")
    return value
