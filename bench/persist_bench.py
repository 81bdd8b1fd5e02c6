"""Tier-1 persist from a tier-0 slot, as the node's checkpoint helper makes it (issue J): the slot's whole
blocks written around the page cache (O_DIRECT, ckpt/direct_io.py) against the same persist through the page
cache ($ELASTIC_DIRECT_IO=0), and the disk's own limit, in interleaved rounds on the same bytes.

    python bench/persist_bench.py --gb 1 --rounds 5 --out /tmp/persist.json

The slot is a file in --slot-dir (default /dev/shm) mapped as the helper maps it; the persists go to --dir (a
local file system). Figures per mode, medians over rounds: wall_s (persist_rank: write, checksum, fsync,
manifest, rename; what the slot is held for is `held_s`, until `release`), cpu_s (this process's CPU time in
that span, the checksum threads included) and page_cache_mb (the file's pages left cached after the persist,
from mincore). The anchor `disk_limit` is one O_DIRECT write of the bytes and an fsync, no checksum.
Prints JSON with the ratios direct/buffered and each against the disk limit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import ckpt.direct_io as direct_io  # noqa: E402
from ckpt.helper_process import SlotImages, default_threads, persist_threads  # noqa: E402
from ckpt.layout import STATE_FILE, Layout  # noqa: E402
from ckpt.persist import persist_rank  # noqa: E402

MIB = 1 << 20


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cached_mb(path: Path) -> float:
    """MiB of `path`'s pages in the page cache (mincore over a mapping of it)."""
    size = path.stat().st_size
    if not size:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:  # private and writable (never written), so that ctypes can take its address
        region = mmap.mmap(f.fileno(), size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            first = ctypes.c_char.from_buffer(region)
            address = ctypes.addressof(first)
            del first  # the mapping can close only without it
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
                return -1.0
            return sum(v & 1 for v in vec) * mmap.PAGESIZE / MIB
        finally:
            region.close()


def slot_image(slot_dir: Path, nbytes: int) -> tuple[Path, memoryview]:
    path = Path(tempfile.mkdtemp(prefix="persist-bench-", dir=slot_dir)) / STATE_FILE
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        for _ in range(nbytes // MIB):
            f.write(block)
        f.write(block[: nbytes % MIB])
    return path, SlotImages().view(path, nbytes)  # mapped as the helper maps a slot


def persist(root: Path, step: int, image: memoryview, pool: ThreadPoolExecutor, direct: bool) -> dict[str, float]:
    direct_io.O_DIRECT = getattr(os, "O_DIRECT", 0) if direct else 0
    held: list[float] = []
    started, cpu = time.perf_counter(), cpu_s()
    written = persist_rank(Layout(root), step=step, rank=0, world_size=1, generation="bench", parts=[image],
                           tensors={}, skeleton={}, checksum="sha256", pool=pool,
                           release=lambda: held.append(time.perf_counter() - started))
    figures = {"wall_s": time.perf_counter() - started, "cpu_s": cpu_s() - cpu, "held_s": held[0] if held else 0.0,
               "page_cache_mb": cached_mb(written.path / STATE_FILE)}
    shutil.rmtree(root / f"step_{step:012d}", ignore_errors=True)
    shutil.rmtree(written.path.parent, ignore_errors=True)
    return figures


def disk_limit(root: Path, image: memoryview) -> dict[str, float]:
    path = root / "limit.bin"
    started, cpu = time.perf_counter(), cpu_s()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        bulk = len(image) - len(image) % direct_io.ALIGN
        view = image[:bulk]
        while len(view):
            view = view[os.write(fd, view[: 64 * MIB]):]
        os.fsync(fd)
    finally:
        os.close(fd)
    figures = {"wall_s": time.perf_counter() - started, "cpu_s": cpu_s() - cpu}
    path.unlink()
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="slot size in GiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where tier 1 goes (default: a temporary dir under /tmp)")
    p.add_argument("--slot-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    nbytes = int(args.gb * (1 << 30))
    root = Path(tempfile.mkdtemp(prefix="persist-bench-", dir=args.dir))
    slot, image = slot_image(args.slot_dir, nbytes)
    pool = ThreadPoolExecutor(max_workers=persist_threads(default_threads()))
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "buffered": [], "disk_limit": []}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (page faults of the slot, the pool's threads)
            order = ("direct", "buffered") if r % 2 else ("buffered", "direct")
            got = {mode: persist(root, 2 * r + i, image, pool, mode == "direct") for i, mode in enumerate(order)}
            got["disk_limit"] = disk_limit(root, image)
            if r:
                for mode, figures in got.items():
                    runs[mode].append(figures)
    finally:
        pool.shutdown()
        image.release()
        shutil.rmtree(slot.parent, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    medians = {mode: {k: round(statistics.median(f[k] for f in rs), 4) for k in rs[0]} for mode, rs in runs.items()}
    d, b, lim = medians["direct"], medians["buffered"], medians["disk_limit"]
    result = {
        "what": "tier-1 persist from a tier-0 slot (the helper's path): O_DIRECT blocks vs the page cache (issue J)",
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "settings": {"gb": args.gb, "rounds": args.rounds, "checksum": "sha256",
                     "checksum_threads": persist_threads(default_threads())},
        "medians": medians,
        "ratios": {"direct_over_buffered_wall": round(d["wall_s"] / b["wall_s"], 3),
                   "direct_over_buffered_cpu": round(d["cpu_s"] / b["cpu_s"], 3),
                   "direct_over_disk_limit_wall": round(d["wall_s"] / lim["wall_s"], 3),
                   "buffered_over_disk_limit_wall": round(b["wall_s"] / lim["wall_s"], 3)},
        "rounds": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
