"""Capture and restore every RNG a training step may draw from: python, numpy (if installed),
torch CPU and each CUDA device. The captured form is a tree of ints, tuples and tensors, which
`ckpt` stores without pickle."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.uint32).view(np.int32)).clone(),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        s = state["numpy"]
        keys = s["keys"].numpy().view(np.uint32)
        np.random.set_state((s["kind"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        devices = state["cuda"]
        if len(devices) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(devices)


def derive(state: dict[str, Any], rank: int) -> None:
    """Seed every RNG of a rank that has no captured state of its own (it did not exist when the
    checkpoint was written) from `state` (another rank's capture) and `rank`: deterministic, and
    different for each rank."""
    h = hashlib.sha256(state["torch"].numpy().tobytes())
    h.update(rank.to_bytes(8, "little"))
    seed = int.from_bytes(h.digest()[:8], "little") >> 1
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _as_python_state(value: Any) -> tuple[Any, ...]:
    # random.setstate wants (version, tuple-of-ints, gauss_next) with tuples, not lists.
    version, internal, gauss = value
    return (int(version), tuple(int(x) for x in internal), gauss)
