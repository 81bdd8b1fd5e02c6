"""Verified range reads of a data file: read only some bytes, and still check every byte read.

The manifest of a sharded state keeps the digest of every `chunk_bytes` chunk of each data file
(ckpt/manifest.py, format 3; authenticated by the manifest's sha256 in the step's COMMIT). A
range read widens the range to whole chunks, reads them with one request, and compares each
chunk's digest before any byte is used: a read costs at most one chunk more on each side than
asked for (ckpt/checksum.py RANGE_CHUNK_BYTES, 256 KiB).

Where the bytes come from is a `fetch(start, end)` callable of the tier (a local pread, an fsspec
range request); which tier is asked first is ckpt/reshard.py's business.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from ckpt.checksum import DIGEST_BYTES, chunk_digest
from ckpt.format import corrupt
from ckpt.manifest import FileEntry
from ckpt.safe_io import open_regular, with_deadline

Fetch = Callable[[int, int], bytes]
"""Bytes [start, end) of one file (fewer only at the end of the file)."""


def read_local_range(path: Path, start: int, end: int, *, timeout: float) -> bytes:
    """Bytes [start, end) of the regular file `path` (a FIFO or device is refused unopened), within
    `timeout` seconds (CheckpointTimeoutError otherwise)."""

    def read() -> bytes:
        fd = open_regular(path)
        try:
            chunks = []
            offset = start
            while offset < end:
                data = os.pread(fd, min(end - offset, 64 << 20), offset)
                if not data:
                    break
                chunks.append(data)
                offset += len(data)
            return b"".join(chunks)
        finally:
            os.close(fd)

    return with_deadline(read, timeout=timeout, what="range read", path=path)


class VerifiedFile:
    """Range reads of one data file, each checked against the manifest's chunk digests."""

    def __init__(self, entry: FileEntry, fetch: Fetch, *, path: Path, pool: Executor | None = None) -> None:
        if not entry.chunk_digests or entry.chunk_bytes <= 0:
            raise corrupt(path, "the file has no chunk digests, so it cannot be read by range (format < 3)")
        self.entry = entry
        self.path = path
        self._fetch = fetch
        self._pool = pool
        self.bytes_read = 0

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The chunk-aligned range a read of [start, end) fetches."""
        c = self.entry.chunk_bytes
        return start - start % c, min(self.entry.bytes, -(-end // c) * c)

    def read(self, start: int, end: int) -> memoryview:
        """Verified bytes [start, end) of the file. Raises CheckpointCorruptError naming the file."""
        if not 0 <= start <= end <= self.entry.bytes:
            raise corrupt(self.path, f"range [{start}, {end}) lies outside the file's {self.entry.bytes} bytes")
        if start == end:
            return memoryview(b"")
        lo, hi = self.span(start, end)
        data = self._fetch(lo, hi)
        self.bytes_read += len(data)
        if len(data) != hi - lo:
            raise corrupt(self.path, f"a read of bytes [{lo}, {hi}) returned {len(data)} bytes (truncated?)")
        view = memoryview(data)
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
            want = self.entry.chunk_digests[index * size : (index + 1) * size]
            if digest != want:
                raise corrupt(
                    self.path,
                    f"chunk {index} (bytes {lo + offset}..{min(lo + offset + c, hi)}) does not match its "
                    f"{self.entry.algorithm} digest in the manifest (bit rot or a partial write)",
                )
        return view[start - lo : end - lo]
