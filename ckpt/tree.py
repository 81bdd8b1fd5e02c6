"""Split a nested training state into named tensors and a JSON-able skeleton, and back.

A state is a nest of dict / list / tuple whose leaves are torch.Tensor, int, float, str,
bool, None or bytes. `flatten` pulls every tensor out under its "/"-joined key path
(e.g. "optim/state/0/exp_avg") and leaves a marker in its place:

    tensor                  -> {"__tensor__": name}
    bytes                   -> {"__bytes__": base64}
    tuple                   -> {"__tuple__": [...]}
    non-finite float        -> {"__float__": 16 hex digits of its little-endian IEEE bits}
    dict with a key that is not a str, or a str starting with "__"
                            -> {"__dict__": [[key, value], ...]}
    other dict              -> a JSON object (key order kept)

Finite floats stay JSON numbers (Python writes the shortest repr that round-trips
exactly), so `unflatten(*reversed(flatten(x)))` equals `x` bit for bit, with types kept.
Any Mapping comes back as a dict; subclasses of int, float and str come back as the base
type. No pickle is involved.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_TENSOR = "__tensor__"
_BYTES = "__bytes__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_FLOAT = "__float__"
_RESERVED_NAMES = frozenset({"__metadata__"})  # safetensors keeps its metadata under this key

_SUPPORTED = "torch.Tensor, int, float, str, bool, None, bytes, dict, list, tuple"


@dataclass(frozen=True)
class Flat:
    """A state already flattened by its owner: what `flatten` returns for it. Checkpointer.save_async and
    snapshot take one in place of the state (trainer/state_view.py builds it every step without walking
    the model's and the optimizer's hundreds of tensors)."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any


