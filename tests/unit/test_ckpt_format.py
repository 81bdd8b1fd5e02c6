"""Unit tests of the on-disk format: our safetensors writer/reader and the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckpt.errors import CheckpointCorruptError, CheckpointVersionError
from ckpt.format import MANIFEST_VERSION
from ckpt.manifest import FileEntry, Manifest, TensorEntry, parse_manifest, resolve_file
from ckpt.safetensors_io import read_header, read_safetensors, write_safetensors

pytestmark = pytest.mark.timeout(30)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f64": torch.randn(3, 2, dtype=torch.float64, generator=g),
        "f32_nan": torch.tensor([float("nan"), float("inf"), -0.0, 1.5]),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "i64": torch.tensor([-(2**62), 2**62 + 1]),
        "i32": torch.arange(-3, 4, dtype=torch.int32),
        "i16": torch.tensor([-7, 300], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64_conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "uses_grad": torch.ones(2, requires_grad=True) * 3,
    }
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            out[name] = torch.tensor([0, 1, 7], dtype=getattr(torch, name))
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            out[name] = torch.tensor([0.5, -2.0]).to(getattr(torch, name))
    return out


def test_written_file_is_read_by_safetensors_library_with_identical_tensors(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "s.safetensors"
    nbytes, sha = write_safetensors(path, tensors, metadata={"format": "pt"})

    data = path.read_bytes()
    assert nbytes == len(data)
    assert sha == hashlib.sha256(data).hexdigest()
    loaded = safetensors.torch.load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, expected in tensors.items():
        expected = expected.detach().resolve_conj()
        assert loaded[name].dtype == expected.dtype, name
        assert loaded[name].shape == expected.shape, name
        assert raw_bytes(loaded[name]) == raw_bytes(expected), name
    ours = read_safetensors(path)
    for name in tensors:
        assert raw_bytes(ours[name]) == raw_bytes(loaded[name]), name


def test_layout_is_aligned_and_padded(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    write_safetensors(path, sample_tensors(), metadata={"step": "3"})
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert header_len % 8 == 0
    infos, metadata = read_header(path)
    assert metadata == {"step": "3"}
    for name, info in infos.items():
        itemsize = safetensors.torch._getdtype(info.dtype).itemsize
        assert info.begin % itemsize == 0, name


def test_reads_file_written_by_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "lib.safetensors"
    tensors = {"a": torch.randn(4, 4).to(torch.bfloat16), "b": torch.arange(5)}
    safetensors.torch.save_file(tensors, str(path))
    loaded = read_safetensors(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_unsupported_dtype_raises_type_error_before_creating_file(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    with pytest.raises(TypeError, match="'bad'.*complex128"):
        write_safetensors(
            path, {"ok": torch.zeros(1), "bad": torch.zeros(1, dtype=torch.complex128)}
        )
    assert not path.exists()


def test_huge_header_length_is_rejected_without_allocating(tmp_path: Path) -> None:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}" + b"\0" * 64)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptError, match="garbage.safetensors.*header length"):
            read_safetensors(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("header", "tail", "match"),
    [
        (b"not json at all!", b"", "not valid JSON"),
        (b"[1, 2, 3]       ", b"", "expected an object"),
        (
            json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(),
            b"\0" * 8,
            "describes 16 bytes",
        ),
        (
            json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode(),
            b"\0" * 8,
            "needs 16",
        ),
        (
            json.dumps({"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode(),
            b"\0",
            "unknown dtype",
        ),
        (
            json.dumps({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}).encode(),
            b"\0",
            "invalid shape",
        ),
    ],
)
def test_malformed_header_is_corrupt(
    tmp_path: Path, header: bytes, tail: bytes, match: str
) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + tail)
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        read_safetensors(path)
    assert info.value.path == path
    assert str(path) in str(info.value)


def _manifest(**overrides: object) -> dict[str, object]:
    obj: dict[str, object] = json.loads(
        Manifest(
            step=7,
            rank=1,
            world_size=2,
            files={"state.safetensors": FileEntry("ab" * 32, 10)},
            tensors={"w": TensorEntry("state.safetensors", "F32", (2, 3))},
            state={"w": {"__tensor__": "w"}},
        ).to_bytes()
    )
    obj.update(overrides)
    return obj


def test_manifest_roundtrip() -> None:
    path = Path("manifest.json")
    m = parse_manifest(json.dumps(_manifest()).encode(), path=path)
    assert (m.step, m.rank, m.world_size, m.format_version) == (7, 1, 2, 1)
    assert m.files["state.safetensors"].bytes == 10
    assert m.tensors["w"].shape == (2, 3)
    assert m.state == {"w": {"__tensor__": "w"}}
    assert isinstance(m.package_version, str) and m.package_version


def test_manifest_newer_format_version_raises_version_error() -> None:
    data = json.dumps(_manifest(format_version=MANIFEST_VERSION + 1, something_new=True)).encode()
    with pytest.raises(CheckpointVersionError, match="manifest.json.*newer elastic-train.*upgrade"):
        parse_manifest(data, path=Path("manifest.json"))


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", "", "a\\b"])
def test_manifest_file_entry_escaping_rank_dir_is_rejected(name: str) -> None:
    data = json.dumps(_manifest(files={name: {"sha256": "ab" * 32, "bytes": 1}})).encode()
    with pytest.raises(CheckpointCorruptError, match="manifest.json: file entry"):
        parse_manifest(data, path=Path("manifest.json"))


@pytest.mark.parametrize(
    "overrides",
    [
        {"rank": 2},
        {"step": -1},
        {"world_size": "2"},
        {"files": {"state.safetensors": {"sha256": "xyz", "bytes": 1}}},
        {"tensors": {"w": {"file": "other", "dtype": "F32", "shape": [1]}}},
        {"format_version": None},
    ],
)
def test_manifest_with_bad_fields_is_corrupt(overrides: dict[str, object]) -> None:
    with pytest.raises(CheckpointCorruptError, match="manifest.json"):
        parse_manifest(json.dumps(_manifest(**overrides)).encode(), path=Path("manifest.json"))


def test_symlink_leading_outside_rank_dir_is_rejected(tmp_path: Path) -> None:
    rank_dir = tmp_path / "rank_00000"
    rank_dir.mkdir()
    (tmp_path / "secret").write_bytes(b"x")
    (rank_dir / "state.safetensors").symlink_to(tmp_path / "secret")
    (rank_dir / "inside").write_bytes(b"y")
    assert resolve_file(rank_dir, "inside", manifest_path=rank_dir / "m") == rank_dir / "inside"
    with pytest.raises(CheckpointCorruptError, match="outside the rank directory"):
        resolve_file(rank_dir, "state.safetensors", manifest_path=rank_dir / "m")


def test_save_and_load_work_without_numpy(tmp_path: Path) -> None:
    script = """
import sys
sys.modules["numpy"] = None  # any `import numpy` now fails
import warnings; warnings.simplefilter("ignore")
import torch
from ckpt import Checkpointer, CheckpointConfig
c = Checkpointer(CheckpointConfig(local_dir=sys.argv[1]), rank=0, world_size=1)
t = torch.arange(6, dtype=torch.bfloat16)
c.save(1, {"t": t}); c.commit(1)
assert torch.equal(c.load(1)["t"], t)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,  # a deadline, not a timing check: importing torch is slow on a loaded machine
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
