"""File checksums that keep up with the disk: fixed-size chunks hashed in parallel threads.

A checkpoint file's checksum is recorded in its manifest together with the algorithm:

- `sha256`, `chunk_bytes == 0` (format 1): one sha256 over the whole file. One core hashes
  about 1.3 GB/s here (SHA-NI), so a 8 GiB file costs ~6 s of checksum on its own.
- `sha256` or `crc32`, `chunk_bytes > 0` (format 2, the default): every `chunk_bytes` chunk of
  the file gets its own digest (in parallel: hashlib and zlib release the GIL), and the file's
  digest is the sha256 of the chunk digests in order. Both writing and verifying then scale with
  the threads available, and the writer computes it from memory while the same bytes go to disk.

Measured on the 2-core dev machine (1 core, 256 MiB): sha256 1.34 GB/s, crc32 (zlib 1.2.13)
1.29 GB/s, sha1 1.27, md5 0.51, blake2b 0.45. sha256 is therefore the default: it is as fast as
crc32 where SHA-NI exists and it is a real hash; `crc32` stays available for hosts without it.

`sum64` is tier 0's (ckpt/tier0.py): a chunk's digest is the sum of its little-endian 64-bit words
(zero-padded) modulo 2^64, computed by torch at memory speed (~6 GB/s on one core here, on torch's
intra-op threads, without the GIL). It is an integrity check, not a hash: it finds a torn, zeroed or
overwritten chunk, and chunk order counts, but not words swapped within a chunk. Tier 0 holds this
node's own memory, written a moment ago, every step: a real hash of it would cost a core per GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import zlib
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch

_np: Any
try:  # optional: ckpt works without numpy (tests/unit/test_ckpt_format.py), sum64 is just busier then
    import numpy as _np
except ImportError:
    _np = None

CHUNK_BYTES = 64 << 20
"""Default chunk size of format-2 checksums; recorded per file, so readers follow the writer."""

ALGORITHMS = ("sha256", "crc32")
"""Per-chunk digest algorithms a checkpoint tier may be configured with (CheckpointConfig.checksum)."""

READ_ALGORITHMS = (*ALGORITHMS, "sum64")
"""The algorithms this code writes and reads: `sum64` only in tier 0's host memory."""

DIGEST_BYTES = {"sha256": 32, "crc32": 4, "sum64": 8}
"""Size of one chunk digest."""

RANGE_CHUNK_BYTES = 64 << 10
"""Chunk size of the files of sharded states, whose manifests keep every chunk digest: a range read
(resharding) reads at most one chunk more on each side of what it needs (ckpt/ranges.py)."""

_CHUNKS_PER_TASK_BYTES = 16 << 20
"""Small chunks are hashed in groups of about this many bytes per pool task."""


@dataclass(frozen=True)
class Checksum:
    """How a file's digest is computed, and the digest (64 hex digits)."""

    algorithm: str
    chunk_bytes: int
    digest: str
    chunks: bytes = field(default=b"", compare=False, repr=False)
    """The chunk digests in order (their sha256 is `digest`); empty for a whole-file sha256."""

    @property
    def legacy(self) -> bool:
        """Whether this is a format-1 whole-file sha256."""
        return self.algorithm == "sha256" and self.chunk_bytes == 0

    def describe(self) -> str:
        if self.legacy:
            return "sha256"
        return f"{self.algorithm} checksum ({self.chunk_bytes >> 20} MiB chunks)"


def _chunk_digest(algorithm: str, pieces: Sequence[memoryview]) -> bytes:
    if algorithm == "sha256":
        h = hashlib.sha256()
        for piece in pieces:
            h.update(piece)
        return h.digest()
    if algorithm == "crc32":
        crc = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
        return crc.to_bytes(4, "big")
    if algorithm == "sum64":
        return _sum64(pieces).to_bytes(8, "big")
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(READ_ALGORITHMS)}")


