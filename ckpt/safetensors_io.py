"""Read and write safetensors files.

Writing is ours and streams: header first, then each tensor's bytes straight from its
memory, hashing as it goes, so no second copy of the state is built. Reading goes through
`safetensors.safe_open` (mmap), after this module has checked the header itself, so a
damaged file raises CheckpointCorruptError instead of a huge allocation or a raw
SafetensorError. numpy is not needed.

File layout: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}
padded with spaces so the data starts 8-byte aligned, then the tensor bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ckpt.format import corrupt, is_shape, loads_object

MAX_HEADER_BYTES = 100_000_000
"""Largest header accepted (the limit of the safetensors library itself)."""

_CHUNK = 16 << 20
_METADATA = "__metadata__"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
DTYPES: Mapping[str, torch.dtype] = _DTYPES
"""torch dtypes by safetensors name ("BF16", ...)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16", ...). Raises TypeError if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be stored in safetensors; supported: "
            f"{', '.join(str(d) for d in _DTYPE_NAMES)}"
        ) from None


def check_storable(name: str, tensor: torch.Tensor) -> None:
    """Raise TypeError, naming the tensor, if it cannot be written to safetensors."""
    why = ("a nested tensor" if tensor.is_nested else "a quantized tensor (its scale and zero point would be lost)"
           if tensor.is_quantized else f"a {tensor.layout} tensor" if tensor.layout != torch.strided
           else "a meta tensor (no data)" if tensor.device.type == "meta" else None)
    if why is not None:
        raise TypeError(f"tensor {name!r} is {why} and cannot be stored: only dense tensors with data can, "
                        "convert it first (.dequantize(), .to_dense(), .unbind() / .to_padded_tensor() ...)")
    if tensor.dtype not in _DTYPE_NAMES:
        raise TypeError(
            f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
            f"supported: {', '.join(str(d) for d in _DTYPE_NAMES)}"
        )


def plan_layout(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[tuple[str, int, int]], int]:
    """Lay out tensors of the given (dtype, shape) in a safetensors file.

    Returns (the file's first bytes: 8-byte length and padded JSON header, the (name, begin,
    end) data offsets in file order, the number of data bytes). Raises TypeError for a dtype
    safetensors cannot store.
    """
    # Largest elements first keeps every tensor aligned to its element size.
    order = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))
    header: dict[str, object] = {}
    if metadata:
        header[_METADATA] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    slots = []
    for name in order:
        dtype, shape = specs[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        slots.append((name, offset, offset + nbytes))
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"{len(specs)} tensors need a header over {MAX_HEADER_BYTES} bytes")
    return struct.pack("<Q", len(header_bytes)) + header_bytes, slots, offset


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Create `path` (which must not exist) holding `tensors`; fsync it.

    Returns (bytes written, sha256 hex digest of the whole file). Raises TypeError for a
    tensor that cannot be stored (unsupported dtype, sparse, meta) before anything is written.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; big-endian hosts are unsupported")
    for name, tensor in tensors.items():
        check_storable(name, tensor)
    prefix, slots, data_bytes = plan_layout(
        {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata=metadata
    )
    digest = hashlib.sha256()
    written = 0
    with open(path, "xb") as f:

        def emit(buf: bytes | memoryview) -> None:
            nonlocal written
            f.write(buf)
            digest.update(buf)
            written += len(buf)

        emit(prefix)
        for name, _, _ in slots:
            _emit_tensor(tensors[name], emit)
        f.flush()
        os.fsync(f.fileno())
    expected = len(prefix) + data_bytes
    assert written == expected, f"wrote {written} bytes to {path}, expected {expected}"
    return written, digest.hexdigest()


def _emit_tensor(tensor: torch.Tensor, emit: Callable[[memoryview], None]) -> None:
    data = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return
    # A zero-copy view of the tensor's memory; `data` stays alive until the loop ends.
    view = memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
    for start in range(0, nbytes, _CHUNK):
        emit(view[start : start + _CHUNK])
    view.release()
    del data


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check the header of `path`: (tensor entries by name, metadata).

    Raises CheckpointCorruptError naming the file when the length field, JSON, dtypes,
    shapes or offsets do not describe the file exactly.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header_len = _header_length(f.read(8), size, path)
        raw = f.read(header_len)
    return _parse_header(raw, size=size, path=path)


def _header_length(first8: bytes, size: int, path: Path) -> int:
    if size < 8 or len(first8) < 8:
        raise corrupt(path, f"safetensors file is {size} bytes, too short for a header")
    (header_len,) = struct.unpack("<Q", first8[:8])
    if header_len > MAX_HEADER_BYTES or header_len > size - 8:
        raise corrupt(
            path,
            f"safetensors header length field says {header_len} bytes but the file has "
            f"{size} bytes (limit {MAX_HEADER_BYTES})",
        )
    return int(header_len)


def _parse_header(
    raw: bytes, *, size: int, path: Path
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    header_len = len(raw)
    header = loads_object(raw, path=path, what="safetensors header")
    data_len = size - 8 - header_len

    metadata_obj = header.pop(_METADATA, {})
    if not isinstance(metadata_obj, dict) or not all(
        isinstance(v, str) for v in metadata_obj.values()
    ):
        raise corrupt(path, "safetensors __metadata__ is not a str -> str object")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        infos[name] = _parse_entry(path, name, entry)
    cursor = 0
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != cursor:
            raise corrupt(path, f"tensor {name!r} starts at {info.begin}, expected {cursor}")
        cursor = info.end
    if cursor != data_len:
        raise corrupt(
            path, f"tensor data is {data_len} bytes but the header describes {cursor} bytes"
        )
    return infos, dict(metadata_obj)


def map_tensors(buffer: Any, *, path: Path) -> dict[str, torch.Tensor]:
    """Tensors viewing the safetensors file content `buffer` without copying it.

    `buffer` is a writable buffer of the whole file, e.g. a copy-on-write (ACCESS_COPY) mmap;
    the tensors keep it alive. The header is checked first (CheckpointCorruptError naming
    `path`). A tensor whose offset is not aligned to its element size is copied instead.
    """
    size = len(buffer)
    header_len = _header_length(bytes(buffer[:8]), size, path)
    infos, _ = _parse_header(bytes(buffer[8 : 8 + header_len]), size=size, path=path)
    start = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, info in infos.items():
        dtype = _DTYPES[info.dtype]
        nbytes = info.end - info.begin
        if nbytes == 0:
            tensors[name] = torch.empty(info.shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start + info.begin)
        if (start + info.begin) % dtype.itemsize:
            raw = raw.clone()  # unaligned (not written by us): view() would refuse
        tensors[name] = raw.view(dtype).view(info.shape)
    return tensors


def _parse_entry(path: Path, name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict):
        raise corrupt(path, f"header entry {name!r} is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise corrupt(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not is_shape(shape):
        raise corrupt(path, f"tensor {name!r} has invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise corrupt(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise corrupt(
            path,
            f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} "
            f"needs {nbytes}",
        )
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load every tensor of `path` (CPU) after checking its header."""
    infos, _ = read_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in infos}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise corrupt(path, f"safetensors could not read it ({exc})") from exc
    for name, info in infos.items():
        tensor = tensors[name]
        if tensor.dtype != _DTYPES[info.dtype] or tuple(tensor.shape) != info.shape:
            raise corrupt(path, f"tensor {name!r} read back as {tensor.dtype}{list(tensor.shape)}")
    return tensors
