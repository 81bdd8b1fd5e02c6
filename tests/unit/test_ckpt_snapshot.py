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


def test_copies_gathered_through_a_bounce_buffer_land_exactly_and_nowhere_else() -> None:
    # A device's snapshot copies go through a small bounce buffer (ckpt/snapshot.py, _gather_pieces): runs of
    # slots adjacent in the host buffer, split at the bounce buffer's size, one copy per dtype into it and one
    # out. Here on CPU tensors (the streams aside, the same code): one "device" owns every slot but `other`,
    # which lies between two of its runs and must keep its bytes; `big` exceeds the bounce buffer.
    from ckpt.snapshot import _copy_piece, _gather_pieces, _slot_view  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    source = {"a": torch.randn(7, 3, generator=g), "b": torch.randn(5, generator=g, dtype=torch.float64),
              "c": torch.randint(0, 100, (9,), generator=g, dtype=torch.int32), "big": torch.randn(64, generator=g),
              "h": torch.randn(6, generator=g).bfloat16(), "e": torch.zeros(0, 3), "other": torch.ones(4),
              "t": torch.randn(4, 4, generator=g).t(), "s": torch.tensor(2.5)}
    layout = StagingLayout.of(source)
    buffer = torch.full((layout.data_bytes,), 0xAB, dtype=torch.uint8)
    slots = [s for s in layout.slots if s.name != "other"]
    pieces = _gather_pieces(slots, buffer, torch.empty(96, dtype=torch.uint8))
    assert any(p.direct is not None for p in pieces) and sum(p.direct is None for p in pieces) >= 3
    dsts = [_slot_view(buffer, s) for s in slots]
    srcs = [source[s.name] for s in slots]
    for piece in pieces:
        _copy_piece(piece, dsts, srcs)
    for slot in layout.slots:
        if slot.name == "other":
            assert bool((buffer[slot.begin:slot.end] == 0xAB).all())
        else:
            assert torch.equal(_slot_view(buffer, slot), source[slot.name]), slot.name


@cuda
def test_cuda_copies_through_a_small_bounce_buffer_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt.snapshot  # noqa: PLC0415

    monkeypatch.setattr(ckpt.snapshot, "BOUNCE_BYTES", 4096)
    area = StagingArea()
    source = {k: v.cuda() for k, v in tensors().items() if k != "conj"}
    source["big"] = torch.randn(1 << 20, device="cuda")
    source["t"] = torch.randn(64, 32, device="cuda").t()
    source["host"] = torch.arange(7, dtype=torch.int16)  # a CPU tensor among them
    for _ in range(2):  # the second save reuses the plan's pieces
        snapshot = area.stage(source, area.layout_for(source), overlapped=True)
        snapshot.run_deferred_copies()
        assert snapshot.wait(30.0)
        staged = snapshot.tensors()
        for name, tensor in source.items():
            assert torch.equal(staged[name], tensor.cpu()), name
        for t in source.values():
            if t.is_cuda:
                t.add_(1) if t.is_floating_point() else t.neg_()
    area.release()
