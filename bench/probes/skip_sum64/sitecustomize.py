"""A goodput probe, never for a real run: tier 0's snapshots get zero checksums instead of the helper's sum64.

`bench/goodput_bench.py --variants ours_tier0_1_tier1_10_skip_sum64` puts this directory first on PYTHONPATH, so
every process of that run (the agent, the checkpoint helper, the worker) loads this file at start. Once
`ckpt.tier0` is imported, its `digest_parts` gives every sum64 chunk a zero digest without reading the slot.

Why: it bounds what a GPU-side checksum could win (issue J). The helper's sum64 of each snapshot reads the whole
slot every step (about 0.2 s of CPU per 0.17 s step for a 1.2 GB state). This probe removes that reading and
costs the GPU nothing, which no real checksum does. Its slots cannot be verified: the probe runs no restore
(goodput_bench.py keeps it out of the kill variants).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

TARGET = "ckpt.tier0"


def _patch(module: Any) -> None:
    real = module.digest_parts
    checksum = sys.modules["ckpt.checksum"]

    def digest_parts(parts: Any, *, algorithm: str, chunk_bytes: int, **kwargs: Any) -> Any:
        if algorithm != "sum64" or chunk_bytes <= 0:
            return real(parts, algorithm=algorithm, chunk_bytes=chunk_bytes, **kwargs)
        size = sum(len(p) for p in parts)
        return checksum.sum64_checksum([0] * checksum.chunk_count(size, chunk_bytes), chunk_bytes)

    module.digest_parts = digest_parts
    print(f"probe skip_sum64: tier 0's sum64 skipped in {' '.join(sys.argv[:2])}", file=sys.stderr)


class _Finder:
    """Patches TARGET right after it is executed (a meta path finder that steps aside once it found it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Finder())
