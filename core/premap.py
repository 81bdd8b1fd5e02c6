"""Tier-0 slot files mapped ahead of need, by a process that will become a worker.

A warm spare (elastic/spare_process.py) maps, and for CUDA state page-locks, the node's tier-0 slot files while
it waits; when it becomes the worker of a crashed rank, that worker's slots (ckpt/tier0.py) take those
mappings instead of mapping and page-locking their files again (page-locking both slots of a 1.2 GB
state took 0.46 s of a restarted worker's restore on one H200).

This module knows neither the slots' layout nor how to page-lock: ckpt/tier0.py supplies both when it
is imported (`configure`), so that the spare, which must not depend on ckpt, maps only where the script
it warms up for uses ckpt. A mapping whose file changed since (another inode or size) is dropped when it
is asked for; those of other ranks go when the worker's slots are made (`drop_except`).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Slots:
    pattern: str
    """Glob of a rank's slot data files under the tier-0 directory."""
    pin: Callable[[mmap.mmap, int], bool]
    unpin: Callable[[mmap.mmap], None]


_slots: _Slots | None = None
_maps: dict[str, tuple[int, int, mmap.mmap, bool]] = {}  # path -> (inode, size, mapping, page-locked)
_lock = threading.Lock()


def configure(pattern: str, pin: Callable[[mmap.mmap, int], bool], unpin: Callable[[mmap.mmap], None]) -> None:
    """Called by ckpt/tier0.py: where slot files are, and how to page-lock a mapping (False: refused)."""
    global _slots
    _slots = _Slots(pattern, pin, unpin)


def add(root: Path, *, pin: bool) -> int:
    """Map every slot file under the tier-0 directory `root`; page-lock them if `pin`. Returns the bytes
    mapped (0 when ckpt is not loaded in this process). Best effort: a file that goes away is skipped."""
    slots = _slots
    if slots is None:
        return 0
    mapped = 0
    for data in sorted(root.glob(slots.pattern)):
        try:
            fd = os.open(data, os.O_RDWR)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            with _lock:
                known = _maps.get(str(data))
            if not st.st_size or (known is not None and known[:2] == (st.st_ino, st.st_size)):
                continue
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
        pinned = pin and slots.pin(mapping, st.st_size)
        with _lock:
            old = _maps.pop(str(data), None)
            _maps[str(data)] = (st.st_ino, st.st_size, mapping, pinned)
        if old is not None:
            _unmap(old[2], old[3])
        mapped += st.st_size
    return mapped


def take(path: Path, inode: int, size: int) -> tuple[mmap.mmap, bool] | None:
    """The mapping of `path` made ahead, with whether it is page-locked, if the file is still that one."""
    with _lock:
        found = _maps.pop(str(path), None)
    if found is None:
        return None
    if found[:2] != (inode, size):
        _unmap(found[2], found[3])
        return None
    return found[2], found[3]


def drop_except(keep: Path) -> None:
    """Unmap the mappings not under `keep` (the worker's own rank's slots)."""
    with _lock:
        stale = [k for k in _maps if not Path(k).is_relative_to(keep)]
        dropped = [_maps.pop(k) for k in stale]
    for _, _, mapping, pinned in dropped:
        _unmap(mapping, pinned)


def held() -> list[str]:
    """The paths mapped ahead and not yet taken (for tests)."""
    with _lock:
        return sorted(_maps)


def _unmap(mapping: mmap.mmap, pinned: bool) -> None:
    if pinned and _slots is not None:
        _slots.unpin(mapping)
    try:
        mapping.close()
    except BufferError:
        pass
