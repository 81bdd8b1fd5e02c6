"""The data position: a global, world-size-independent place in the epoch.

The sample order of an epoch is a permutation that depends only on (seed, epoch). The position is
the number of samples of the epoch consumed by committed steps. Each step consumes one global
batch of `global_batch` samples, split into contiguous equal slices, one per rank; so any world
size that divides the global batch continues from the same position and every sample of the epoch
is consumed exactly once. An epoch's last `dataset_size % global_batch` samples (a partial global
batch) are skipped: every step has the same global batch, so the optimisation does not depend on
the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import StateMismatchError


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    dataset_size: int
    """Number of samples in the dataset."""
    global_batch: int
    """Samples per step across all ranks; constant when the world size changes."""
    seed: int = 0
    """Seed of the per-epoch permutation."""

    def __post_init__(self) -> None:
        if self.dataset_size <= 0:
            raise ValueError(f"dataset_size must be positive, got {self.dataset_size}")
        if not 0 < self.global_batch <= self.dataset_size:
            raise ValueError(f"global_batch must be in 1..dataset_size ({self.dataset_size}), got {self.global_batch}")


class ElasticSampler:
    """Hands each rank its slice of each step's global batch and tracks the global position."""

    def __init__(self, config: DataConfig, *, rank: int = 0, world_size: int = 1) -> None:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not valid for world size {world_size}")
        if config.global_batch % world_size:
            raise ValueError(
                f"global batch {config.global_batch} does not divide evenly over world size {world_size}; "
                "choose a global batch that is a multiple of every world size the job may run at"
            )
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def local_batch(self) -> int:
        return self.config.global_batch // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.config.dataset_size // self.config.global_batch

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(self.config.dataset_size, generator=gen)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def global_indices(self) -> list[int]:
        """The sample ids of the current step's whole global batch."""
        order = self._epoch_order()
        return order[self.position : self.position + self.config.global_batch].tolist()

    def indices(self) -> list[int]:
        """This rank's sample ids for the current step."""
        start = self.rank * self.local_batch
        return self.global_indices()[start : start + self.local_batch]

    def advance(self) -> None:
        """Mark the current step's global batch consumed."""
        self.position += self.config.global_batch
        if self.position + self.config.global_batch > self.config.dataset_size:
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        return {"seed": c.seed, "dataset_size": c.dataset_size, "global_batch": c.global_batch,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self.config
        differ = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in
                  (("seed", c.seed), ("dataset_size", c.dataset_size), ("global_batch", c.global_batch))
                  if state.get(k) != v]
        if differ:
            raise StateMismatchError("the checkpoint's data settings differ from this run's: " + "; ".join(differ)
                                     + ". Resume with the same data settings, or start from a fresh --ckpt-dir.")
        position = int(state["position"])
        if not 0 <= position <= c.dataset_size - c.global_batch or position % c.global_batch:
            raise StateMismatchError(
                f"the checkpoint's data position {position} is beyond the dataset ({c.dataset_size} samples, "
                f"global batch {c.global_batch}); the checkpoint does not belong to this dataset")
        self.epoch = int(state["epoch"])
        self.position = position
