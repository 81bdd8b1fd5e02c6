"""A digest of training state, to prove a resumed run equals an uninterrupted one bit for bit."""

from __future__ import annotations

import ctypes
import hashlib
import json
from typing import Any

import torch

from ckpt.tree import flatten


def state_digest(state: Any) -> str:
    """sha256 over the tree's structure and every tensor's dtype, shape and bytes, in key order."""
    tensors, skeleton = flatten(state)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def training_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Digest of the model's and optimizer's state (DDP wrappers are looked through)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return state_digest({"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None})