def _sum64(pieces: Sequence[memoryview]) -> int:
    """The sum of the little-endian 64-bit words of the concatenated `pieces`, modulo 2^64."""
    if len(pieces) == 1 and len(pieces[0]) % 8 == 0 and _writable(pieces[0]):
        data = pieces[0]
    else:  # a chunk across two parts (the header and the data), a ragged tail, read-only bytes: small
        joined = bytearray(b"".join(pieces))
        joined.extend(bytes(-len(joined) % 8))
        data = memoryview(joined)
    if not len(data):
        return 0
    words = torch.frombuffer(data, dtype=torch.int64)
    return int(words.sum().item()) % (1 << 64)  # int64 addition wraps: the sum modulo 2^64


def _sum64_chunks(data: memoryview, chunk_bytes: int, pool: Executor | None = None) -> list[bytes]:
    """Every chunk's sum64 digest of one contiguous buffer (a tier-0 slot), the whole chunks in a few
    reductions: one per `pool` thread, each on one core (numpy; without it, torch on its own threads).
    Bounded threads, because this runs beside training every step: torch alone would take every core
    of the host for it and slow down the training process's kernel launches."""
    whole = len(data) // chunk_bytes
    digests: list[bytes] = []
    if whole:
        rows = _word_rows(data, whole, chunk_bytes)
        workers = getattr(pool, "_max_workers", 1) if pool is not None else 1
        per = max(1, -(-whole // max(1, workers)))
        blocks = [(i, min(i + per, whole)) for i in range(0, whole, per)]
        if pool is None or len(blocks) == 1:
            raw = b"".join(_row_sums(rows, a, b) for a, b in blocks)
        else:
            raw = b"".join(f.result() for f in [pool.submit(_row_sums, rows, a, b) for a, b in blocks])
        digests = [raw[i : i + 8] for i in range(0, len(raw), 8)]
    if len(data) > whole * chunk_bytes or not len(data):
        digests.append(_chunk_digest("sum64", [data[whole * chunk_bytes :]]))
    return digests


def _word_rows(data: memoryview, whole: int, chunk_bytes: int) -> Any:
    if _np is not None:
        return _np.frombuffer(data, dtype="<u8", count=whole * chunk_bytes // 8).reshape(whole, chunk_bytes // 8)
    return torch.frombuffer(data, dtype=torch.int64, count=whole * chunk_bytes // 8).view(whole, chunk_bytes // 8)


def _row_sums(rows: Any, begin: int, end: int) -> bytes:
    """The big-endian 8-byte sums of rows [begin, end) of `rows` (modulo 2^64)."""
    if _np is not None:
        return bytes(rows[begin:end].sum(axis=1, dtype="<u8").astype(">u8").tobytes())  # one core, no GIL
    sums = rows[begin:end].sum(dim=1)  # int64 addition wraps: the sum modulo 2^64
    big_endian = sums.view(torch.uint8).view(end - begin, 8)
    if sys.byteorder == "little":
        big_endian = big_endian.flip(1).contiguous()
    return ctypes.string_at(big_endian.data_ptr(), (end - begin) * 8)


def _writable(view: memoryview) -> bool:
    return not view.readonly


def _split(parts: Sequence[memoryview], chunk_bytes: int) -> list[list[memoryview]]:
    """The pieces of each `chunk_bytes` chunk of the concatenation of `parts`."""
    chunks: list[list[memoryview]] = [[]]
    room = chunk_bytes
    for part in parts:
        offset = 0
        while offset < len(part):
            take = min(room, len(part) - offset)
            chunks[-1].append(part[offset : offset + take])
            offset += take
            room -= take
            if room == 0:
                chunks.append([])
                room = chunk_bytes
    if not chunks[-1] and len(chunks) > 1:
        chunks.pop()
    return chunks


def digest_parts(
    parts: Sequence[memoryview],
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: Executor | None = None,
    chunk_timeout: float | None = None,
) -> Checksum:
    """The checksum of the concatenation of `parts`, hashed on `pool` when given."""
    if algorithm not in READ_ALGORITHMS:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {', '.join(READ_ALGORITHMS)}"
        )
    if chunk_bytes == 0:
        if algorithm != "sha256":
            raise ValueError("a whole-file checksum (chunk_bytes 0) must be sha256")
        return Checksum("sha256", 0, _chunk_digest("sha256", parts).hex())
    if chunk_bytes < 0:
        raise ValueError(f"chunk_bytes must be >= 0, got {chunk_bytes}")
    if algorithm == "sum64" and len(parts) == 1 and chunk_bytes % 8 == 0 and not parts[0].readonly:
        return _combine(algorithm, chunk_bytes, _sum64_chunks(parts[0], chunk_bytes, pool))
    groups = _groups(_split(parts, chunk_bytes), chunk_bytes)
    if pool is None or len(groups) == 1:
        digests = [d for g in groups for d in _group_digests(algorithm, g)]
    else:
        # `chunk_timeout` bounds the wait for each next group (raises TimeoutError): progress,
        # not the whole file, has a deadline, so a big file on a slow disk still verifies.
        futures = [pool.submit(_group_digests, algorithm, g) for g in groups]
        try:
            digests = [d for f in futures for d in f.result(chunk_timeout)]
        finally:
            for f in futures:
                f.cancel()
    return _combine(algorithm, chunk_bytes, digests)


def _groups(chunks: list[list[memoryview]], chunk_bytes: int) -> list[list[list[memoryview]]]:
    """Consecutive chunks grouped into pool tasks of about _CHUNKS_PER_TASK_BYTES."""
    per_task = max(1, _CHUNKS_PER_TASK_BYTES // chunk_bytes)
    return [chunks[i : i + per_task] for i in range(0, len(chunks), per_task)]


def _group_digests(algorithm: str, group: list[list[memoryview]]) -> list[bytes]:
    return [_chunk_digest(algorithm, pieces) for pieces in group]


def _combine(algorithm: str, chunk_bytes: int, digests: list[bytes]) -> Checksum:
    chunks = b"".join(digests)
    return Checksum(algorithm, chunk_bytes, hashlib.sha256(chunks).hexdigest(), chunks)


def chunk_digest(algorithm: str, data: memoryview) -> bytes:
    """The digest of one chunk (ckpt/ranges.py verifies range reads with it)."""
    return _chunk_digest(algorithm, [data])


class PendingDigest:
    """Chunk digests running on a pool; `result()` combines them, `cancel()` abandons them.

    Either must be called before the hashed memory is reused.
    """

    def __init__(
        self, parts: Sequence[memoryview], *, algorithm: str, chunk_bytes: int, pool: Executor
    ) -> None:
        if algorithm not in READ_ALGORITHMS:
            raise ValueError(
                f"unknown checksum algorithm {algorithm!r}; known: {', '.join(READ_ALGORITHMS)}"
            )
        self._algorithm = algorithm
        self._chunk_bytes = chunk_bytes
        self._whole: Future[Checksum] | None = None
        self._futures: list[Future[Any]]
        if chunk_bytes == 0:
            self._whole = pool.submit(digest_parts, parts, algorithm=algorithm, chunk_bytes=0)
            self._futures = [self._whole]
        else:
            groups = _groups(_split(parts, chunk_bytes), chunk_bytes)
            self._futures = [pool.submit(_group_digests, algorithm, g) for g in groups]

    def result(self) -> Checksum:
        if self._whole is not None:
            return self._whole.result()
        return _combine(self._algorithm, self._chunk_bytes, [d for f in self._futures for d in f.result()])

    def cancel(self) -> None:
        """Drop the chunks not started yet and wait for those running."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                f.exception()


def chunk_count(file_bytes: int, chunk_bytes: int) -> int:
    """How many chunk digests a file of `file_bytes` has: its whole chunks, a tail chunk, one when it is empty."""
    return max(1, -(-file_bytes // chunk_bytes))


def sum64_checksum(sums: Sequence[int], chunk_bytes: int) -> Checksum:
    """The sum64 checksum whose chunk sums are `sums` (computed elsewhere: on the GPU, ckpt/device_image.py)."""
    return _combine("sum64", chunk_bytes, [(s % (1 << 64)).to_bytes(8, "big") for s in sums])


def sum64_from_chunks(chunks: bytes, chunk_bytes: int) -> Checksum:
    """The sum64 checksum whose chunk digests, concatenated, are `chunks` (as a helper request carries them)."""
    if len(chunks) % 8:
        raise ValueError(f"sum64 chunk digests are 8 bytes each, got {len(chunks)} bytes")
    return _combine("sum64", chunk_bytes, [chunks[i : i + 8] for i in range(0, len(chunks), 8)])
