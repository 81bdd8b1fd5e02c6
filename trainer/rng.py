"""Capture and restore every RNG a training step may draw from: python, numpy (if installed),
torch CPU and each CUDA device. The captured form is a tree of ints, tuples and tensors, which
`ckpt` stores without pickle."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import random
from collections.abc import Mapping
from typing import Any

import torch

from trainer.errors import InvalidStateError

log = logging.getLogger(__name__)

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = _NUMPY.capture()
    if _cuda_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


@functools.cache
def _cuda_available() -> bool:
    """torch.cuda.is_available(), asked once: it asks the driver (or NVML) every call, and capture runs every step
    (a process's devices do not change while it runs)."""
    return torch.cuda.is_available()


class _NumpyCapture:
    """numpy's global RNG state as `capture` records it, read again only when it changed. get_state copies the
    624 words of its MT19937 key one by one (~25 us, 60 us inside a training loop on a CPU host: the largest part
    of a capture every step), while loops on GPUs rarely draw from numpy at all. The key and position are
    compared as raw bytes through the bit generator's documented ctypes interface (one memcpy): unchanged, and no
    cached gaussian in the state taken last (consuming one changes the state without a draw), it is the same
    state. The raw bytes' layout is checked against get_state once; where it differs, every capture reads it."""

    _RAW_BYTES = 624 * 4 + 4  # mt19937_state: uint32_t key[624]; int pos

    def __init__(self) -> None:
        self._usable: bool | None = None  # layout not checked yet
        self._raw = b""
        self._state: dict[str, Any] | None = None
        self._generator: Any = None  # the global bit generator whose state address is `_at`
        self._at = 0

    def capture(self) -> dict[str, Any]:
        address = self._address()
        raw = ctypes.string_at(address, self._RAW_BYTES) if address is not None else b""
        if raw and raw == self._raw and self._state is not None and not self._state["has_gauss"]:
            return dict(self._state)  # a copy: a caller's change to it never reaches the next capture
        # The raw bytes first: a draw from another thread in between makes them differ next time, not match.
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        words = np.asarray(keys, dtype=np.uint32)
        if self._usable is None and raw:
            self._usable = raw == words.tobytes() + int(pos).to_bytes(4, "little", signed=True)
            raw = raw if self._usable else b""
        # get_state hands out a new array each call: the tensor may share its memory (and is never written).
        self._state = {"kind": str(kind), "keys": torch.from_numpy(words.view(np.int32)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        self._raw = raw
        return dict(self._state)

    def _address(self) -> int | None:
        """Where the global MT19937's state is, if the global RNG is one and its layout checked out."""
        if self._usable is False:
            return None
        generator: Any = getattr(getattr(np.random.mtrand, "_rand", None), "_bit_generator", None)
        if generator is self._generator:
            return self._at
        if type(generator).__name__ != "MT19937":  # np.random.set_bit_generator may have put another there
            return None
        try:
            self._at = int(generator.ctypes.state_address)
        except (AttributeError, TypeError, ValueError):
            self._usable = False
            return None
        self._generator = generator  # (kept alive here, so its address cannot be another object's)
        return self._at


_NUMPY = _NumpyCapture()


def check(state: Any) -> None:
    """Raise InvalidStateError, naming the entry, unless `state` is a capture `restore` can apply.

    Each entry is tried on a scratch generator, so nothing global changes. Entries of generators
    this process lacks (numpy not installed, no CUDA) are checked for their type only.
    """
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"rng is a {type(state).__name__}, not a mapping of RNG states")
    for key in ("python", "torch"):
        if key not in state:
            raise InvalidStateError(f"rng has no {key!r} entry")
    try:
        random.Random().setstate(_as_python_state(state["python"]))
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidStateError(f"rng['python'] is not a Python random state ({exc})") from exc
    _check_bytes("rng['torch']", state["torch"], torch.get_rng_state().numel())
    try:
        torch.Generator().set_state(state["torch"])
    except (TypeError, RuntimeError) as exc:
        raise InvalidStateError(f"rng['torch'] is not a torch CPU generator state ({exc})") from exc
    if "numpy" in state:
        _check_numpy(state["numpy"])
    if "cuda" in state:
        devices = state["cuda"]
        if not isinstance(devices, (list, tuple)):
            raise InvalidStateError(f"rng['cuda'] is a {type(devices).__name__}, not a list of device states")
        size = torch.cuda.get_rng_state(0).numel() if _cuda_available() else None
        for i, device_state in enumerate(devices):
            _check_bytes(f"rng['cuda'][{i}]", device_state, size)


def _check_bytes(what: str, value: Any, size: int | None) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        got = f"{value.dtype}{list(value.shape)} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidStateError(f"{what} is a {got}, not a 1-D torch.uint8 tensor (a generator state)")
    if size is not None and value.numel() != size:
        raise InvalidStateError(f"{what} holds {value.numel()} bytes; a generator state here has {size}")


def _check_numpy(s: Any) -> None:
    keys = s.get("keys") if isinstance(s, Mapping) else None
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int32 or tuple(keys.shape) != (624,):
        got = f"{keys.dtype}{list(keys.shape)} tensor" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise InvalidStateError(f"rng['numpy']['keys'] is a {got}, not the int32[624] tensor of a numpy MT19937 "
                                "state")
    if np is None:
        return
    try:
        np.random.RandomState().set_state(_as_numpy_state(s))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidStateError(f"rng['numpy'] is not a numpy random state ({exc!r})") from exc


def _as_numpy_state(s: Mapping[str, Any]) -> tuple[Any, ...]:
    for key in ("pos", "has_gauss"):
        if isinstance(s[key], bool) or not isinstance(s[key], int):
            raise TypeError(f"{key} is {s[key]!r}, not an int")
    # numpy's set_state takes any of these: pos past 624 read out of bounds (zeros, then a segfault), all-zero keys
    # draw only zeros
    if not 0 <= s["pos"] <= 624 or s["has_gauss"] not in (0, 1):
        raise ValueError(f"pos {s['pos']} / has_gauss {s['has_gauss']}: an MT19937 state has pos 0..624, has_gauss 0/1")
    if not bool(s["keys"].any()):
        raise ValueError("its 624 keys are all zero (a generator that draws only zeros)")
    if not isinstance(s["cached_gaussian"], (int, float)) or not isinstance(s["kind"], str):
        raise TypeError(f"kind {s['kind']!r} / cached_gaussian {s['cached_gaussian']!r} have the wrong type")
    return (s["kind"], s["keys"].numpy().view(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])


def restore(state: dict[str, Any]) -> None:
    """Apply a capture that `check` accepted."""
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(_as_numpy_state(state["numpy"]))
    elif np is not None:  # saved where numpy was not installed: its stream goes on from where it is (not exact)
        log.warning("the checkpoint's RNG streams have no numpy state (saved without numpy?): numpy's stream is "
                    "not restored, so numpy draws differ from an uninterrupted run's")
    if "cuda" in state and _cuda_available():
        devices = state["cuda"]
        if len(devices) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(devices)


def derive(state: dict[str, Any], rank: int) -> None:
    """Seed every RNG of a rank that has no captured state of its own (it did not exist when the
    checkpoint was written) from `state` (another rank's capture) and `rank`: deterministic, and
    different for each rank."""
    _seed_all(_derived_seed(state["torch"].numpy().tobytes(), rank))


def fingerprint(state: dict[str, Any]) -> int:
    """A 63-bit number of a capture, for `derive_from`: the group agrees on one rank's."""
    return int.from_bytes(hashlib.sha256(state["torch"].numpy().tobytes()).digest()[:8], "little") >> 1


def derive_from(shared: int, index: int) -> None:
    """Seed every RNG from `shared` (a capture's `fingerprint`, the same on every rank) and `index`: ranks
    with the same index (the TP peers of one data-parallel rank) get the same streams, others different."""
    _seed_all(_derived_seed(shared.to_bytes(8, "little"), index))


def _derived_seed(source: bytes, index: int) -> int:
    h = hashlib.sha256(source)
    h.update(index.to_bytes(8, "little"))
    return int.from_bytes(h.digest()[:8], "little") >> 1


def _seed_all(seed: int) -> None:
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _as_python_state(value: Any) -> tuple[Any, ...]:
    # random.setstate wants (version, tuple-of-ints, gauss_next) with tuples, not lists.
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"expected (version, internal state, gauss_next), got a {type(value).__name__}")
    version, internal, gauss = value
    if not isinstance(internal, (tuple, list)) or not all(type(x) is int for x in internal):
        raise TypeError("the internal state is not a sequence of ints")
    if type(version) is not int or not (gauss is None or type(gauss) is float):
        raise TypeError(f"version {version!r} / gauss_next {gauss!r} have the wrong type")
    return (version, tuple(internal), gauss)
