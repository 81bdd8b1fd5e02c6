"""A tier-0 snapshot of CUDA state staged through one image of its file on the GPU.

    the rank's tensors --one multi-tensor copy (device to device)--> the file image on the GPU
    the image --sum64 of every chunk, a reduction on the GPU--> a few sums --> the slot's manifest
    the image's data --one copy (device to host)--> the tier-0 slot (ckpt/tier0.py)

Why: a snapshot every step otherwise copies each tensor to the host on its own (~600 copy launches
for a GPT and its AdamW state, issued from a writer thread that holds the GIL meanwhile), and the
node's helper then reads the whole slot back to checksum it (sum64 of 1.2 GB on 8 threads, every
step): 2.4 GB of host memory traffic per step and CPU time beside the training thread, which
launches the kernels. Here the host only receives the bytes.

Measured (one H200, GPT 124M, tier 0 every step, bench/results/goodput_cuda_h200_session41_*.json):
it does not pay there. The GPU's extra ~1 ms per step (gpu_fb 0.157 -> 0.159-0.162 s) costs more
than the host work saves: 0.9832 of the no-checkpoint throughput against 0.9899 with the host
checksum in the same run (0.9773 against 0.9835 in another). So it is off by default
(CheckpointConfig.device_image); it is for hosts whose CPU, not the GPU, bounds the step.

The checksum is the same sum64 the host computes (ckpt/checksum.py), so restore verifies the slot as
before. A chunk's sum is linear in its bytes: bytes the GPU image does not hold (the file's header,
tensors that live on the CPU such as RNG states and step counters) are zero there, and their part of
each chunk's sum is added on the host from those few bytes (`HostBytes`).

Cost: 1 x the rank's state bytes of GPU memory, held from the first snapshot while the layout stays,
and ~1 ms of GPU time per snapshot of 1.2 GB (a gather and a read of the image), on the snapshot's
side stream.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckpt.checksum import Checksum, chunk_count, sum64_checksum

HOST_BYTES_MAX = 1 << 20
"""The most bytes outside the GPU image a snapshot may have (summed on the host per snapshot, one index per
byte); a state with more on the CPU is staged tensor by tensor and checksummed on the host instead."""


class HostBytes:
    """The part of each chunk's sum64 that bytes at given file offsets contribute: byte b at offset o adds
    b * 256^(o mod 8) to the sum of chunk o // chunk_bytes (little-endian words), modulo 2^64."""

    def __init__(self, offsets: torch.Tensor, chunk_bytes: int, chunks: int) -> None:
        self.offsets = offsets
        self.weights = torch.tensor([1 << (8 * k) for k in range(8)], dtype=torch.int64)[offsets % 8]
        self.chunk = offsets // chunk_bytes
        self.chunks = chunks

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per chunk, the sum over these bytes (`values`: uint8, one per offset), as int64 (wrapping)."""
        total = torch.zeros(self.chunks, dtype=torch.int64)
        if len(self.offsets):
            total.index_add_(0, self.chunk, values.to(torch.int64) * self.weights)  # int64 wraps: modulo 2^64
        return total


def device_sums(image: torch.Tensor, file_bytes: int, chunk_bytes: int) -> torch.Tensor:
    """The sum64 of every chunk of `image` (uint8, the file's bytes zero-padded to whole words), on its
    device: int64 sums, one per chunk (a reduction wraps modulo 2^64)."""
    words = image.view(torch.int64)
    per_chunk = chunk_bytes // 8
    whole = file_bytes // chunk_bytes
    parts = [words[: whole * per_chunk].view(whole, per_chunk).sum(dim=1)] if whole else []
    if file_bytes % chunk_bytes or not file_bytes:
        parts.append(words[whole * per_chunk :].sum().reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@dataclass
class ImagePlan:
    """Where a layout's tensors go in the file image and which bytes the host adds to its checksum."""

    prefix_bytes: int
    file_bytes: int
    chunk_bytes: int
    on_device: list[int]
    """Indices (into the layout's slots) of the tensors gathered into the GPU image."""
    host_data: torch.Tensor
    """Offsets, in the data section, of the bytes not in the GPU image (tensors kept on the CPU)."""
    host: HostBytes
    """Their part of the checksum (file offsets)."""
    prefix_sums: torch.Tensor
    """The header's part of the checksum (the same for every snapshot of this layout)."""

    @staticmethod
    def of(prefix: bytes, slots: Sequence[tuple[int, int]], on_device: Sequence[bool],
           chunk_bytes: int) -> ImagePlan | None:
        """`slots`: (begin, end) in the data section per tensor, in file order. None when more than
        HOST_BYTES_MAX bytes would stay on the host, or chunk_bytes is not whole words."""
        if chunk_bytes <= 0 or chunk_bytes % 8:
            return None
        host = [(b, e) for (b, e), here in zip(slots, on_device, strict=True) if not here and e > b]
        if sum(e - b for b, e in host) > HOST_BYTES_MAX:
            return None
        data_bytes = max((e for _, e in slots), default=0)
        file_bytes = len(prefix) + data_bytes
        chunks = chunk_count(file_bytes, chunk_bytes)
        host_data = torch.cat([torch.arange(b, e, dtype=torch.int64) for b, e in host]
                              or [torch.zeros(0, dtype=torch.int64)])
        prefix_part = HostBytes(torch.arange(len(prefix), dtype=torch.int64), chunk_bytes, chunks)
        return ImagePlan(
            prefix_bytes=len(prefix), file_bytes=file_bytes, chunk_bytes=chunk_bytes,
            on_device=[i for i, here in enumerate(on_device) if here], host_data=host_data,
            host=HostBytes(host_data + len(prefix), chunk_bytes, chunks),
            prefix_sums=prefix_part.sums(torch.tensor(list(prefix), dtype=torch.uint8)))

    @property
    def image_bytes(self) -> int:
        """The GPU image's size: the file, zero-padded to whole 8-byte words."""
        return self.file_bytes + (-self.file_bytes % 8)

    def views(self, image: torch.Tensor, slots: Sequence[tuple[int, int, torch.dtype, tuple[int, ...]]]
              ) -> list[torch.Tensor]:
        """The image's view of each gathered tensor (`slots`: begin, end, dtype, shape per layout slot)."""
        base = self.prefix_bytes
        return [image[base + slots[i][0] : base + slots[i][1]].view(slots[i][2]).view(slots[i][3])
                for i in self.on_device]

    def data(self, image: torch.Tensor) -> torch.Tensor:
        """The image's data section (what goes to the slot's data region)."""
        return image[self.prefix_bytes : self.file_bytes]

    def checksum(self, device_part: torch.Tensor, data: torch.Tensor) -> Checksum:
        """The file's sum64 checksum: the GPU image's sums (`device_part`, int64 on the host) plus the
        header's and the bytes the host holds (`data`: the slot's data region, uint8, with the CPU tensors
        copied in)."""
        total = device_part + self.prefix_sums + self.host.sums(data[self.host_data])
        return sum64_checksum([int(v) for v in total.tolist()], self.chunk_bytes)


class DeviceImage:
    """One rank's GPU file image for one layout and device, allocated once (1 x the state bytes)."""

    def __init__(self, plan: ImagePlan, device: torch.device, stream: torch.cuda.Stream,
                 slots: Sequence[tuple[int, int, torch.dtype, tuple[int, ...]]]) -> None:
        self.plan = plan
        with torch.cuda.device(device), torch.cuda.stream(stream):  # the side stream owns the memory
            self.image = torch.zeros(plan.image_bytes, dtype=torch.uint8, device=device)
        self.dsts = plan.views(self.image, slots)
        self._sums: dict[int, torch.Tensor] = {}
        self._issuing = threading.Lock()
        """The writer and the tier-0 thread may each issue a snapshot: one gather, sum and copy-out at a time."""

    def sums_for(self, into: torch.Tensor) -> torch.Tensor:
        """The page-locked chunk sums of the snapshots into `into` (a tier-0 slot): one buffer per slot, so a
        snapshot into the other slot does not overwrite them before this one's manifest is written."""
        sums = self._sums.get(into.data_ptr())
        if sums is None:
            if len(self._sums) >= 8:  # slots remapped elsewhere: the old addresses go
                self._sums.clear()
            chunks = chunk_count(self.plan.file_bytes, self.plan.chunk_bytes)
            sums = self._sums[into.data_ptr()] = torch.empty(chunks, dtype=torch.int64, pin_memory=True)
        return sums

    def issue(self, stream: torch.cuda.Stream, after: torch.cuda.Event, srcs: list[torch.Tensor],
              into: torch.Tensor, sums: torch.Tensor) -> torch.cuda.Event:
        """Gather `srcs` into the image, sum its chunks into `sums` and copy its data into `into` (the slot's
        data region), all on `stream` after `after`; returns the event that marks them done. The next
        snapshot's gather waits for this one's copy out: they are on the same stream."""
        plan = self.plan
        with self._issuing, torch.cuda.device(stream.device), torch.cuda.stream(stream):
            stream.wait_event(after)
            torch._foreach_copy_(self.dsts, srcs)
            sums.copy_(device_sums(self.image, plan.file_bytes, plan.chunk_bytes), non_blocking=True)
            into[: plan.file_bytes - plan.prefix_bytes].copy_(plan.data(self.image), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done


def plan_image(prefix: bytes, slots: Sequence[tuple[int, int]], devices: Sequence[torch.device],
               chunk_bytes: int) -> tuple[ImagePlan, torch.device] | None:
    """The plan when a GPU image fits this state: its CUDA tensors all on one device, nothing on a device
    other than that one and the CPU, and at most HOST_BYTES_MAX bytes on the CPU. Else None."""
    cuda = {d for d in devices if d.type == "cuda"}
    if len(cuda) != 1 or any(d.type not in ("cuda", "cpu") for d in devices):
        return None
    device = next(iter(cuda))
    plan = ImagePlan.of(prefix, slots, [d == device for d in devices], chunk_bytes)
    return None if plan is None else (plan, device)

