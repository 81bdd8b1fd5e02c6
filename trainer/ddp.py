"""`wrap_ddp`: DistributedDataParallel with one gradient-bucket layout for the whole run.

Why: DDP puts all gradients in one bucket in parameter order for its first iteration, then
rebuilds the buckets in the order the gradients became ready. The all-reduce sums each element in
an order that depends on where it sits in its bucket, and with 3 or more ranks floating-point sums
depend on that order. A resumed run wraps a fresh DDP, so its first step after the resume uses the
first-iteration layout while the uninterrupted run used the rebuilt one: the result differs in the
last bits and the run is no longer bitwise equal to the uninterrupted one. (With 2 ranks a + b ==
b + a, so this only shows from 3 ranks on.)

`wrap_ddp` passes `find_unused_parameters=True`, which keeps the initial layout (reverse
parameter order, bucket_cap_mb buckets) for good: DDP never rebuilds buckets in that mode. The
cost is one walk of the autograd graph per step, and torch prints a one-time warning about it.

Teardown: `del` the DDP model before `dist.destroy_process_group()`. Otherwise DDP's reducer holds
the last reference to the gloo process group, and freeing it joins gloo's worker threads while
holding the GIL; a worker thread still releasing the tensors of its last collective needs the GIL,
and the process hangs at exit (seen under load with torch 2.13; pytorch#56297). `Resumable.teardown`
does it for you (`release_process_group`), and the examples use that.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """`DistributedDataParallel(module, **kwargs)` whose bucket layout never changes, so that a
    resumed run is bitwise equal to an uninterrupted one at any world size."""
    if kwargs.get("static_graph"):
        raise ValueError("wrap_ddp: static_graph=True rebuilds the gradient buckets after the first iteration, "
                         "which breaks bitwise resume; drop static_graph or use DistributedDataParallel directly")
    if kwargs.get("find_unused_parameters") is False:
        raise ValueError("wrap_ddp: find_unused_parameters=False lets DDP rebuild its gradient buckets, which breaks "
                         "bitwise resume; leave it out, or use DistributedDataParallel directly")
    kwargs["find_unused_parameters"] = True
    return DistributedDataParallel(module, **kwargs)


def layout_is_stable(model: torch.nn.Module) -> bool:
    """Whether `model` is not a DDP that will rebuild its buckets (see the module docstring)."""
    if not isinstance(model, DistributedDataParallel):
        return True
    return bool(model.find_unused_parameters) and not bool(getattr(model, "static_graph", False))


def release_process_group(ddp: DistributedDataParallel) -> None:
    """Drop `ddp`'s references to its process group, as `del ddp` would (see "Teardown" above), while
    the caller still holds `ddp`. The wrapper is unusable afterwards; its module is not touched."""
    # The attributes torch's own DistributedDataParallel.__getstate__ leaves out for the same reason:
    # the logger holds the reducer, the reducer and `process_group` hold the group.
    for name in ("logger", "reducer", "process_group"):
        ddp.__dict__.pop(name, None)
