"""Verified range reads (ckpt/ranges.py) of a real file: any range reads back exactly, through the
direct path (into the destination) and the buffered one, and a flipped byte anywhere a read touches
is refused with the file named."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ckpt.checksum import digest_parts
from ckpt.errors import CheckpointCorruptError
from ckpt.manifest import FileEntry
from ckpt.ranges import LocalRange, VerifiedFile

pytestmark = pytest.mark.timeout(60)
CHUNK = 4096


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes, FileEntry]:
    data = random.Random(size).randbytes(size)
    path = tmp_path / "state.safetensors"
    path.write_bytes(data)
    checksum = digest_parts([memoryview(data)], algorithm="sha256", chunk_bytes=CHUNK)
    return path, data, FileEntry.of(checksum, size, checksum.chunks)


def _ranges(size: int) -> list[tuple[int, int]]:
    rng = random.Random(7)
    picked = [(0, size), (0, 1), (size - 1, size), (CHUNK, 3 * CHUNK), (CHUNK - 1, CHUNK + 1), (5, 5)]
    for _ in range(40):
        a = rng.randrange(size)
        picked.append((a, min(size, a + rng.randrange(1, 5 * CHUNK))))
    return picked


@pytest.mark.parametrize("direct", [True, False])
def test_any_range_reads_back_exactly(tmp_path: Path, direct: bool) -> None:
    size = 10 * CHUNK + 123  # a partial last chunk
    path, data, entry = _file(tmp_path, size)
    reader = VerifiedFile(entry, LocalRange(path, timeout=30))
    for start, end in sorted(_ranges(size)):
        if direct:
            out = bytearray(end - start)
            reader.read_into(start, end, memoryview(out))
            assert bytes(out) == data[start:end], (start, end)
        else:
            assert bytes(reader.read(start, end)) == data[start:end], (start, end)
    reader.source.close()


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("flip", [0, CHUNK + 7, 5 * CHUNK, 10 * CHUNK + 100])
def test_a_flipped_byte_is_refused(tmp_path: Path, direct: bool, flip: int, wide: bool) -> None:
    size = 10 * CHUNK + 123
    path, data, entry = _file(tmp_path, size)
    damaged = bytearray(data)
    damaged[flip] ^= 0x01
    path.write_bytes(bytes(damaged))
    reader = VerifiedFile(entry, LocalRange(path, timeout=30))
    start, end = max(0, flip - 3), min(size, flip + 2)  # a range around it, partial chunks at both ends
    if wide:  # whole chunks in the middle, read straight into the destination
        start, end = 1, size
    with pytest.raises(CheckpointCorruptError, match=rf"{path}.*chunk {flip // CHUNK} .*does not match"):
        if direct:
            reader.read_into(start, end, memoryview(bytearray(end - start)))
        else:
            reader.read(start, end)
    reader.source.close()
