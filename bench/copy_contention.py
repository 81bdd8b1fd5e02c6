"""How much a snapshot's copies slow the training stream's small kernels (issue J), in isolation, on one GPU.

A profiler trace of the GPT loop (bench/copy_overlap.py, session 42) showed two small memory-bound kernels taking
3-4x their time while tier 0's device-to-host copies ran (the fp32 `add_` of gradient accumulation 7.3 -> 32.8 us,
the bf16 cast of the weights 8.8 -> 26.6 us) and matmuls unaffected. Their own memory traffic is a fraction of
the device's bandwidth, and the copies' (52 GB/s) a smaller one, so this probe asks where the cost comes from: the
same kernels (48 fp32 tensors of 768 x 3072, the size of the GPT's MLP weights) timed with CUDA events, alone and
while another stream copies 1.2 GB (the loop's state) device -> pinned host, host -> device or device -> device,
in chunks of 1, 16 or 256 MiB. The host side is torch's pinned memory (cudaHostAlloc), or with `--host
registered` what tier 0 copies into: a /dev/shm file's mapping page-locked with cudaHostRegister
(ckpt/snapshot.py `host_register`, as ckpt/tier0.py pins its slots). Both sides are replayed from CUDA graphs,
so that neither is bound by the host's launches. Prints JSON: per background, per kernel, the median time a
kernel and its ratio to the kernel alone (measured between the backgrounds, so that drift shows), and the
copies' bandwidth.

    python bench/copy_contention.py --out /tmp/copy_contention.json      # on a CUDA host; ~20 s
    PYTHONPATH=$PWD python bench/copy_contention.py --host registered     # tier 0's kind of host memory
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
CHUNKS = (1 * MiB, 16 * MiB, 256 * MiB)
BACKGROUNDS = ("d2h", "h2d", "d2d")


def kernels(device: torch.device, count: int) -> dict[str, Callable[[], None]]:
    """The kernels to time, each a callable that launches `count` of them on the current stream."""
    params = [torch.randn(768, 3072, device=device) for _ in range(count)]
    grads = [torch.randn_like(p) for p in params]
    x = torch.randn(8 * 1024, 768, device=device, dtype=torch.bfloat16)
    w = torch.randn(768, 3072, device=device, dtype=torch.bfloat16)

    def add() -> None:  # gradient accumulation
        for p, g in zip(params, grads, strict=True):
            p.add_(g, alpha=1e-6)

    def cast() -> None:  # autocast's bf16 copy of a weight
        for p in params:
            p.to(torch.bfloat16)

    def matmul() -> None:
        for _ in range(count):
            torch.mm(x, w)

    return {"add_fp32": add, "cast_bf16": cast, "matmul_bf16": matmul}


def captured(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`fn`'s launches as one CUDA graph: replayed, they run back to back, so that a kernel's time is its own and
    not the host's launch rate (a 7 us kernel launches about as fast as it runs)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as goodput_worker.py's Floor
        fn()
    torch.cuda.synchronize()
    return graph


def replay_timed(graph: torch.cuda.CUDAGraph, times: int = 1) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """`graph` replayed `times` times on the current stream, between two timing events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    return start, end


