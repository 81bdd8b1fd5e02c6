"""Host snapshot: copy a rank's tensors into one host staging buffer, the only part a save blocks on.

The staging buffer is laid out exactly like the data section of the safetensors file the
tier-1 writer will produce (tensors sorted by element size, then name), so the writer streams
`header + buffer` to disk without serialising anything. The buffer is allocated at the first
save and reused by every later save whose tensors fit in it.

Copies:
- CUDA tensors: the buffer is page-locked (cudaHostRegister on an exactly sized allocation,
  not the power-of-two rounding of torch's pinned allocator); the device-to-host copies are
  issued in one `_foreach_copy_` with non_blocking=True on a side stream per device, after that
  stream waited for an event recorded on the current stream when the snapshot was taken, and an
  event recorded after them tracks completion. In "overlapped" mode the writer thread issues them
  (~10 us of driver time per tensor), so the training thread pays only for that first event.
- CPU tensors: a plain copy (torch runs large copies on its intra-op threads).

Modes (CheckpointConfig.mode):
- "staged": save_async() returns once every copy is complete, i.e. once the snapshot is
  consistent. The loop may mutate the state at once.
- "overlapped": save_async() returns right after recording where the copies start (the writer
  thread issues the CUDA copies and does the CPU ones). The loop must call wait_staged() before
  it mutates the state, i.e. before optimizer.step(); forward and backward may run meanwhile
  (they only write activations and grads, which are not in the snapshot). torchtitan's
  "async_with_pinned_mem" works this way.

Memory cost, per rank:
- Both modes: one host buffer of the rank's state bytes (1x), page-locked when any tensor is on
  CUDA; no extra device memory. It is held from the first save until close(). Page-locked memory
  cannot be swapped or reclaimed: budget local ranks x state bytes per node (8 ranks x 8 GiB is
  64 GiB of host RAM).
- There is one buffer, not two: while a save persists the buffer is busy, and a new save waits
  or is skipped (CheckpointConfig.if_busy). Double buffering would cost 2x.
- "overlapped" costs no more memory than "staged"; it hides the copy behind compute instead, at
  the price of the wait_staged() call before the state is mutated.
- Writing the file also fills the OS page cache with the file's bytes (reclaimable).
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import compress, repeat

import torch

from ckpt.checksum import Checksum
from ckpt.device_image import DeviceImage, ImagePlan, plan_image
from ckpt.errors import CheckpointTimeoutError
from ckpt.safetensors_io import check_storable, plan_layout
from core.deadline import Deadline
from core.numbers import decimal

logger = logging.getLogger(__name__)

_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the staging buffer (and in the file's data section)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class StagingLayout:
    """The safetensors file prefix (length + header) and the tensor slots of one state."""

    prefix: bytes
    slots: tuple[Slot, ...]
    data_bytes: int

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> StagingLayout:
        """Plan the layout of `tensors`. Raises TypeError, naming the tensor, if one cannot be stored."""
        for name, tensor in tensors.items():
            check_storable(name, tensor)
        specs = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
        prefix, offsets, data_bytes = plan_layout(specs, metadata=_METADATA)
        slots = tuple(
            Slot(name, specs[name][0], specs[name][1], begin, end) for name, begin, end in offsets
        )
        return StagingLayout(prefix, slots, data_bytes)

    @property
    def file_bytes(self) -> int:
        return len(self.prefix) + self.data_bytes


def buffer_view(buffer: torch.Tensor, nbytes: int) -> memoryview:
    """A zero-copy memoryview of the first `nbytes` of a contiguous CPU uint8 tensor."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")


