"""The data position: a global, world-size-independent place in the epoch.

The sample order of an epoch is a permutation that depends only on (seed, epoch). The position is
the number of samples of the epoch consumed by committed steps. Each step consumes one global
batch of `global_batch` samples: the next `global_batch` ids of the permutation. Any world size
continues from the same position, so every sample of the epoch is consumed exactly once. An
epoch's last `dataset_size % global_batch` samples (a partial global batch) are skipped: every step
has the same global batch, so the optimisation does not depend on the world size.

How a step's global batch is split (the world-size rule, a pure function of G = global_batch,
W = world size and M = max_micro_batch):

- Rank r gets a contiguous slice of the global batch. The first `G % W` ranks get `ceil(G / W)`
  samples, the others `floor(G / W)` (the remainder rule; with `G % W == 0` all get `G / W`).
- Every rank runs the same number of micro-batches per step, `accum_steps = ceil(ceil(G / W) / M)`
  (1 when M is None), and cuts its slice into that many contiguous, near-equal micro-batches
  (the first ones one sample larger when it does not divide), none larger than M.
- Each micro-batch's mean loss is multiplied by `loss_weight(n) = n * W / G` before backward. DDP
  averages gradients over the W ranks, so the gradient is the mean over the G samples of the global
  batch, whatever W, M and the remainder. With an even split `loss_weight` is `1 / accum_steps`.
- It cannot be split when W > G (a rank would get no sample) or when a rank's slice is smaller
  than `accum_steps` (only with M = 1 and G % W != 0): ElasticSampler raises ValueError.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from trainer.errors import InvalidStateError, StaleIteratorError, StateMismatchError
from trainer.samples import SampleLog
from trainer.sharding import Layout
from trainer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    dataset_size: int
    """Number of samples in the dataset."""
    global_batch: int
    """Samples per step across all ranks; constant when the world size changes."""
    seed: int = 0
    """Seed of the per-epoch permutation."""
    max_micro_batch: int | None = None
    """Most samples a rank puts through one forward/backward; None: its whole share of the step.
    A hardware setting: it may change between restarts (the checkpoint does not record it); the data stays
    exactly-once, but the micro-batch sums round differently, so such a resume is not bitwise."""

    def __post_init__(self) -> None:
        for name in ("dataset_size", "global_batch", "seed", "max_micro_batch"):
            value = getattr(self, name)
            if not (value is None and name == "max_micro_batch") and (not isinstance(value, int)
                                                                      or isinstance(value, bool)):
                raise TypeError(f"DataConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.dataset_size <= 0:
            raise ValueError(f"dataset_size must be positive, got {self.dataset_size}")
        if not 0 < self.global_batch <= self.dataset_size:
            raise ValueError(f"global_batch must be in 1..dataset_size ({self.dataset_size}), got {self.global_batch}")
        if self.max_micro_batch is not None and self.max_micro_batch <= 0:
            raise ValueError(f"max_micro_batch must be positive or None, got {self.max_micro_batch}")


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Cut range(n) into `parts` contiguous pieces; the first `n % parts` get one more element."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=gen)


RESUME_HINT = " Resume with the same data settings, or start from a fresh --ckpt-dir."
"""The advice of a data-settings mismatch with the run's own checkpoint (an init_from source gets its own)."""