def repeated(fn: Callable[[], None], times: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(times):
            fn()

    return run


def copy_pass(kind: str, chunk: int, buffers: dict[str, torch.Tensor]) -> Callable[[], None]:
    """One copy of the whole state in `chunk`-byte pieces, as the background `kind`."""
    src, dst = {"d2h": ("dev", "host"), "h2d": ("host", "dev"), "d2d": ("dev", "dev2")}[kind]
    a, b = buffers[src], buffers[dst]
    step = chunk // a.element_size()

    def run() -> None:
        for i in range(0, a.numel(), step):
            b[i:i + step].copy_(a[i:i + step], non_blocking=True)

    return run


@contextmanager
def host_buffer(kind: str, numel: int) -> Iterator[torch.Tensor]:
    """`numel` fp32 of page-locked host memory: torch's pinned memory, or a registered /dev/shm mapping."""
    if kind == "pinned":
        yield torch.empty(numel, pin_memory=True)
        return
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from ckpt.snapshot import host_register, host_unregister

    nbytes = numel * 4
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=where, prefix="copy_contention_") as f:
        os.ftruncate(f.fileno(), nbytes)
        mapping = mmap.mmap(f.fileno(), nbytes)
        host = torch.frombuffer(mapping, dtype=torch.float32)
        if not host_register(host.data_ptr(), nbytes):
            raise SystemExit(f"cudaHostRegister of {nbytes} bytes of {f.name} failed: see the log above")
        address = host.data_ptr()
        try:
            yield host
        finally:
            torch.cuda.synchronize()
            host_unregister(address)
            del host
            try:
                mapping.close()
            except BufferError:  # a tensor still views it: the GC unmaps it with the tensor
                pass


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-gb", type=float, default=1.2, help="bytes copied a pass, in GB (the GPT's state)")
    p.add_argument("--count", type=int, default=48, help="kernels a launch")
    p.add_argument("--iterations", type=int, default=40, help="launches in one timed graph")
    p.add_argument("--repeats", type=int, default=5, help="measurements per kernel and background (median)")
    p.add_argument("--host", choices=("pinned", "registered"), default="pinned",
                   help="the host memory: torch's pinned memory, or a /dev/shm mapping registered as tier 0's slots")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        result: dict[str, Any] = {"skipped": "needs a CUDA device: the probe times a GPU's streams"}
        print(json.dumps(result))
        return result
    n = int(args.state_gb * 1e9) // 4
    with host_buffer(args.host, n) as host:
        result = measure(args, n, host)
        del host  # before the mapping under it closes
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return result


def measure(args: argparse.Namespace, n: int, host: torch.Tensor) -> dict[str, Any]:
    device = torch.device("cuda")
    buffers = {"dev": torch.randn(n, device=device), "dev2": torch.empty(n, device=device), "host": host}
    per = args.iterations * args.count
    launchers = kernels(device, args.count)  # kept: a graph reads their tensors, but does not hold them
    graphs = {}
    for name, launch in launchers.items():
        launch()  # warm-up before capture: allocator, cuBLAS handles
        torch.cuda.synchronize()
        graphs[name] = captured(repeated(launch, args.iterations))
    side = torch.cuda.Stream()

    def kernel_us(name: str) -> float:
        start, end = replay_timed(graphs[name])
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / per

    result: dict[str, Any] = {
        "what": "per-kernel time on one stream beside copies on another (bench/copy_contention.py)",
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "alone_us": {}, "beside": {}}
    for kind in BACKGROUNDS:
        for chunk in CHUNKS:
            key = f"{kind}_{chunk // MiB}MiB"
            try:
                copies = captured(copy_pass(kind, chunk, buffers))
            except RuntimeError as exc:  # a copy this torch cannot capture: said, and the others measured
                result["beside"][key] = {"error": f"capturing the copies failed: {exc}"}
                continue
            with torch.cuda.stream(side):
                start, end = replay_timed(copies)
            end.synchronize()
            pass_ms = start.elapsed_time(end)
            entry: dict[str, Any] = {"copy_gb_s": round(n * 4 / (pass_ms / 1e3) / 1e9, 1),
                                     "copy_pass_ms": round(pass_ms, 2)}
            for name in graphs:
                base = statistics.median(kernel_us(name) for _ in range(args.repeats))
                result["alone_us"].setdefault(name, []).append(round(base, 2))
                # The copies outlast the kernels three times over, and start first.
                passes = max(2, math.ceil(3 * base * per / 1e3 / pass_ms))
                times = []
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    with torch.cuda.stream(side):
                        replay_timed(copies, passes)
                    times.append(kernel_us(name))
                    side.synchronize()
                beside = statistics.median(times)
                entry[name] = {"us": round(beside, 2), "ratio": round(beside / base, 3), "copy_passes": passes}
            result["beside"][key] = entry
            print(key, json.dumps(entry), file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    main()
