"""Check that a loaded state fits a model before loading it, with an error that lists the keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt.errors import CheckpointMismatchError

_SHOWN = 20


def check_compatible(
    state: Mapping[str, Any], model_state: Mapping[str, Any], *, what: str = "model"
) -> None:
    """Raise CheckpointMismatchError unless `state` has exactly the keys of `model_state`, with
    tensors of the same shape and dtype.

    `model_state` is e.g. `model.state_dict()`; `state` the checkpoint's part for it. The error
    lists missing, unexpected and mismatched keys (the first 20 of each, and how many).
    """
    missing = sorted(set(model_state) - set(state))
    unexpected = sorted(set(state) - set(model_state))
    mismatched = []
    for key, want in model_state.items():
        got = state.get(key)
        if key not in state or not isinstance(want, torch.Tensor):
            continue
        if not isinstance(got, torch.Tensor):
            mismatched.append(f"{key}: checkpoint has a {type(got).__name__}, {what} a tensor")
        elif got.shape != want.shape or got.dtype != want.dtype:
            mismatched.append(
                f"{key}: checkpoint {tuple(got.shape)} {got.dtype}, "
                f"{what} {tuple(want.shape)} {want.dtype}"
            )
    if not (missing or unexpected or mismatched):
        return
    parts = []
    for label, items in (
        ("missing in checkpoint", missing),
        (f"not in {what}", unexpected),
        ("shape/dtype differ", mismatched),
    ):
        if items:
            more = f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
            parts.append(f"{label}: {'; '.join(items[:_SHOWN])}{more}")
    raise CheckpointMismatchError(
        f"the checkpoint does not fit this {what}: " + " | ".join(parts) + f". Restore with the "
        f"same {what} definition, or start from an empty checkpoint directory",
        missing=missing,
        unexpected=unexpected,
        mismatched=mismatched,
    )