def flatten(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Return (tensors by name, JSON-able skeleton) for `state`.

    Raises TypeError for a leaf or dict key of an unsupported type and ValueError when two
    tensors map to the same name; both name the key path.
    """
    tensors: dict[str, torch.Tensor] = {}
    try:
        skeleton = _encode(state, (), tensors)
    except RecursionError:  # found after the fact: a check on every save's path would cost every save
        try:
            cycle = _cycle(state, (), set())
        except RecursionError:
            cycle = None
        raise TypeError(
            f"cannot checkpoint a state that contains itself: the container at key path {_describe(cycle)} holds a "
            "container it is inside of; save a copy without the loop" if cycle is not None else
            "cannot checkpoint a state nested this deeply (Python's recursion limit); flatten it first") from None
    return tensors, skeleton


def _cycle(obj: Any, path: tuple[str, ...], inside: set[int]) -> tuple[str, ...] | None:
    """The key path of the first container that holds one of the containers it is inside of, if any."""
    if not isinstance(obj, (Mapping, list, tuple)):
        return None
    if id(obj) in inside:
        return path
    inside.add(id(obj))
    for key, value in (obj.items() if isinstance(obj, Mapping) else enumerate(obj)):
        found = _cycle(value, (*path, str(key)), inside)
        if found is not None:
            return found
    inside.discard(id(obj))
    return None


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the state from its skeleton and tensors. Raises ValueError on a malformed skeleton."""
    return _decode(skeleton, tensors)


def _describe(path: tuple[str, ...]) -> str:
    return repr("/".join(path)) if path else "<root>"


def _encode(obj: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        name = "/".join(path)
        if name in tensors:
            raise ValueError(
                f"two tensors map to the checkpoint name {name!r} (names are '/'-joined key "
                f"paths); rename one of the keys"
            )
        if name in _RESERVED_NAMES:
            raise ValueError(f"the key path {name!r} is reserved by safetensors; rename that key")
        tensors[name] = obj
        return {_TENSOR: name}
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _encode_float(float(obj))
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, bytes):
        return {_BYTES: base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, Mapping):
        return _encode_mapping(obj, path, tensors)
    if type(obj) is tuple:
        return {_TUPLE: _encode_list(obj, path, tensors)}
    if type(obj) is list:
        return _encode_list(obj, path, tensors)
    raise TypeError(
        f"cannot checkpoint a {type(obj).__module__}.{type(obj).__qualname__} at key path "
        f"{_describe(path)}; supported types are {_SUPPORTED}: convert it first"
    )


def _encode_mapping(
    obj: Mapping[Any, Any], path: tuple[str, ...], tensors: dict[str, torch.Tensor]
) -> Any:
    if all(type(k) is str and not k.startswith("__") for k in obj):
        return dict(zip(obj, _encode_items(obj.items(), path, tensors), strict=True))
    pairs = []
    for key, value in obj.items():
        if key is None or isinstance(key, (bool, int, float, str)):
            encoded_key = _encode(key, path, tensors)
        else:
            raise TypeError(
                f"cannot checkpoint a dict key of type {type(key).__qualname__} ({key!r}) at "
                f"key path {_describe(path)}; keys must be str, int, float, bool or None"
            )
        pairs.append([encoded_key, _encode(value, (*path, str(key)), tensors)])
    return {_DICT: pairs}


_PLAIN = (int, str, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)


def _encode_list(obj: list[Any] | tuple[Any, ...], path: tuple[str, ...],
                 tensors: dict[str, torch.Tensor]) -> list[Any]:
    if all(map(_PLAIN_TYPES.__contains__, map(type, obj))):  # a C loop: the Python RNG state's 625 ints, every save
        return list(obj)
    return _encode_items(enumerate(obj), path, tensors)


def _encode_items(items: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> list[Any]:
    """The encoded values of (key, value) `items`. Plain values (exactly int, str, bool, None, float)
    are taken as they are, without building their key path: a save encodes thousands of them (the
    Python RNG state alone is 625 ints, every save)."""
    out = []
    for key, value in items:
        kind = type(value)
        if kind in _PLAIN:
            out.append(value)
        elif kind is float:
            out.append(_encode_float(value))
        else:
            out.append(_encode(value, (*path, str(key)), tensors))
    return out


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {_FLOAT: struct.pack("<d", value).hex()}


def _decode(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        raise ValueError(f"malformed skeleton: unexpected {type(node).__name__}")
    if len(node) == 1:
        ((marker, value),) = node.items()
        if marker.startswith("__"):
            return _decode_marker(marker, value, tensors)
    for key in node:
        if key.startswith("__"):
            raise ValueError(f"malformed skeleton: object key {key!r} outside a marker")
    return {k: _decode(v, tensors) for k, v in node.items()}


def _decode_marker(marker: str, value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if marker == _TENSOR:
        if not isinstance(value, str) or value not in tensors:
            raise ValueError(f"skeleton refers to tensor {value!r}, which is not stored")
        return tensors[value]
    if marker == _BYTES:
        if not isinstance(value, str):
            raise ValueError(f"malformed skeleton: {_BYTES} holds {type(value).__name__}")
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise ValueError(f"malformed skeleton: bad base64 in {_BYTES}: {exc}") from exc
    if marker == _FLOAT:
        if not isinstance(value, str) or len(value) != 16:
            raise ValueError(f"malformed skeleton: {_FLOAT} holds {value!r}")
        try:
            return struct.unpack("<d", bytes.fromhex(value))[0]
        except ValueError as exc:
            raise ValueError(f"malformed skeleton: {_FLOAT} holds {value!r}") from exc
    if marker == _TUPLE:
        if not isinstance(value, list):
            raise ValueError(f"malformed skeleton: {_TUPLE} holds {type(value).__name__}")
        return tuple(_decode(v, tensors) for v in value)
    if marker == _DICT:
        if not isinstance(value, list):
            raise ValueError(f"malformed skeleton: {_DICT} holds {type(value).__name__}")
        out: dict[Any, Any] = {}
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"malformed skeleton: {_DICT} entry {pair!r} is not a pair")
            key = _decode(pair[0], tensors)
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise ValueError(f"malformed skeleton: {_DICT} key {pair[0]!r} is not a scalar")
            out[key] = _decode(pair[1], tensors)
        return out
    raise ValueError(f"malformed skeleton: unknown marker {marker!r}")
