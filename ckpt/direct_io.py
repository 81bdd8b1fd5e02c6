"""Writing a tier-1 file around the page cache (O_DIRECT), where its bytes allow it (issue J).

A buffered write() copies every byte into the page cache on the CPU, and the kernel then has to find and later
drop that memory (`persist.drop_cached`). For the node's checkpoint helper, which writes a tier-0 slot (its
page-aligned mapping of the slot's file) to disk every `persist_every` steps, that copy is most of the persist's
CPU time: writing 1 GiB from /dev/shm to ext4 took 1.0-1.8 s of CPU and 1.4-2.3 s buffered, 0.04 s of CPU and
0.4-0.5 s direct (2-core VM, no checksum; with it, `bench/persist_bench.py`). While it runs beside training, it
takes memory bandwidth and cache from the training process.

O_DIRECT needs the buffer's address, the file offset and the length to be multiples of the device's logical
block size; `ALIGN` (4096) covers 512-byte and 4K devices. So a part that starts page-aligned at an aligned file
offset has its whole blocks written direct, and the rest of the file (a tail shorter than a block, parts that
are not aligned: the worker's own header and buffer) goes through the page cache as before. A file system that
refuses O_DIRECT (at open or at the first write, EINVAL) gets the buffered write for everything; nothing else
changes: the same bytes, the same fsync, the same checksum.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of a direct write's buffer address, file offset and length."""

O_DIRECT = getattr(os, "O_DIRECT", 0) if os.environ.get("ELASTIC_DIRECT_IO", "1") != "0" else 0
"""0 where the platform has none, or $ELASTIC_DIRECT_IO=0 in the node's environment: then every write is
buffered, as before."""

_refused: set[int] = set()
"""Devices (st_dev) whose file system refused O_DIRECT: not tried again, logged once."""


def address(part: memoryview) -> int | None:
    """The address of `part`'s first byte, or None when it cannot be had (a read-only or non-contiguous
    buffer: those are written buffered)."""
    if not part.c_contiguous or part.readonly or part.nbytes == 0:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(part.cast("B")))
    except (TypeError, ValueError):
        return None


def direct_bytes(part: memoryview, offset: int) -> int:
    """How many leading bytes of `part`, written at file `offset`, can go direct (whole blocks); 0 for none."""
    if not O_DIRECT or offset % ALIGN:
        return 0
    at = address(part)
    if at is None or at % ALIGN:
        return 0
    return part.nbytes - part.nbytes % ALIGN


def direct_plan(parts: Sequence[memoryview], where: Path) -> list[int]:
    """Per part, written one after the other from offset 0 into a new file in directory `where`, how many of
    its bytes can go direct (none where that file system refused O_DIRECT before)."""
    if not O_DIRECT or os.stat(where).st_dev in _refused:
        return [0] * len(parts)
    plan, offset = [], 0
    for part in parts:
        plan.append(direct_bytes(part, offset))
        offset += part.nbytes
    return plan


def write_parts(fd: int, path: Path, parts: Sequence[memoryview], write: Callable[[int, memoryview], None],
                plan: Sequence[int]) -> bool:
    """Write `parts` one after the other into the new, empty file `path` open as `fd`: per part, the first
    `plan` bytes (`direct_plan`) direct where the file system accepts it, the rest through `fd`. `write(fd,
    data)` writes all of `data` at `fd`'s position (persist.write_all, which tests replace; its chunks are
    whole blocks). Returns whether any byte went direct (then the page cache does not hold those bytes: their
    checksum comes from `parts`). No fsync here: the caller's fsync of `fd` covers the file's every byte, and
    it comes after the slot is given back."""
    direct = _open_direct(path) if any(plan) else None
    used = False
    offset = 0
    try:
        for part, bulk in zip(parts, plan, strict=True):
            if bulk and direct is not None:
                try:
                    os.lseek(direct, offset, os.SEEK_SET)
                    write(direct, part[:bulk])
                    used = True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # Refused before any byte went direct: the file system does not take O_DIRECT. After some
                    # did, EINVAL means this write stopped short of a block (the next one was not aligned).
                    if not used:
                        _refuse(path, exc)
                    os.close(direct)
                    direct, bulk = None, 0  # this part's blocks again, through the page cache
            else:
                bulk = 0
            if bulk < part.nbytes:
                os.lseek(fd, offset + bulk, os.SEEK_SET)
                write(fd, part[bulk:])
            offset += part.nbytes
    finally:
        if direct is not None:
            os.close(direct)
    return used


def _open_direct(path: Path) -> int | None:
    if os.stat(path.parent).st_dev in _refused:
        return None
    try:
        return os.open(path, os.O_WRONLY | O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _refuse(path, exc)
        return None


def _refuse(path: Path, exc: OSError) -> None:
    """Remember that the file system of `path`'s directory (the key `direct_plan` looks up) refused O_DIRECT."""
    try:
        device = os.stat(path.parent).st_dev
    except OSError:
        return
    if device not in _refused:
        _refused.add(device)
        logger.info("the file system of %s refuses O_DIRECT (%s): tier-1 files there are written through the page "
                    "cache", path.parent, exc.strerror)