class ElasticSampler:
    """Hands each rank its share of each step's global batch and tracks the global position.

    `epoch` and `position` are the committed position: `advance()` (called by
    `Resumable.step_done`) moves them one global batch on. `rank` and `world_size` default to this
    process's place in the job (the initialised process group, else torchrun's RANK/WORLD_SIZE).
    For a sharded model on a device mesh pass `mesh=` instead: `rank` and `world_size` are then this
    process's data-parallel coordinate and degree (trainer/sharding.py), so that the ranks of one
    tensor-parallel group read the same samples, and only one of them writes the sample log.
    """

    def __init__(self, config: DataConfig, *, rank: int | None = None, world_size: int | None = None,
                 mesh: DeviceMesh | None = None) -> None:
        logs = True
        if mesh is not None:
            if rank is not None or world_size is not None:
                raise ValueError("ElasticSampler: pass mesh= or rank=/world_size=, not both")
            layout = Layout.of(mesh)
            rank, world_size, logs = layout.dp_rank, layout.dp, layout.tp_rank == 0
        if rank is None or world_size is None:  # where this process sits: the process group, else torchrun's env
            here = Topology.from_env()
            rank = here.rank if rank is None else rank
            world_size = here.world_size if world_size is None else world_size
        self.config = config
        self._partition(rank, world_size)
        self.epoch = 0
        self.position = 0
        self.moved = 0
        """How often the committed position or this rank's share was set from outside the loop (a restore, a
        re-formation): an iterator made before the last such change hands out batches of the wrong place."""
        self.sample_log = SampleLog.from_env(rank=rank, world_size=world_size) if logs else None
        """The sample log (trainer/samples.py), when ELASTIC_SAMPLE_LOG_DIR turns it on (one writer per
        data-parallel rank)."""

    def _partition(self, rank: int, world_size: int) -> None:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not valid for world size {world_size}")
        config = self.config
        g = config.global_batch
        if world_size > g:
            raise ValueError(
                f"global batch {g} cannot be split over world size {world_size}: every rank needs at "
                f"least one sample per step; use at most {g} ranks (a resumed run keeps its global batch), or, "
                f"in a new run, a global batch of at least {world_size}")
        largest = math.ceil(g / world_size)
        accum = math.ceil(largest / (config.max_micro_batch or largest))
        if g // world_size < accum:
            raise ValueError(
                f"global batch {g} over world size {world_size} gives some ranks {g // world_size} samples, "
                f"fewer than the {accum} micro-batches per step that max_micro_batch {config.max_micro_batch} "
                "needs; raise max_micro_batch or use a global batch that world size divides")
        self.rank = rank
        self.world_size = world_size
        self.accum_steps = accum
        """Micro-batches (forward/backward passes) per step, equal on every rank."""
        start, stop = _split(g, world_size)[rank]
        self._slice = (start, stop)
        self._micro = [(start + a, start + b) for a, b in _split(stop - start, accum)]

    def repartition(self, rank: int, world_size: int) -> None:
        """Take rank `rank`'s share of the global batch in a world of `world_size` from the committed
        position on (an in-process re-formation, trainer/regroup.py). Iterators made before are void:
        make a new one (`iter(sampler.loader(...))`)."""
        self._partition(rank, world_size)
        self.moved += 1
        if self.sample_log is not None:
            self.sample_log.close()
            self.sample_log = SampleLog.from_env(rank=rank, world_size=world_size)

    @property
    def local_batch(self) -> int:
        """This rank's samples per step (ranks differ by at most one)."""
        return self._slice[1] - self._slice[0]

    @property
    def steps_per_epoch(self) -> int:
        return self.config.dataset_size // self.config.global_batch

    @property
    def micro_batch_sizes(self) -> list[int]:
        """The sizes of this rank's `accum_steps` micro-batches of every step."""
        return [b - a for a, b in self._micro]

    def loss_weight(self, n: int) -> float:
        """Factor for the mean loss of a micro-batch of `n` samples (see the module docstring)."""
        return n * self.world_size / self.config.global_batch

    def _global_batch(self, epoch: int, position: int) -> torch.Tensor:
        c = self.config
        return _permutation(c.seed, epoch, c.dataset_size)[position : position + c.global_batch]

    def _next(self, epoch: int, position: int) -> tuple[int, int]:
        position += self.config.global_batch
        if position + self.config.global_batch > self.config.dataset_size:
            return epoch + 1, 0
        return epoch, position

    def global_indices(self) -> list[int]:
        """The sample ids of the current step's whole global batch."""
        return self._global_batch(self.epoch, self.position).tolist()

    def indices(self) -> list[int]:
        """This rank's sample ids for the current step."""
        return self._global_batch(self.epoch, self.position)[self._slice[0] : self._slice[1]].tolist()

    def micro_batches(self) -> list[list[int]]:
        """This rank's sample ids for the current step, cut into `accum_steps` micro-batches."""
        batch = self._global_batch(self.epoch, self.position)
        micro = [batch[a:b].tolist() for a, b in self._micro]
        if self.sample_log is not None:
            self.sample_log.restart()
            step = self._step_of(self.epoch, self.position)
            for i, ids in enumerate(micro):
                self.sample_log.handed_out(ids, step=step, micro=i)
        return micro

    def _step_of(self, epoch: int, position: int) -> int:
        """The number of completed steps once the step at this data position completes (for the sample log)."""
        return epoch * self.steps_per_epoch + position // self.config.global_batch + 1

    def advance(self, step: int | None = None) -> None:
        """Mark the current step's global batch consumed; `step` (the steps completed) goes to the sample log."""
        if self.sample_log is not None and step is not None:
            self.sample_log.record(step=step, epoch=self.epoch, micro_batches=self.accum_steps,
                                   fallback=self.indices())
        self.epoch, self.position = self._next(self.epoch, self.position)

    def batch_sampler(self) -> StepBatchSampler:
        """This rank's micro-batches, step after step, for `DataLoader(ds, batch_sampler=...)`.

        See StepBatchSampler; `loader()` builds the DataLoader for you.
        """
        return StepBatchSampler(self)

    def loader(self, dataset: Dataset[Any], **kwargs: Any) -> DataLoader[Any]:
        """A DataLoader over `dataset` that yields this rank's micro-batches from the committed position.

        `kwargs` go to DataLoader (num_workers, collate_fn, pin_memory, prefetch_factor, ...). Each
        `iter()` of it starts at the committed position, so create the iterator after
        `Resumable.restore()`. Unless you pass a `generator`, it gets one of its own: a DataLoader
        without one draws its workers' base seed from the global torch RNG each time it is iterated,
        which would shift the training RNG stream of a resumed run.
        """
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if key in kwargs:
                raise ValueError(f"loader() sets the batching itself; do not pass {key}=")
        size = len(dataset) if hasattr(dataset, "__len__") else None
        if size is not None and size != self.config.dataset_size:
            raise ValueError(f"the dataset has {size} samples but DataConfig.dataset_size is "
                             f"{self.config.dataset_size}: set dataset_size={size} (a run's epochs and data position "
                             "count that many samples), or pass torch.utils.data.Subset(dataset, range(n)) to use "
                             "the first n")
        kwargs.setdefault("generator", torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.rank))
        return DataLoader(dataset, batch_sampler=self.batch_sampler(), **kwargs)

    def state_dict(self) -> dict[str, Any]:
        c = self.config
        return {"seed": c.seed, "dataset_size": c.dataset_size, "global_batch": c.global_batch,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if (state["epoch"], state["position"]) != (self.epoch, self.position):
            self.moved += 1
        self.epoch = state["epoch"]
        self.position = state["position"]

    def check_state(self, state: dict[str, Any], step: int | None = None) -> None:
        """Raise StateMismatchError, saying what differs, unless `load_state_dict(state)` would
        succeed; InvalidStateError when the settings match but the position is damaged, or (with `step`, the
        checkpoint's step) is not where that many steps leave the data. Changes nothing."""
        c = self.config
        differ = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in
                  (("seed", c.seed), ("dataset_size", c.dataset_size), ("global_batch", c.global_batch))
                  if state.get(k) != v]
        if differ:
            raise StateMismatchError("the checkpoint's data settings differ from this run's: " + "; ".join(differ)
                                     + "." + RESUME_HINT)
        # The settings match: a bad position is damage (the restore falls back to an older step), not a mismatch.
        position, epoch = state.get("position"), state.get("epoch")
        if not isinstance(position, int) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidStateError(f"the checkpoint's data position is malformed (epoch {epoch!r}, "
                                    f"position {position!r}); the checkpoint is damaged")
        if not 0 <= position <= c.dataset_size - c.global_batch or position % c.global_batch:
            raise InvalidStateError(
                f"the checkpoint's data position {position} is not a step's start within the dataset "
                f"({c.dataset_size} samples, global batch {c.global_batch}: the last step of an epoch starts at "
                f"{(c.dataset_size // c.global_batch - 1) * c.global_batch}); the checkpoint is damaged")
        if step is not None and self._step_of(epoch, position) - 1 != step:
            # Each step advances the data by one global batch from (0, 0): any other position skips or repeats
            # samples without a word (an epoch of 10^6 restored as if it were step 4's).
            expected_epoch, at = divmod(step, self.steps_per_epoch)
            raise InvalidStateError(
                f"the checkpoint's data position (epoch {epoch}, position {position}) is not where {step} steps "
                f"leave the data (epoch {expected_epoch}, position {at * c.global_batch}); the checkpoint is "
                "damaged")