@dataclass
class _CopyPlan:
    """Where each tensor of a layout goes in one buffer, as (slot views, names) per kind of copy."""

    layout: StagingLayout
    names: list[str]
    devices: list[torch.device]
    seen: list[torch.Tensor]
    """The tensor objects the plan was made for (a new object on the same device fits too)."""
    cuda: dict[torch.device, tuple[list[torch.Tensor], list[str]]]
    cpu: tuple[list[torch.Tensor], list[str]]
    other: tuple[list[torch.Tensor], list[str]]

    @staticmethod
    def of(layout: StagingLayout, views: list[torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> _CopyPlan:
        names = [s.name for s in layout.slots]
        seen = [tensors[n] for n in names]
        plan = _CopyPlan(layout, names, [t.device for t in seen], seen, {}, ([], []), ([], []))
        for name, dst, t in zip(names, views, seen, strict=True):
            dsts, group = (plan.cuda.setdefault(t.device, ([], [])) if t.device.type == "cuda"
                           else plan.cpu if t.device.type == "cpu" else plan.other)
            dsts.append(dst)
            group.append(name)
        return plan


StateMark = dict[torch.device, torch.cuda.Event]
"""StagingArea.mark(): per device, an event recorded on its training stream at the moment of the mark."""


LAUNCH_BATCH = decimal(os.environ.get("ELASTIC_COPY_BATCH") or "32") or None  # junk: all in one call
"""Tensors per copy call when a background thread launches a snapshot's copies (DeviceCopies.issue);
$ELASTIC_COPY_BATCH overrides it (0: all in one call, as before; for benchmarks)."""


@dataclass
class DeviceCopies:
    """The device-to-host copies of one device, to be issued on a side stream after `after`, an event
    recorded on the training stream when the snapshot was taken (so they see exactly that state)."""

    stream: torch.cuda.Stream
    after: torch.cuda.Event
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]

    def issue(self, *, batch: int | None = None) -> torch.cuda.Event:
        """Launch the copies and return the event that marks them done.

        ~10 us of driver time per tensor (600 tensors for a GPT and its AdamW state: ~6 ms), all of it holding
        the GIL. Issued from a background thread (`batch`: tensors per call), they go in batches with the GIL
        let go between them: in one call they held the training thread up for those 6 ms just as it launched
        the next step's first kernels onto an idle GPU (a step ~2% slower on one H200)."""
        step = batch or len(self.srcs) or 1
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(self.after)
            for start in range(0, len(self.srcs), step):
                if start:
                    time.sleep(0)  # lets the training thread take the GIL
                torch._foreach_copy_(self.dsts[start:start + step], self.srcs[start:start + step], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


@dataclass
class ImageCopies:
    """A snapshot's copies through the device's file image (ckpt/device_image.py); `DeviceCopies`' interface."""

    image: DeviceImage
    stream: torch.cuda.Stream
    after: torch.cuda.Event
    srcs: list[torch.Tensor]
    into: torch.Tensor
    sums: torch.Tensor
    """This snapshot's own page-locked chunk sums (one per slot: a later snapshot does not overwrite them)."""

    def issue(self, *, batch: int | None = None) -> torch.cuda.Event:  # noqa: ARG002 - one gather, no batches
        return self.image.issue(self.stream, self.after, self.srcs, self.into, self.sums)


class HostSnapshot:
    """One save's copy of the state in the staging buffer.

    `wait()` returns once the copy is consistent; the writer then streams `parts()`.
    """

    def __init__(
        self,
        layout: StagingLayout,
        buffer: torch.Tensor,
        *,
        events: list[torch.cuda.Event],
        deferred: list[tuple[torch.Tensor, torch.Tensor]],
        sources: list[torch.Tensor],
        launches: list[DeviceCopies | ImageCopies] | None = None,
        image: tuple[ImagePlan, torch.Tensor] | None = None,
        cpu_after_device: bool = False,
    ) -> None:
        self.layout = layout
        self._buffer = buffer
        self._events = events
        self._deferred = [] if cpu_after_device else deferred
        self._after_device = deferred if cpu_after_device else []
        """CPU copies made once the device copies are done: a GPU image's copy out writes the whole data region,
        the CPU tensors' zeroed bytes included (`wait` makes them, on whichever thread gets there first)."""
        self._after_lock = threading.Lock()
        self._launches = launches or []
        self._sources = sources  # keeps the source tensors alive until their copies are done
        self._image = image
        """(plan, chunk sums) when the device copies went through a GPU image that summed the chunks."""
        self._cpu_done = threading.Event()
        self._error: BaseException | None = None
        if not self._deferred and not self._launches:
            self._cpu_done.set()

    @property
    def nbytes(self) -> int:
        return self.layout.file_bytes

    def run_deferred_copies(self) -> None:
        """Issue the device copies and do the CPU copies of an overlapped snapshot (on the writer thread)."""
        try:
            with torch.no_grad():
                for launch in self._launches:
                    self._events.append(launch.issue(batch=LAUNCH_BATCH))
                for dst, src in self._deferred:
                    dst.copy_(src)
        except BaseException as exc:  # reported to whoever waits on the snapshot
            self._error = exc
            raise
        finally:
            self._deferred, self._launches = [], []
            self._cpu_done.set()

    def is_consistent(self) -> bool:
        return self._cpu_done.is_set() and all(e.query() for e in self._events) and not self._after_device

    def wait(self, timeout: float) -> bool:
        """Block until the copy is complete; False if `timeout` seconds passed first.

        Raises the error of a failed deferred copy.
        """
        deadline = Deadline.after(timeout)
        if not self._cpu_done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        pause = 0.0002
        while not all(e.query() for e in self._events):
            if deadline.expired():
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        if self._after_device:  # only with a GPU image (CheckpointConfig.device_image): no lock on the default path
            with self._after_lock, torch.no_grad():
                for dst, src in self._after_device:
                    dst.copy_(src)
                self._after_device = []
        self._sources = []
        return True

    def require_consistent(self, timeout: float, what: str) -> None:
        """`wait`, raising CheckpointTimeoutError (a stuck device) when `timeout` passes first."""
        if not self.wait(timeout):
            raise CheckpointTimeoutError(
                f"the device-to-host copy of {what} did not finish within {timeout:.0f}s "
                f"(CheckpointConfig.stage_timeout); is the GPU stuck?"
            )

    def checksum(self) -> Checksum | None:
        """The file image's sum64 checksum when the GPU summed it (ckpt/device_image.py), else None (the
        host sums the slot). Only valid once the copy is consistent."""
        if self._image is None:
            return None
        plan, sums = self._image
        return plan.checksum(sums, self._buffer)

    def parts(self) -> list[memoryview]:
        """The file's bytes: [length + header, data]. Only valid once the copy is consistent."""
        return [memoryview(self.layout.prefix), buffer_view(self._buffer, self.layout.data_bytes)]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views of the staged tensors in the buffer (valid until the buffer is reused)."""
        return {s.name: _slot_view(self._buffer, s) for s in self.layout.slots}


def _fits(t: torch.Tensor, slot: Slot) -> bool:
    """Whether `t` can be copied into `slot` (a dtype the layout was planned with is storable)."""
    return (t.dtype == slot.dtype and tuple(t.shape) == slot.shape and t.layout == torch.strided
            and not t.is_quantized and t.device.type != "meta")


def _slot_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    return buffer[slot.begin : slot.end].view(slot.dtype).view(slot.shape)


def host_register(address: int, nbytes: int) -> bool:
    """Page-lock `nbytes` of host memory at `address` for fast, asynchronous device copies
    (cudaHostRegister); False (logged) when the driver refuses."""
    rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, 1)
    if int(rc) != 0:
        logger.warning("cudaHostRegister of %d bytes failed (%s)", nbytes, rc)
        return False
    return True


def host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class StagingArea:
    """The reusable host buffer of one rank, plus its CUDA side streams."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._registered = False
        self._pinned = False
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._layout: StagingLayout | None = None
        self._seen: dict[str, torch.Tensor] = {}
        """The tensors the last layout_for() call was given (it checks only those that are not these)."""
        self._plans: dict[int, _CopyPlan] = {}
        """Per buffer address (the two tier-0 slots take turns), the last stage()'s (layout, [(name, slot view,
        device type, tensor)]): a snapshot of the same tensors reuses it instead of visiting every tensor."""
        self._views: dict[int, tuple[StagingLayout, list[torch.Tensor]]] = {}
        """The slot views of the last layout per buffer address: rebuilding ~250 of them cost ~40 ms a save."""
        self.allocations = 0
        """How many times a buffer was allocated (1 in steady state)."""
        self._image: tuple[StagingLayout, int, tuple[torch.device, ...], DeviceImage | None] | None = None
        """(layout, chunk size, devices, its GPU file image or None) of the newest tier-0 snapshot."""
        self._image_refused = False

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        return self._pinned

    def layout_for(self, tensors: Mapping[str, torch.Tensor]) -> StagingLayout:
        """The layout of `tensors`, reusing the last one (and its header) when it still fits. A tensor that is
        the same object as in the last call fits as it did (it cannot change its dtype or device; a shape
        changed in place fails the copy): a snapshot every step checks only the tensors that are new."""
        last, seen = self._layout, self._seen
        if last is not None and len(last.slots) == len(tensors):
            names = [s.name for s in last.slots]
            current = list(map(tensors.get, names))  # C loops throughout: ~20 us for 600 tensors
            new = compress(zip(current, last.slots, strict=True), map(operator.is_not, current, map(seen.get, names)))
            if all(map(operator.is_not, current, repeat(None))) and all(
                    t is not None and _fits(t, slot) for t, slot in new):
                self._seen = dict(tensors)
                return last
        self._layout = StagingLayout.of(tensors)
        self._seen = dict(tensors)
        return self._layout

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: StagingLayout,
        *,
        overlapped: bool,
        timeout: float = 300.0,
        into: torch.Tensor | None = None,
        at: StateMark | None = None,
        image_chunk: int | None = None,
    ) -> HostSnapshot:
        """Copy `tensors` into the buffer (or into `into`, a uint8 CPU tensor of the layout's data
        bytes: a tier-0 slot); in overlapped mode only start the copies. `at` (from `mark()`, earlier):
        the device copies see the state as it was then, not now. `image_chunk` (with `into`): stage CUDA
        state through one file image on its GPU, which also sums it in chunks of this many bytes
        (ckpt/device_image.py; `HostSnapshot.checksum()`), when the state allows it.

        Raises CheckpointTimeoutError when a device copy is not done within `timeout` seconds (a
        stuck device)."""
        if into is None:
            self._ensure(layout.data_bytes, pin=self.needs_pin(tensors))
            assert self._buffer is not None
            into = self._buffer
        events: list[torch.cuda.Event] = []
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        sources: list[torch.Tensor] = []
        plan = self._plan_for(tensors, layout, into)
        with torch.no_grad():
            cpu_dsts, cpu_names = plan.cpu
            image = self._image_for(layout, plan, image_chunk) if image_chunk and into is not None else None
            if overlapped or image is not None:
                deferred = list(zip(cpu_dsts, map(tensors.__getitem__, cpu_names), strict=True))
            else:
                for dst, src in zip(cpu_dsts, map(tensors.__getitem__, cpu_names), strict=True):
                    dst.copy_(src)
            for dst, src in zip(plan.other[0], map(tensors.__getitem__, plan.other[1]), strict=True):
                dst.copy_(src)
            launches: list[DeviceCopies | ImageCopies] = []
            summed = None
            for device, (dsts, names) in plan.cuda.items():
                taken = (at or {}).get(device)
                if taken is None:
                    taken = torch.cuda.Event()
                    taken.record(torch.cuda.current_stream(device))
                srcs = list(map(tensors.__getitem__, names))
                copies: DeviceCopies | ImageCopies
                if image is not None:
                    sums = image.sums_for(into)
                    copies = ImageCopies(image, self._stream(device), taken, srcs, into, sums)
                    summed = (image.plan, sums)
                else:
                    copies = DeviceCopies(self._stream(device), taken, dsts, srcs)
                sources.extend(copies.srcs)
                if overlapped:  # launched by the writer thread: the training thread only records an event
                    launches.append(copies)
                else:
                    events.append(copies.issue())
        sources.extend(map(operator.itemgetter(1), deferred))
        snapshot = HostSnapshot(layout, into, events=events, deferred=deferred, sources=sources, launches=launches,
                                image=summed, cpu_after_device=image is not None)
        if not overlapped:
            snapshot.require_consistent(timeout, "the checkpoint")
        return snapshot

    def _image_for(self, layout: StagingLayout, plan: _CopyPlan, chunk_bytes: int) -> DeviceImage | None:
        """The GPU file image for `layout` (made at its first snapshot, 1 x the state bytes of GPU memory), or
        None when the state does not allow one or the GPU has no room (logged once; copies per tensor then)."""
        devices = tuple(plan.devices)  # a tensor that moved device keeps its layout, not its plan
        cached = self._image
        if cached is not None and cached[0] is layout and cached[1:3] == (chunk_bytes, devices):
            return cached[3]
        self._image = None  # a new layout: the old image goes (its memory stays with the side stream's pool)
        found = None if self._image_refused else plan_image(
            layout.prefix, [(s.begin, s.end) for s in layout.slots], plan.devices, chunk_bytes)
        image = None
        if found is not None:
            image_plan, device = found
            try:
                image = DeviceImage(image_plan, device, self._stream(device),
                                    [(s.begin, s.end, s.dtype, s.shape) for s in layout.slots])
            except torch.OutOfMemoryError:
                self._image_refused = True
                logger.warning("no room on %s for a %d-byte image of the snapshot: copying it tensor by tensor "
                               "and checksumming it on the host (CheckpointConfig.device_image)", device,
                               image_plan.image_bytes)
        self._image = (layout, chunk_bytes, devices, image)
        return image

    def _plan_for(self, tensors: Mapping[str, torch.Tensor], layout: StagingLayout, into: torch.Tensor) -> _CopyPlan:
        """Which slot view of `into` each tensor goes to, grouped by device; reused while the tensors are the
        same objects, or new ones on the same device (the RNG states of each step)."""
        plan = self._plans.get(into.data_ptr())
        if plan is not None and plan.layout is layout:
            # C loops over every tensor (a snapshot every step); Python only for the few new objects.
            current = list(map(tensors.__getitem__, plan.names))
            new = compress(zip(current, plan.devices, strict=True), map(operator.is_not, current, plan.seen))
            if all(t.device == device for t, device in new):
                plan.seen = current  # the next check finds these objects again (tensors of each step stay new)
                return plan
        plan = _CopyPlan.of(layout, self._slot_views(layout, into), tensors)
        if len(self._plans) >= 4:
            self._plans.clear()
        self._plans[into.data_ptr()] = plan
        return plan

    def mark(self) -> StateMark:
        """Where each device's training stream is now, for a `stage(at=...)` made later: an event recorded on
        the current stream of every device the last staged tensors were on (~5 us each). A device not marked
        (the state moved) is marked when staged."""
        devices = {d for plan in self._plans.values() for d in plan.cuda}
        events: StateMark = {}
        for device in devices:
            event = events[device] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return events

    @staticmethod
    def needs_pin(tensors: Mapping[str, torch.Tensor]) -> bool:
        # No CUDA tensor exists in a process that never initialized CUDA: no walk of every tensor then.
        return torch.cuda.is_initialized() and any(t.device.type == "cuda" for t in tensors.values())

    def _slot_views(self, layout: StagingLayout, buffer: torch.Tensor) -> list[torch.Tensor]:
        key = buffer.data_ptr()
        cached = self._views.get(key)
        if cached is None or cached[0] is not layout:
            if len(self._views) >= 4:  # two tier-0 slots, or one buffer: old layouts go
                self._views.clear()
            cached = self._views[key] = (layout, [_slot_view(buffer, s) for s in layout.slots])
        return cached[1]

    def reserve(self, tensors: Mapping[str, torch.Tensor]) -> StagingLayout:
        """Allocate (and fault in) the buffer for `tensors` now instead of at the first save."""
        layout = self.layout_for(tensors)
        allocations = self.allocations
        self._ensure(layout.data_bytes, pin=self.needs_pin(tensors))
        if self.allocations != allocations and self._buffer is not None and not self._registered:
            self._buffer.zero_()  # first touch of every page, outside the training loop
        return layout

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _ensure(self, nbytes: int, *, pin: bool) -> None:
        if self._buffer is not None and nbytes <= self.capacity and (self._pinned or not pin):
            return
        self.release()
        started = time.monotonic()
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        registered = False
        if pin and nbytes:
            # Exactly sized page-locked memory; torch's pinned allocator would round 8.1 GiB up
            # to 16 GiB. Fall back to it if registration is refused.
            registered = host_register(buffer.data_ptr(), nbytes)
            if not registered:
                logger.warning("using pin_memory for the staging buffer instead")
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._buffer, self._registered, self._pinned = buffer, registered, pin
        self.allocations += 1
        logger.info(
            "allocated a %s staging buffer of %d bytes in %.3fs",
            "page-locked" if pin else "host",
            nbytes,
            time.monotonic() - started,
        )

    def release(self) -> None:
        """Free the buffer (it must not be in use)."""
        if self._buffer is not None and self._registered:
            host_unregister(self._buffer.data_ptr())
        self._buffer, self._registered, self._pinned = None, False, False
        self._views.clear()
        self._plans.clear()
        self._image = None
