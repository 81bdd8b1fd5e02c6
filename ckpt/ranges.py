"""Verified range reads of a data file: read only some bytes, and still check every byte read.

The manifest of a sharded state keeps the digest of every `chunk_bytes` chunk of each data file
(ckpt/manifest.py, format 3; authenticated by the manifest's sha256 in the step's COMMIT). A
range read widens the range to whole chunks, reads them with one request, and compares each
chunk's digest before any byte is used (ckpt/checksum.py RANGE_CHUNK_BYTES).

Where the bytes come from is a `RangeSource` of the tier: `LocalRange` (a file opened once, read
with pread into two reusable buffers) or `RemoteRange` (fsspec range requests through the tier's
bounded retries). `window` is the most bytes one read asks for: small for a local file (the two read
buffers are the only extra host memory), larger for object stores, where each request costs a
round trip. `VerifiedFile.read_ahead` reads and verifies on a long-lived reader thread, so the next
read overlaps the caller's copy of the previous one; waiting for it has the source's deadline.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from ckpt.checksum import DIGEST_BYTES, chunk_digest
from ckpt.errors import CheckpointTimeoutError
from ckpt.format import corrupt
from ckpt.manifest import FileEntry
from ckpt.safe_io import open_regular

T = TypeVar("T")

LOCAL_WINDOW = 1 << 20
"""Bytes per read of a local file."""

REMOTE_WINDOW = 16 << 20
"""Bytes per range request to an object store."""

_reader: ThreadPoolExecutor | None = None
_reader_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    """Long-lived reader threads: a read gets a deadline without a thread started per read. A read
    hung in the kernel keeps its thread; the others go on."""
    global _reader
    with _reader_lock:
        if _reader is None:
            _reader = ThreadPoolExecutor(4, thread_name_prefix="ckpt-range-read")
        return _reader


class RangeSource(Protocol):
    """Bytes of one file by range."""

    window: int
    where: Path
    timeout: float
    """Seconds a read may take before it counts as hung."""

    def read(self, start: int, end: int, head: bytes = b"") -> memoryview:
        """`head` followed by bytes [start, end) (fewer only at the end of the file); valid until the
        read after next."""
        ...

    def close(self) -> None: ...


class LocalRange:
    """A regular file on a local (or mounted) path, opened once (a FIFO or device is refused unopened)."""

    def __init__(self, path: Path, *, timeout: float, window: int = LOCAL_WINDOW) -> None:
        self.where = path
        self.window = window
        self.timeout = timeout
        self._fd: int | None = None
        self._buffers = [bytearray(), bytearray()]  # one being read, one being copied out of
        self._turn = 0

    def read(self, start: int, end: int, head: bytes = b"") -> memoryview:
        if self._fd is None:
            try:
                self._fd = open_regular(self.where)
            except OSError as exc:
                raise corrupt(self.where, f"file cannot be read ({exc})") from exc
        self._turn ^= 1
        size = len(head) + end - start
        if len(self._buffers[self._turn]) < size:
            self._buffers[self._turn] = bytearray(size)
        view = memoryview(self._buffers[self._turn])[:size]
        view[: len(head)] = head
        try:
            return view[: len(head) + _pread_all(self._fd, view[len(head) :], start)]
        except OSError as exc:
            raise corrupt(self.where, f"file cannot be read ({exc})") from exc

    def read_into(self, start: int, view: memoryview) -> int:
        """Read bytes from `start` into `view` (e.g. the destination tensor's memory); how many."""
        if self._fd is None:
            try:
                self._fd = open_regular(self.where)
            except OSError as exc:
                raise corrupt(self.where, f"file cannot be read ({exc})") from exc
        try:
            return _pread_all(self._fd, view, start)
        except OSError as exc:
            raise corrupt(self.where, f"file cannot be read ({exc})") from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class RemoteRange:
    """An object read by range requests (`fetch(start, end) -> bytes`, with the tier's retries)."""

    def __init__(
        self, fetch: Callable[[int, int], bytes], *, where: Path, timeout: float, window: int = REMOTE_WINDOW
    ) -> None:
        self.where = where
        self.window = window
        self.timeout = timeout
        self._fetch = fetch

    def read(self, start: int, end: int, head: bytes = b"") -> memoryview:
        data = self._fetch(start, end)
        return memoryview(head + data if head else data)

    def close(self) -> None:
        pass


class VerifiedFile:
    """Range reads of one data file, each checked against the manifest's chunk digests."""

    def __init__(self, entry: FileEntry, source: RangeSource, *, pool: Executor | None = None) -> None:
        self.path = source.where
        if not entry.chunk_digests or entry.chunk_bytes <= 0:
            raise corrupt(self.path, "the file has no chunk digests, so it cannot be read by range (format < 3)")
        self.entry = entry
        self.source = source
        self._pool = pool
        self.bytes_read = 0
        self._tail: tuple[int, bytes] | None = None
        """The last chunk of the previous read (index, verified bytes; b"" when it is in `_scratch`):
        a read that starts in it does not fetch or verify it again (consecutive reads of one file
        meet inside a chunk)."""
        self._scratch = (memoryview(bytearray(min(entry.chunk_bytes, entry.bytes))) if isinstance(source, LocalRange)
                         else memoryview(b""))  # one chunk, or the whole file where that is smaller

    @property
    def window(self) -> int:
        return max(self.source.window, self.entry.chunk_bytes)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The chunk-aligned range a read of [start, end) fetches."""
        c = self.entry.chunk_bytes
        return start - start % c, min(self.entry.bytes, -(-end // c) * c)

    @property
    def direct(self) -> bool:
        """Whether `read_into` works here (a local file: bytes go straight into the destination)."""
        return isinstance(self.source, LocalRange)

    def read_into(self, start: int, end: int, dest: memoryview) -> None:
        """Verified bytes [start, end) of the file into `dest` (len end - start), without a read
        buffer: the whole chunks inside the range are read into `dest` itself and verified there
        (on the hash pool); the partial chunks at its ends go through one chunk of scratch, which
        is kept, so the next range starting in that chunk does not read it again. `dest` holds
        garbage when this raises (CheckpointCorruptError naming the file)."""
        assert isinstance(self.source, LocalRange)
        if not 0 <= start <= end <= self.entry.bytes or len(dest) != end - start:
            raise corrupt(self.path, f"range [{start}, {end}) lies outside the file's {self.entry.bytes} bytes")
        c = self.entry.chunk_bytes
        first_full = -(-start // c) * c
        last_full = self.entry.bytes if end == self.entry.bytes else end - end % c
        if first_full >= last_full:  # inside one or two partial chunks
            for k in range(start // c, (end - 1) // c + 1):
                self._from_chunk(k, start, end, dest)
            return
        if start < first_full:
            self._from_chunk(start // c, start, end, dest)
        step = max(c, (16 << 20) - (16 << 20) % c)
        for lo in range(first_full, last_full, step):
            hi = min(lo + step, last_full)
            piece = dest[lo - start : hi - start]
            self._read_exactly(lo, piece)
            self._verify(piece, lo)
        if last_full < end:
            self._from_chunk(last_full // c, start, end, dest)

    def _read_exactly(self, lo: int, view: memoryview) -> None:
        """Fill `view` with the file's bytes from `lo` on a reader thread, within the deadline."""
        assert isinstance(self.source, LocalRange)
        got = self.wait(_read_pool().submit(self.source.read_into, lo, view))
        self.bytes_read += got
        if got != len(view):
            raise corrupt(self.path, f"a read of bytes [{lo}, {lo + len(view)}) returned {got} bytes (truncated?)")

    def _from_chunk(self, index: int, start: int, end: int, dest: memoryview) -> None:
        """Copy the part of chunk `index` inside [start, end) into `dest` (which holds [start, end))."""
        c = self.entry.chunk_bytes
        lo, hi = index * c, min((index + 1) * c, self.entry.bytes)
        if self._tail is None or self._tail[0] != index or self._tail[1]:
            assert isinstance(self.source, LocalRange)
            scratch = self._scratch[: hi - lo]
            self._read_exactly(lo, scratch)
            self._tail = None
            self._verify(scratch, lo)
            self._tail = (index, b"")  # the scratch holds chunk `index`
        a, b = max(lo, start), min(hi, end)
        dest[a - start : b - start] = self._scratch[a - lo : b - lo]

    def _verify(self, view: memoryview, lo: int) -> None:
        """Check the whole chunks `view` holds, the first at file offset `lo` (chunk-aligned)."""
        c = self.entry.chunk_bytes
        size = DIGEST_BYTES[self.entry.algorithm]
        offsets = range(0, len(view), c)
        algorithm = self.entry.algorithm
        if self._pool is not None and len(offsets) > 8:  # hashlib and zlib release the GIL
            found = list(self._pool.map(lambda o: chunk_digest(algorithm, view[o : o + c]), offsets))
        else:
            found = [chunk_digest(algorithm, view[o : o + c]) for o in offsets]
        for offset, digest in zip(offsets, found, strict=True):
            index = (lo + offset) // c
            if digest != self.entry.chunk_digests[index * size : (index + 1) * size]:
                raise corrupt(
                    self.path,
                    f"chunk {index} (bytes {lo + offset}..{min(lo + offset + c, lo + len(view))}) does not match "
                    f"its {algorithm} digest in the manifest (bit rot or a partial write)",
                )

    def read_ahead(self, start: int, end: int) -> Future[memoryview]:
        """`read(start, end)` on a reader thread; collect it with `wait`."""
        return _read_pool().submit(self.read, start, end)

    def wait(self, pending: Future[T]) -> T:
        """The bytes of a `read_ahead`; CheckpointTimeoutError when the read outlives the deadline."""
        try:
            return pending.result(self.source.timeout)
        except FutureTimeout as exc:
            raise CheckpointTimeoutError(
                f"a read of {self.path} did not finish within {self.source.timeout:.0f}s (a hung disk or "
                f"mount?); this copy is skipped",
                path=self.path,
            ) from exc

    def read(self, start: int, end: int) -> memoryview:
        """Verified bytes [start, end) of the file (valid until the read after next). Raises
        CheckpointCorruptError naming the file."""
        if not 0 <= start <= end <= self.entry.bytes:
            raise corrupt(self.path, f"range [{start}, {end}) lies outside the file's {self.entry.bytes} bytes")
        if start == end:
            return memoryview(b"")
        lo, hi = self.span(start, end)
        c = self.entry.chunk_bytes
        head = b""
        if self._tail is not None and self._tail[0] == lo // c and hi - lo > c:
            head = self._tail[1]
        view = self.source.read(lo + len(head), hi, head)
        self.bytes_read += len(view) - len(head)
        if len(view) != hi - lo:
            raise corrupt(self.path, f"a read of bytes [{lo}, {hi}) returned {len(view)} bytes (truncated?)")
        self._verify(view[len(head) :], lo + len(head))
        last = (hi - 1) // c
        self._tail = (last, bytes(view[last * c - lo : hi - lo]))
        return view[start - lo : end - lo]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
