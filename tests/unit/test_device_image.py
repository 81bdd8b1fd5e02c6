"""Tier-0 snapshots staged through a GPU file image (ckpt/device_image.py): the checksum summed in pieces
(the image's chunks on the device, the header and CPU tensors on the host) is the host's sum64 of the
whole file, bit for bit; on a CUDA machine the snapshots restore exactly and verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer
from ckpt.checksum import digest_parts, sum64_checksum, sum64_from_chunks
from ckpt.device_image import HOST_BYTES_MAX, ImagePlan, device_sums
from ckpt.snapshot import StagingLayout
from ckpt.tier0 import snapshot_manifest

pytestmark = pytest.mark.timeout(60)


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of every element size, odd lengths (slots that share 8-byte words) and bytes with the high bit."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(37, 11, generator=g),
        "h": torch.randn(13, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(1 << 62), 1 << 62, (5,), generator=g, dtype=torch.int64),
        "b": torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
        "s": torch.tensor(3.0),
        "rng": torch.randint(0, 256, (29,), generator=g, dtype=torch.uint8),
    }


def file_image(layout: StagingLayout, tensors: dict[str, torch.Tensor]) -> bytearray:
    image = bytearray(layout.prefix) + bytearray(layout.data_bytes)
    for slot in layout.slots:
        raw = tensors[slot.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        image[len(layout.prefix) + slot.begin : len(layout.prefix) + slot.end] = raw
    return image


@pytest.mark.parametrize("chunk_bytes", [8, 64, 1024, 1 << 20])
@pytest.mark.parametrize("on_cpu", [(), ("s", "rng"), ("w", "h", "i", "b", "s", "rng")])
def test_the_checksum_summed_in_pieces_is_the_hosts_sum64_of_the_whole_file(chunk_bytes: int,
                                                                             on_cpu: tuple[str, ...]) -> None:
    tensors = mixed_state(chunk_bytes)
    layout = StagingLayout.of(tensors)
    image_bytes = file_image(layout, tensors)
    expected = digest_parts([memoryview(image_bytes)], algorithm="sum64", chunk_bytes=chunk_bytes)

    plan = ImagePlan.of(layout.prefix, [(s.begin, s.end) for s in layout.slots],
                        [s.name not in on_cpu for s in layout.slots], chunk_bytes)
    assert plan is not None
    device_image = torch.zeros(plan.image_bytes, dtype=torch.uint8)  # stands in for the GPU's image
    on_device = [s for s in layout.slots if s.name not in on_cpu]
    for view, slot in zip(plan.views(device_image, [(s.begin, s.end, s.dtype, s.shape) for s in layout.slots]),
                          on_device, strict=True):
        view.copy_(tensors[slot.name])
    data = torch.frombuffer(image_bytes, dtype=torch.uint8)[len(layout.prefix):]  # the slot, every tensor in it
    assert torch.equal(plan.data(device_image)[[i for s in on_device for i in range(s.begin, s.end)]],
                       data[[i for s in on_device for i in range(s.begin, s.end)]])

    got = plan.checksum(device_sums(device_image, plan.file_bytes, chunk_bytes), data)
    assert (got.digest, got.chunks) == (expected.digest, expected.chunks)
    assert sum64_from_chunks(got.chunks, chunk_bytes) == got

    # A byte the host holds, changed in the slot, changes the checksum (the device's part comes from the GPU).
    if on_cpu:
        slot = next(s for s in layout.slots if s.name == on_cpu[0])
        flipped = data.clone()
        flipped[slot.begin] ^= 0x80
        assert plan.checksum(device_sums(device_image, plan.file_bytes, chunk_bytes), flipped).digest != got.digest


def test_a_state_mostly_on_the_cpu_or_odd_chunks_get_no_device_image() -> None:
    big = {"gpu": torch.zeros(4), "cpu": torch.zeros(HOST_BYTES_MAX // 4 + 1)}
    layout = StagingLayout.of(big)
    slots = [(s.begin, s.end) for s in layout.slots]
    assert ImagePlan.of(layout.prefix, slots, [s.name == "gpu" for s in layout.slots], 1 << 20) is None
    assert ImagePlan.of(layout.prefix, slots, [True, True], 1 << 20) is not None
    assert ImagePlan.of(layout.prefix, slots, [True, True], 12) is None  # not whole words


def test_a_given_checksum_that_does_not_fit_the_slot_is_refused_not_written() -> None:
    image = memoryview(bytearray(range(256)) * 40)
    fits = sum64_checksum([1, 2], 8192)
    manifest = json.loads(snapshot_manifest(image, step=1, rank=0, world_size=1, generation="g", run="r",
                                            run_uid="u", chunk_bytes=8192, tensors={}, shards={}, skeleton={},
                                            pool=None, checksum=fits))
    assert manifest["step"] == 1
    with pytest.raises(ValueError, match="does not fit a 10240-byte slot"):
        snapshot_manifest(image, step=1, rank=0, world_size=1, generation="g", run="r", run_uid="u",
                          chunk_bytes=8192, tensors={}, shards={}, skeleton={}, pool=None,
                          checksum=sum64_checksum([1, 2, 3], 8192))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["overlapped", "staged"])
def test_cuda_snapshots_through_the_device_image_restore_exactly_and_verify(tmp_path: Path, shm: Path,
                                                                            mode: str) -> None:
    from ckpt.device_image import DeviceImage
    from ckpt.layout import MANIFEST_FILE, STATE_FILE
    from ckpt.manifest import parse_manifest

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1 << 20, device="cuda", generator=g)
    h = torch.randn(4097, device="cuda", generator=g).to(torch.bfloat16)  # odd bytes: shares words with "s"
    config = CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm, mode=mode, device_image=True)
    with Checkpointer(config, rank=0, world_size=1) as ck:
        for step in range(1, 4):
            w.add_(1.0)  # queued before the snapshot: must be in it
            state = {"w": w, "h": h, "s": torch.tensor(float(step)), "rng": torch.get_rng_state()}
            pending = ck.snapshot(step, state)
            ck.wait_staged()
            expected = {"w": w.cpu(), "h": h.cpu(), "s": state["s"].clone(), "rng": state["rng"].clone()}
            w.mul_(2.0)  # after wait_staged: must not reach the snapshot
            pending.wait_persisted()
            assert not pending.skipped, pending.metrics.error
            w.div_(2.0)
        image = ck._writer.staging._image
        assert image is not None and isinstance(image[1], DeviceImage)  # the path under test was taken
    for slot in shm.glob("rank_00000/slot_*"):
        manifest = parse_manifest((slot / MANIFEST_FILE).read_bytes(), path=slot / MANIFEST_FILE)
        entry = manifest.files[STATE_FILE]
        host = digest_parts([memoryview(bytearray((slot / STATE_FILE).read_bytes()))], algorithm="sum64",
                            chunk_bytes=entry.checksum.chunk_bytes)
        assert entry.checksum.digest == host.digest  # what the GPU summed is what the host reads
    with Checkpointer(config, rank=0, world_size=1) as again:
        restored = again.restore()
        assert restored is not None and (restored.step, restored.tier) == (3, "memory")
        for name, tensor in expected.items():
            assert torch.equal(restored.state[name].cpu(), tensor), name
