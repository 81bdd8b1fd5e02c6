"""`accumulate`: one step's micro-batches, each with its loss weight and the context to run it in.

    optimizer.zero_grad(set_to_none=True)
    for (x, y), weight, sync in run.accumulate(batches):    # sampler.accum_steps of them
        with sync:                                           # ddp.no_sync() but for the last one
            loss = loss_fn(ddp(x), y) * weight
            loss.backward()
    optimizer.step()

Why: DDP all-reduces the gradients at every backward unless it runs under `no_sync()` (FSDP2
reduce-scatters them unless told not to); a step needs one reduction, on the last micro-batch. And
each micro-batch's mean loss is weighted by `loss_weight(n) = n * W / G` (trainer/data.py; W is the
data-parallel degree), so that the gradient is the mean over the global batch whatever the world
size, the micro-batch size and the remainder rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.data import ElasticSampler
from trainer.sharding import no_gradient_sync


def accumulate(batches: Iterable[Any], sampler: ElasticSampler, ddp: DistributedDataParallel | None = None, *,
               sharded: torch.nn.Module | None = None) -> Iterator[tuple[Any, float, AbstractContextManager[Any]]]:
    """Take this step's `sampler.accum_steps` micro-batches from `batches` (the loader's iterator, or
    a list of them) and yield each as (batch, loss weight, sync context). Run forward and backward of
    a micro-batch inside its context: `ddp.no_sync()` for all but the last (FSDP2's
    `set_requires_gradient_sync(False)` for a `sharded` model; nullcontext without either)."""
    it = iter(batches)
    sizes = sampler.micro_batch_sizes
    for i, n in enumerate(sizes):
        try:
            batch = next(it)
        except StopIteration:
            raise ValueError(f"the batches ran out after {i} of the {len(sizes)} micro-batches of this step; "
                             "pass the iterator of sampler.loader(...), which never ends") from None
        last = i == len(sizes) - 1
        sync: AbstractContextManager[Any] = nullcontext()
        if ddp is not None and not last:
            sync = ddp.no_sync()
        elif sharded is not None and not last:
            sync = no_gradient_sync(sharded)
        yield batch, sampler.loss_weight(n), sync
