"""The staging buffer: layout equal to the file's data section, reuse, CPU and CUDA copies."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckpt.snapshot import StagingArea, StagingLayout

pytestmark = pytest.mark.timeout(30)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 3, generator=g),
        "i8": torch.tensor([-1, 2, 3], dtype=torch.int8),
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
        "bf16": torch.randn(3, generator=g).bfloat16(),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 2),
        "conj": torch.randn(2, dtype=torch.complex64, generator=g).conj(),
    }


def test_staged_bytes_are_a_valid_safetensors_file(tmp_path: Path) -> None:
    area = StagingArea()
    source = tensors()
    layout = area.layout_for(source)
    snapshot = area.stage(source, layout, overlapped=False)
    data = b"".join(bytes(p) for p in snapshot.parts())
    assert len(data) == layout.file_bytes
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    for slot in layout.slots:  # every tensor aligned to its element size
        assert (8 + n + slot.begin) % slot.dtype.itemsize == 0, slot.name
    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    loaded = safetensors.torch.load_file(str(path))
    for name, tensor in source.items():
        assert torch.equal(loaded[name], tensor.resolve_conj()), name
    staged = snapshot.tensors()
    assert all(torch.equal(staged[n], t.resolve_conj()) for n, t in source.items())


def test_layout_and_buffer_are_reused_while_the_state_keeps_its_shapes() -> None:
    area = StagingArea()
    first = area.layout_for(tensors())
    assert area.layout_for(tensors()) is first
    area.stage(tensors(), first, overlapped=False)
    area.stage(tensors(), first, overlapped=False)
    assert area.allocations == 1 and area.capacity == first.data_bytes
    smaller = {"f32": torch.zeros(2)}
    area.stage(smaller, area.layout_for(smaller), overlapped=False)
    assert area.allocations == 1  # fits in the buffer it has
    with pytest.raises(TypeError, match="'bad'"):
        StagingLayout.of({"bad": torch.zeros(1, dtype=torch.complex128)})


def test_overlapped_cpu_copy_happens_when_the_writer_runs_it() -> None:
    area = StagingArea()
    source = {"w": torch.full((8,), 3.0)}
    snapshot = area.stage(source, area.layout_for(source), overlapped=True)
    assert not snapshot.is_consistent() and snapshot.wait(0.01) is False
    snapshot.run_deferred_copies()
    assert snapshot.wait(1.0) and torch.equal(snapshot.tensors()["w"], source["w"])


@cuda
def test_cuda_copy_is_pinned_async_and_exact() -> None:
    area = StagingArea()
    source = {k: v.cuda() for k, v in tensors().items() if k != "conj"}
    source["big"] = torch.randn(1 << 20, device="cuda")
    layout = area.layout_for(source)
    snapshot = area.stage(source, layout, overlapped=True)
    assert area.pinned
    assert not snapshot.wait(0.01)  # overlapped: the writer thread issues the copies
    snapshot.run_deferred_copies()
    assert snapshot.wait(30.0)
    staged = snapshot.tensors()
    for name, tensor in source.items():
        assert torch.equal(staged[name], tensor.cpu()), name
    assert staged["big"].is_pinned() or area._registered
    area.release()


@cuda
def test_cuda_snapshot_sees_queued_work_and_not_later_mutation() -> None:
    area = StagingArea()
    w = torch.zeros(1 << 22, device="cuda")
    w.add_(1.0)  # queued on the current stream before the save
    snapshot = area.stage({"w": w}, area.layout_for({"w": w}), overlapped=False)
    w.add_(1.0)  # after a staged save: must not reach the snapshot
    assert torch.equal(snapshot.tensors()["w"], torch.ones(1 << 22))
    area.release()
