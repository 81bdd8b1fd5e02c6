"""A digest of training state, to prove a resumed run equals an uninterrupted one bit for bit.

Sharded state (DTensor leaves) has one global digest: each DTensor is gathered (`full_tensor()`, a
collective: every rank of its mesh computes the digest, in the same key order) and hashed as the full
tensor, under the canonical names of `torch.distributed.checkpoint.state_dict`. The bytes hashed do
not depend on the layout, so runs with different FSDP / TP degrees can be compared. The gathering
is one tensor at a time: the extra memory is the largest tensor.

With `ELASTIC_STATE_DIGESTS=1` in the environment (tests, the chaos harness), `Resumable` emits a
`state_digest` event (step, digest, point "save" or "restore") at every save and after every
restore, so a restore can be checked against the save it read. Off by default: on a large model it
gathers the whole state.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
from typing import Any

import torch

from ckpt.sharding import dtensor_type
from ckpt.tree import flatten
from trainer.sharding import is_sharded, model_state

STATE_DIGESTS_ENV = "ELASTIC_STATE_DIGESTS"

# DTensor logs a warning at each gather of an FSDP-over-TP (_StridedShard) tensor.
_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def state_digests_on() -> bool:
    return os.environ.get(STATE_DIGESTS_ENV, "") not in ("", "0")


def state_digest(state: Any) -> str:
    """sha256 over the tree's structure and every tensor's dtype, shape and bytes, in key order;
    a DTensor counts as its full tensor (gathered: call it on every rank of the mesh)."""
    tensors, skeleton = flatten(state)
    dtensor = dtensor_type()
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    level = _REDISTRIBUTE_LOG.level
    _REDISTRIBUTE_LOG.setLevel(logging.ERROR)
    try:
        for name in sorted(tensors):
            t = tensors[name].detach()
            if dtensor is not None and isinstance(t, dtensor):
                t = t.full_tensor()
            t = t.cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            if t.numel():
                h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    finally:
        _REDISTRIBUTE_LOG.setLevel(level)
    return h.hexdigest()


def training_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Digest of the model's and optimizer's state (DDP wrappers are looked through). For a sharded
    model: the global digest of its `get_state_dict` state (on every rank; see the module docstring)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if is_sharded(model):
        model_sd, optim_sd = model_state(model, optimizer)
        return state_digest({"model": model_sd, "optimizer": optim_sd})
    return state_digest({"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None})