class StepBatchSampler:
    """Yields this rank's micro-batches (lists of sample ids), `accum_steps` per step, step after
    step and epoch after epoch, without end.

    Use it as `DataLoader(ds, batch_sampler=...)` and pull `accum_steps` batches per step. Each
    `iter()` starts at the sampler's committed position; the iteration runs ahead of it freely
    (DataLoader workers prefetch), but only `ElasticSampler.advance()` (from `Resumable.step_done`)
    moves the committed position. Batches prefetched past the last committed step are simply
    produced again after a restart.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        epoch, position = s.epoch, s.position  # a snapshot: iter() is called when the loader's iterator is made
        if s.sample_log is not None:
            s.sample_log.restart()
        return self._from(epoch, position, s.moved)

    def _from(self, epoch: int, position: int, moved: int) -> Iterator[list[int]]:
        s = self.sampler
        while True:
            if s.moved != moved:  # before each step's micro-batches (DataLoader workers: as they ask for them)
                raise StaleIteratorError(
                    f"this data iterator was made before the data position moved to epoch {s.epoch}, position "
                    f"{s.position} (a restore or a re-formation) and would hand out epoch {epoch}, position "
                    f"{position} again: make the iterator, iter(sampler.loader(...)), after Resumable.restore() "
                    "and after each re-formation (train_loop does)")
            batch = s._global_batch(epoch, position)
            for i, (a, b) in enumerate(s._micro):
                ids = batch[a:b].tolist()
                if s.sample_log is not None:
                    s.sample_log.handed_out(ids, step=s._step_of(epoch, position), micro=i)
                yield ids
            epoch, position = s._next(epoch, position)
