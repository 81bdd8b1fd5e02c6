"""Sharded-state checkpoint benchmark (issue I): ours against torch.distributed.checkpoint (DCP),
side by side in one run, on FSDP-style Shard(0) DTensors spread over N real processes.

    python bench/sharded_bench.py --state-gb 1 --ranks 4 --json /tmp/sharded.json     # CPU, gloo
    python bench/sharded_bench.py --device cuda --ranks 8 --state-gb 64                # NCCL, 1 GPU/rank
    python bench/sharded_bench.py --state-gb 0.05 --saves 1 --restores 1               # a smoke run

The state is a GPT-like model's parameters plus AdamW's two moments, all fp32, as
`get_state_dict(model, optimizer)` gives them for a `fully_shard` model: {"model": {fqn: DTensor},
"optim": {"state": {fqn: {"exp_avg", "exp_avg_sq": DTensor, "step": 0-d tensor}},
"param_groups": [...]}, "step": int}; `--state-gb` is the global size. A few large 2-D tensors
(embedding, qkv, mlp, a head with an odd row count) and many small 1-D ones (norms, biases);
row counts are uneven over N and N-1 ranks. Every element's value is a function of its tensor
and global index, so a restore into any layout is checked element by element ("verified").

Phases (N worker processes started once; seconds per rank, and the max over ranks):
  A, N ranks, one process group. Rounds (--saves timed ones after a warm-up round 0, reported as
  *_first_s) of, one after the other, so that each ratio compares runs made under the same load:
    copy_limit_s          copy of this rank's own shards into preallocated host buffers (pinned
                          on cuda): the physical floor of a save stall
    ours_stall_s          Checkpointer.save_async returning (default config); round 0 allocates
                          the staging buffer, as the first save of a training loop does
    ours_persist_s        save_async until wait_persisted returned (ours_tier1_s: SaveMetrics)
    dcp_save_s            dcp.save, total
    dcp_async_blocked_s   dcp.async_save until it returns; dcp_async_total_s until its future is done
  Then restores into the same layout, --restores of each kind in ABBA order, each into a zeroed
  template: ours restore(into=template), then the copy of its DTensors into the template
  (copy_in_s; dcp.load fills the template in place, so the ratios compare ours + copy-in), vs
  dcp.load(template) of the newest dcp.save.
  B, N-1 ranks (rank N-1 leaves; a fresh process group): both restore the N-rank checkpoints
    into an N-1 layout (resharding), the same way: time, bytes read, peak extra host memory.
Measurement details:
  - Every timed section starts after a barrier, so all ranks run it under the same load.
  - Page cache: before every restore the checkpoint files are dropped from it (root: sync and
    /proc/sys/vm/drop_caches; otherwise, or with --drop-cache fadvise, posix_fadvise DONTNEED per
    file); "page_cache" in the JSON says which, and io_read_bytes (reads that reached the disk)
    shows whether it worked. The ranks of one node share the page cache: a page one rank read
    from disk is a cache hit for the next, so per rank io_read_bytes can be below what it read;
    "sum" over ranks is what the node read from disk.
  - Bytes read: ours' Restored.bytes_read (data bytes, manifests excluded), and for both the
    /proc/self/io deltas: read_bytes (fetched from storage, incl. readahead; page-cache hits are 0)
    and rchar (bytes through read()/pread() syscalls, incl. manifests, .metadata and gloo's socket
    reads; mmap'd file pages are not in rchar).
  - Peak extra host memory: /proc/self/clear_refs "5" resets VmHWM to the current RSS before the
    restore; VmHWM - RSS before is the peak (anonymous + mapped file pages); RssAnon and RssFile
    are also sampled every 5 ms for the split. Workers run with MALLOC_MMAP_THRESHOLD_=65536 so
    freed memory goes back to the OS and an earlier phase's heap cannot hide a restore's peak.
    The template (the freshly initialised state a restore loads into) is allocated before.
    On cuda the restored shard lives on the GPU: the host target is then one chunk alone, and
    device_peak_extra_bytes (torch.cuda.max_memory_allocated over the restore) is reported too.
Ratios against the issue's targets are in "ratios" and "targets_met".
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import multiprocessing.forkserver
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckpt import CheckpointConfig, Checkpointer  # noqa: E402

try:  # the chunk of the files of sharded states (per-chunk checksums, range reads)
    from ckpt.checksum import RANGE_CHUNK_BYTES as CHUNK_BYTES
except ImportError:
    from ckpt.checksum import CHUNK_BYTES

TARGETS = {
    "ours_stall_over_copy_limit": ("<=", 1.2),
    "dcp_async_blocked_over_ours_stall": (">=", 10.0),
    "reshard_bytes_read_over_new_shard": ("<=", 1.1),
    "reshard_peak_extra_over_shard_plus_chunk": ("<=", 1.0),
    "reshard_ours_over_dcp_load": ("<=", 1.0),
}
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ckpt")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
BYTES = 4  # every tensor is fp32


# -- the state ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """One sharded tensor of the state: its key path, value seed and global shape."""

    path: tuple[str, ...]
    tid: int
    shape: tuple[int, ...]


def plan_params(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT's parameters (FQN, shape) whose params + two AdamW moments fill `total_bytes`.

    Width d is the power of two that gives about 8 blocks; the embedding takes ~10%, blocks
    (12 d^2 + 13 d each) as many as fit, and an lm_head with the rows left over.
    """
    params = max(total_bytes // (3 * BYTES), 4096)
    d = max(64, 2 ** round(math.log2(math.sqrt(params / 96))))
    vocab = max(3, params // (10 * d)) | 1
    if vocab % 3 == 0:
        vocab += 2  # uneven over 3 and 4 ranks alike
    out: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (vocab, d))]
    block = [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.proj.weight", (d, d)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.fc1.weight", (4 * d, d)),
        ("mlp.fc1.bias", (4 * d,)),
        ("mlp.fc2.weight", (d, 4 * d)),
    ]
    per_block = sum(math.prod(s) for _, s in block)
    left = params - vocab * d - d
    i = 0
    while left >= per_block + d:
        out += [(f"blocks.{i}.{name}", shape) for name, shape in block]
        left -= per_block
        i += 1
    out.append(("norm_f.weight", (d,)))
    out.append(("lm_head.weight", (max(1, left // d), d)))
    return out


def leaves_of(params: list[tuple[str, tuple[int, ...]]]) -> list[Leaf]:
    out = []
    for i, (fqn, shape) in enumerate(params):
        out.append(Leaf(("model", fqn), 3 * i, shape))
        out.append(Leaf(("optim", "state", fqn, "exp_avg"), 3 * i + 1, shape))
        out.append(Leaf(("optim", "state", fqn, "exp_avg_sq"), 3 * i + 2, shape))
    return out


def local_rows(shape: tuple[int, ...], mesh: Any) -> tuple[int, int]:
    """(first global row, rows) of this rank's Shard(0) piece."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
    return offset[0], local[0]


def values(leaf: Leaf, row0: int, rows: int, device: torch.device) -> torch.Tensor:
    """Rows [row0, row0 + rows) of `leaf`'s global tensor: tid + row/1e3 + column/1e6.
    Elementwise fp32 arithmetic, so the same rows come out bit-equal in any layout."""
    base = torch.arange(row0, row0 + rows, dtype=torch.float32, device=device).mul_(1e-3).add_(leaf.tid)
    if len(leaf.shape) == 1:
        return base
    cols = torch.arange(leaf.shape[1], dtype=torch.float32, device=device).mul_(1e-6)
    return base[:, None] + cols[None, :]


def build_state(params: list[tuple[str, tuple[int, ...]]], mesh: Any, device: torch.device, *, fill: bool) -> dict:
    """The state tree of this rank; `fill=False`: zeros of the same layout (a restore template)."""
    from torch.distributed.tensor import DTensor, Shard

    def dtensor(leaf: Leaf) -> Any:
        row0, rows = local_rows(leaf.shape, mesh)
        if fill:
            local = values(leaf, row0, rows, device)
        else:
            local = torch.zeros((rows, *leaf.shape[1:]), dtype=torch.float32, device=device)
        stride = tuple(math.prod(leaf.shape[i + 1 :]) for i in range(len(leaf.shape)))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(leaf.shape), stride=stride)

    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for leaf in leaves_of(params):
        if leaf.path[0] == "model":
            model[leaf.path[1]] = dtensor(leaf)
        else:
            fqn, kind = leaf.path[2], leaf.path[3]
            entry = optim.setdefault(fqn, {"step": torch.tensor(7.0 if fill else 0.0)})
            entry[kind] = dtensor(leaf)
    groups = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": list(model)}]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}, "step": 7 if fill else 0}


def at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def local_tensors(state: dict) -> list[torch.Tensor]:
    """This rank's bytes of the state: the local shards plus the plain (per-rank) tensors."""
    from torch.distributed.tensor import DTensor

    out = list(state["model"].values())
    for entry in state["optim"]["state"].values():
        out += [entry["exp_avg"], entry["exp_avg_sq"], entry["step"]]
    return [t.to_local() if isinstance(t, DTensor) else t for t in out]


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def verify(tree: Any, params: list[tuple[str, tuple[int, ...]]], mesh: Any, device: torch.device) -> str:
    """Return "ok", or what differs first: every DTensor leaf of `tree` must hold its expected values in
    `mesh`'s Shard(0) layout."""
    from torch.distributed.tensor import DTensor

    for leaf in leaves_of(params):
        try:
            got = at(tree, leaf.path)
        except (KeyError, IndexError, TypeError):
            return f"{'/'.join(leaf.path)}: missing"
        if not isinstance(got, DTensor):
            return f"{'/'.join(leaf.path)}: a {type(got).__name__}, not a DTensor"
        if tuple(got.shape) != leaf.shape:
            return f"{'/'.join(leaf.path)}: global shape {tuple(got.shape)}, expected {leaf.shape}"
        row0, rows = local_rows(leaf.shape, mesh)
        if not torch.equal(got.to_local().to(device), values(leaf, row0, rows, device)):
            return f"{'/'.join(leaf.path)}: values differ in rows {row0}..{row0 + rows}"
    return "ok"


# -- process measurements ---------------------------------------------------------------------


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f if ": " in line)}


def status_bytes(*fields: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in fields:
                out[key] = int(rest.split()[0]) * 1024
    return out


class MemoryProbe:
    """Peak extra host memory of one section (see the module docstring)."""

    def __init__(self, device: torch.device, period: float = 0.005) -> None:
        self.device = device
        self.period = period
        self.result: dict[str, Any] = {}

    @contextmanager
    def measure(self) -> Iterator[dict[str, Any]]:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            hwm_reset = True
        except OSError:
            hwm_reset = False
        base = status_bytes("VmRSS", "RssAnon", "RssFile")
        peak = dict(base)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(self.period):
                now = status_bytes("RssAnon", "RssFile")
                for k, v in now.items():
                    peak[k] = max(peak[k], v)

        sampler = threading.Thread(target=sample, daemon=True, name="bench-rss-sampler")
        sampler.start()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
        io0 = io_counters()
        try:
            yield self.result
        finally:
            io1 = io_counters()
            if self.device.type == "cuda":
                self.result["device_peak_extra_bytes"] = torch.cuda.max_memory_allocated(self.device) - allocated
            stop.set()
            sampler.join()
            hwm = status_bytes("VmHWM")["VmHWM"]
            self.result.update(
                io_read_bytes=io1["read_bytes"] - io0["read_bytes"],
                io_rchar=io1["rchar"] - io0["rchar"],
                peak_extra_bytes=hwm - base["VmRSS"] if hwm_reset else None,
                sampled_extra_anon_bytes=peak["RssAnon"] - base["RssAnon"],
                sampled_extra_file_bytes=peak["RssFile"] - base["RssFile"],
            )


class CopyLimit:
    """The physical floor of a save stall: a copy of this rank's tensors into preallocated host
    buffers (pinned for device tensors, copied with non_blocking, then synchronised)."""

    def __init__(self, sources: list[torch.Tensor], *, pinned: bool) -> None:
        self.sources = sources
        self.pinned = pinned
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in sources]
        self.nbytes = nbytes(sources)

    def copy(self) -> None:
        for dst, src in zip(self.buffers, self.sources, strict=True):
            dst.copy_(src, non_blocking=self.pinned)

    def close(self) -> None:
        self.buffers, self.sources = [], []


def drop_page_cache(root: Path, how: str) -> str:
    """Drop `root`'s files from the page cache; return how it was done.

    "auto": sync + /proc/sys/vm/drop_caches where writable (root), else "fadvise": fdatasync +
    posix_fadvise(DONTNEED) on each file (drops only those files' clean pages; no root needed).
    """
    if how == "auto":
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            return "drop_caches"
        except OSError:
            pass
    for file in (p for p in root.rglob("*") if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise_dontneed"


# -- the worker -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every worker needs (picklable: workers are started by a fork server)."""

    device: str
    ranks: int
    state_bytes: int
    saves: int
    restores: int
    work: str
    store_port: int
    timeout_s: float
    threads: int
    skip_ours: bool
    skip_dcp: bool
    drop_cache: str


class Worker:
    def __init__(self, job: Job, rank: int) -> None:
        self.job = job
        self.rank = rank
        self.work = Path(job.work)
        self.params = plan_params(job.state_bytes)
        if job.device == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
        self.backend = "nccl" if job.device == "cuda" else "gloo"
        self.store = dist.TCPStore(
            "127.0.0.1", job.store_port, is_master=False, timeout=timedelta(seconds=job.timeout_s)
        )
        self.result: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
        self.errors: dict[str, str] = {}

    # helpers
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Seconds of `fn()` on this rank, started after a barrier (all ranks under the same load)."""
        dist.barrier()
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - start, out

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run one measurement; an error is reported in the JSON and the rest of the bench goes on."""
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"[rank {self.rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            self.result.setdefault("section_s", {})[name] = round(time.perf_counter() - start, 3)

    def drop_cache(self) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            self.result["page_cache"] = drop_page_cache(self.work, self.job.drop_cache)
        dist.barrier()

    def init_group(self, prefix: str, world: int) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(prefix, self.store),
            rank=self.rank,
            world_size=world,
            timeout=timedelta(seconds=self.job.timeout_s),
            device_id=self.device if self.device.type == "cuda" else None,
        )
        return init_device_mesh(self.device.type, (world,))

    def checkpointer(self, world: int) -> Checkpointer:
        return Checkpointer(
            CheckpointConfig(local_dir=str(self.work / "ours")),
            rank=self.rank,
            world_size=world,
            local_world_size=world,
        )

    def dump(self) -> None:
        self.result["errors"] = self.errors
        path = self.work / "results" / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result))
        tmp.replace(path)

    # phase A: N ranks save, then restore into the same layout
    def phase_save(self) -> None:
        job = self.job
        mesh = self.init_group("A", job.ranks)
        out: dict[str, Any] = {}
        self.result["A"] = out
        state = build_state(self.params, mesh, self.device, fill=True)
        limit = CopyLimit(local_tensors(state), pinned=self.device.type == "cuda")
        out["shard_bytes"] = limit.nbytes
        out["host_shard_bytes"] = limit.nbytes if self.device.type == "cpu" else 0  # on cuda: on the GPU
        out["copy_limit_cold_s"] = self.timed(limit.copy)[0]  # page faults of the buffers
        ckpt = None
        if not job.skip_ours:
            with self.section("ours_open"):
                ckpt = self.checkpointer(job.ranks)
        with self.section("saves"):
            out.update(self.save_rounds(ckpt, state, limit.copy))
        limit.close()
        del state
        template = build_state(self.params, mesh, self.device, fill=False)
        with self.section("restores_same_layout"):
            out.update(self.restores(ckpt, template, mesh))
        if ckpt is not None:
            ckpt.close()
        del template
        dist.barrier()
        dist.destroy_process_group()
        self.dump()

    def save_rounds(self, ckpt: Checkpointer | None, state: dict, copy: Callable[[], None]) -> dict[str, Any]:
        """Rounds of: copy limit, one save of ours (stall, then persist), dcp.save, dcp.async_save.
        Round 0 warms everything up (page faults, our staging buffer, DCP's plan caches) and is
        reported apart (*_first_s). Interleaving keeps each figure next to the ones it is compared
        with on a machine whose load varies."""
        import torch.distributed.checkpoint as dcp

        runs: dict[str, list[float]] = {}
        group = None if self.job.skip_dcp else dist.new_group(backend="gloo")  # DCP's advice for async_save
        metrics = None
        for i in range(self.job.saves + 1):
            got: dict[str, float] = {"copy_limit": self.timed(copy)[0]}
            if ckpt is not None:
                state["step"] = i
                dist.barrier()
                self.sync()
                start = time.perf_counter()
                pending = ckpt.save_async(i, state)
                got["ours_stall"] = time.perf_counter() - start
                metrics = pending.wait_persisted(timedelta(seconds=self.job.timeout_s))
                got["ours_persist"] = time.perf_counter() - start
                got["ours_tier1"] = metrics.tier1_s or 0.0
                if pending.skipped:
                    raise RuntimeError(f"our save of step {i} was skipped: {metrics.error}")
            if group is not None:
                target = self.work / f"dcp_save{i}"
                got["dcp_save"] = self.timed(lambda t=target: dcp.save(state, checkpoint_id=str(t)))[0]
                dist.barrier()
                self.sync()
                start = time.perf_counter()
                future = dcp.async_save(state, checkpoint_id=str(self.work / "dcp_async"), process_group=group)
                got["dcp_async_blocked"] = time.perf_counter() - start
                future.result()
                got["dcp_async_total"] = time.perf_counter() - start
                dist.barrier()
                if dist.get_rank() == 0:  # keep the newest dcp.save (it is loaded below), as ours keeps its
                    shutil.rmtree(self.work / "dcp_async", ignore_errors=True)
                    if i > 0:
                        shutil.rmtree(self.work / f"dcp_save{i - 1}", ignore_errors=True)
            for key, value in got.items():
                runs.setdefault(f"{key}_runs_s" if i else f"{key}_first_s", []).append(value)
        state["step"] = 7
        out: dict[str, Any] = {k: (v if k.endswith("_runs_s") else v[0]) for k, v in runs.items()}
        if metrics is not None:
            out["ours_file_bytes"] = metrics.bytes
        return out

    def restores(self, ckpt: Checkpointer | None, template: dict, mesh: Any) -> dict[str, Any]:
        """--restores rounds of ours and dcp.load, in ABBA order (ours first in even rounds), each
        into a zeroed template with the page cache dropped first. Per rank: the median time and
        bytes, the largest peak memory, "ok" only if every restore checked out."""
        impls: dict[str, Callable[[dict, Any], dict[str, Any]]] = {}
        if ckpt is not None and "saves" not in self.errors:
            impls["ours_restore"] = lambda t, m: self.ours_restore(ckpt, t, m)
        if not self.job.skip_dcp and "saves" not in self.errors:
            impls["dcp_load"] = self.dcp_load
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in impls}
        for k in range(self.job.restores):
            for name in list(impls) if k % 2 == 0 else list(impls)[::-1]:
                with torch.no_grad():
                    for t in local_tensors(template):
                        t.zero_()
                with self.section(name):
                    runs[name].append(impls[name](template, mesh))
        return {name: merge_runs(got) for name, got in runs.items() if got}

    def ours_restore(self, ckpt: Checkpointer, template: dict, mesh: Any) -> dict[str, Any]:
        self.drop_cache()
        probe = MemoryProbe(self.device)
        dist.barrier()
        with probe.measure() as mem:
            start = time.perf_counter()
            restored = ckpt.restore(into=template)  # type: ignore[call-arg]
            self.sync()
            seconds = time.perf_counter() - start
        dist.barrier()
        out = {"s": seconds, **mem}
        if restored is None:
            out["verified"] = "restore() returned None"
            return out
        out["step"] = restored.step
        out["bytes_read"] = getattr(restored, "bytes_read", None)
        # dcp.load fills the template in place; ours returns new DTensors, which a loop copies in
        # (set_state_dict): that copy is timed too, and the target compares the sum.
        out["copy_in_s"] = self.copy_in(restored.state, template)
        out["s_with_copy_in"] = seconds + out["copy_in_s"]
        out["verified"] = verify(template, self.params, mesh, self.device)
        if restored.state.get("step") != self.job.saves:
            out["verified"] += f"; step leaf {restored.state.get('step')!r}"
        return out

    def copy_in(self, restored: dict, template: dict) -> float:
        """Seconds to copy the restored DTensors' local pieces into the template's."""
        from torch.distributed.tensor import DTensor

        self.sync()
        start = time.perf_counter()
        with torch.no_grad():
            for leaf in leaves_of(self.params):
                src, dst = at(restored, leaf.path), at(template, leaf.path)
                if not isinstance(src, DTensor):
                    raise TypeError(f"{'/'.join(leaf.path)} came back as a {type(src).__name__}, not a DTensor")
                if src.device_mesh != dst.device_mesh or src.placements != dst.placements:
                    raise ValueError(f"{'/'.join(leaf.path)} came back in another layout than the template's")
                dst.to_local().copy_(src.to_local(), non_blocking=True)
        self.sync()
        return time.perf_counter() - start

    def dcp_load(self, template: dict, mesh: Any) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        self.drop_cache()
        probe = MemoryProbe(self.device)
        dist.barrier()
        with probe.measure() as mem:
            start = time.perf_counter()
            dcp.load(template, checkpoint_id=str(self.work / f"dcp_save{self.job.saves}"))
            self.sync()
            seconds = time.perf_counter() - start
        dist.barrier()
        return {"s": seconds, **mem, "verified": verify(template, self.params, mesh, self.device)}

    # phase B: N-1 ranks restore the N-rank checkpoints (resharding)
    def phase_reshard(self) -> None:
        world = self.job.ranks - 1
        out: dict[str, Any] = {}
        self.result["B"] = out
        if self.rank >= world:
            self.dump()
            return
        mesh = self.init_group("B", world)
        template = build_state(self.params, mesh, self.device, fill=False)
        out["shard_bytes"] = nbytes(local_tensors(template))
        out["host_shard_bytes"] = out["shard_bytes"] if self.device.type == "cpu" else 0
        ckpt = None
        if not self.job.skip_ours and "ours_open" not in self.errors:
            with self.section("ours_open_reshard"):
                ckpt = self.checkpointer(world)
        with self.section("restores_reshard"):
            out.update(self.restores(ckpt, template, mesh))
        if ckpt is not None:
            ckpt.close()
        del template
        dist.barrier()
        dist.destroy_process_group()
        self.dump()


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's restores of one kind: median time and bytes, largest memory, all verified."""
    out: dict[str, Any] = {"s_runs": [r["s"] for r in runs]}
    for key in {k for r in runs for k in r}:
        got = [r[key] for r in runs if r.get(key) is not None]
        if key == "verified":
            out[key] = next((v for v in got if v != "ok"), "ok")
        elif not got or not all(isinstance(v, (int, float)) for v in got):
            out[key] = got[0] if got else None
        elif "peak" in key or "sampled" in key:
            out[key] = max(got)
        elif all(isinstance(v, int) for v in got):
            out[key] = statistics.median_low(got)
        else:
            out[key] = statistics.median(got)
    return out


def worker_main(job: Job, rank: int) -> None:
    # One job id for all ranks, so they share the tier-1 directory lock as torchrun's workers do.
    os.environ["TORCHELASTIC_RUN_ID"] = f"sharded-bench-{job.store_port}"
    torch.set_num_threads(job.threads)
    worker = Worker(job, rank)
    marks = worker.result["timeline"] = {"ready": time.time()}  # seconds since the epoch
    try:
        worker.phase_save()
        marks["A_done"] = time.time()
        if job.ranks > 1:
            worker.phase_reshard()
            marks["B_done"] = time.time()
    finally:
        worker.dump()


# -- the parent -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--state-gb", type=float, default=1.0, help="global state size in GiB (fp32)")
    p.add_argument("--ranks", type=int, default=4, help="ranks of the save (the reshard uses ranks - 1)")
    p.add_argument("--saves", type=int, default=3, help="timed saves of ours after the warm-up save")
    p.add_argument("--restores", type=int, default=2, help="restores of each kind per layout (ABBA order)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the whole run may take")
    p.add_argument(
        "--drop-cache",
        choices=["auto", "fadvise"],
        default="auto",
        help="before each restore: auto = drop_caches where writable (root), else fadvise; "
        "fadvise = posix_fadvise(DONTNEED) on the checkpoint files only",
    )
    p.add_argument("--skip-ours", action="store_true", help="only the limits and DCP")
    p.add_argument("--skip-dcp", action="store_true", help="only the limits and ours")
    args = p.parse_args(argv)
    if args.state_gb <= 0:
        p.error(f"--state-gb must be positive, got {args.state_gb}")
    if args.ranks < 1:
        p.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.saves < 1:
        p.error(f"--saves must be >= 1, got {args.saves}")
    if args.restores < 1:
        p.error(f"--restores must be >= 1, got {args.restores}")
    return args


def spawn(job: Job) -> list[dict[str, Any]]:
    """Run the workers as real processes; kill the ones still alive at the deadline or after one
    failed (they would wait in a collective); return their results."""
    # forkserver: torch is imported once (in the server) instead of once per rank, which on a
    # 2-core machine is most of a small run's wall time; the server has no threads, unlike us.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    spawned = time.time()
    saved_env = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)  # read by glibc at the children's start
    procs = []
    try:
        for rank in range(job.ranks):
            proc = ctx.Process(target=worker_main, args=(job, rank), name=f"sharded-bench-r{rank}")
            proc.start()
            procs.append(proc)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + job.timeout_s
    failed = None
    try:
        while any(p.is_alive() for p in procs):
            failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        stop_server = getattr(getattr(mp.forkserver, "_forkserver", None), "_stop", None)
        if stop_server is not None:  # it would exit with us anyway; now it is gone before we return
            stop_server()
    results = []
    for rank, proc in enumerate(procs):
        path = Path(job.work) / "results" / f"rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else {"rank": rank, "errors": {}}
        result["exitcode"] = proc.exitcode
        result["timeline"] = {k: round(v - spawned, 2) for k, v in result.get("timeline", {}).items()}
        results.append(result)
    if failed is not None:
        results[0]["errors"]["run"] = f"rank {procs.index(failed)} exited with {failed.exitcode}"
    elif any(p.exitcode != 0 for p in procs):
        results[0]["errors"]["run"] = f"not done within --timeout {job.timeout_s:.0f}s; the workers were killed"
    return results


def figure(results: list[dict[str, Any]], phase: str, *keys: str) -> dict[str, Any] | None:
    """{"per_rank": [...], "max": ...} of the value at `keys` under each rank's `phase` (a list of
    runs: its median)."""
    per_rank = []
    for r in results:
        value: Any = r.get(phase, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, list):
            value = statistics.median(value) if value else None
        if isinstance(value, (int, float)) or value is None:
            per_rank.append(value)
    if not per_rank or all(v is None for v in per_rank):
        return None
    present = [v for v in per_rank if v is not None]
    out = {"per_rank": [_round(v) for v in per_rank], "max": _round(max(present))}
    if all(isinstance(v, int) for v in present):  # byte counts: the node's total too
        out["sum"] = sum(present)
    return out


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def _max(fig: dict[str, Any] | None) -> float | None:
    return None if fig is None else fig["max"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def summarize(results: list[dict[str, Any]], job: Job) -> dict[str, Any]:
    a = [r for r in results if "A" in r]
    b = [r for r in results if r.get("B", {}).get("shard_bytes") is not None]
    out: dict[str, Any] = {
        "shard_bytes": figure(a, "A", "shard_bytes"),
        "save": {
            "copy_limit_s": figure(a, "A", "copy_limit_runs_s"),
            "copy_limit_first_s": figure(a, "A", "copy_limit_first_s"),
            "ours_stall_s": figure(a, "A", "ours_stall_runs_s"),
            "ours_first_stall_s": figure(a, "A", "ours_stall_first_s"),
            "dcp_async_blocked_s": figure(a, "A", "dcp_async_blocked_runs_s"),
            "dcp_async_blocked_first_s": figure(a, "A", "dcp_async_blocked_first_s"),
            "dcp_save_s": figure(a, "A", "dcp_save_runs_s"),
        },
        "persist": {
            "ours_persist_s": figure(a, "A", "ours_persist_runs_s"),
            "ours_tier1_s": figure(a, "A", "ours_tier1_runs_s"),
            "ours_first_persist_s": figure(a, "A", "ours_persist_first_s"),
            "dcp_save_s": figure(a, "A", "dcp_save_runs_s"),
            "dcp_save_first_s": figure(a, "A", "dcp_save_first_s"),
            "dcp_async_total_s": figure(a, "A", "dcp_async_total_runs_s"),
        },
    }
    # every timed round of every rank, for a look behind the medians
    out["save"]["runs_per_rank"] = {
        key.removesuffix("_runs_s"): [[_round(v) for v in r["A"][key]] for r in a if r["A"].get(key)]
        for key in ("copy_limit_runs_s", "ours_stall_runs_s", "dcp_async_blocked_runs_s")
    }
    # per rank, the median over rounds of each round's ratio (figures of one round ran under the
    # same load), then the worst rank
    for key, num, den, worst in (
        ("paired_ours_stall_over_copy_limit", "ours_stall_runs_s", "copy_limit_runs_s", max),
        ("paired_dcp_async_blocked_over_ours_stall", "dcp_async_blocked_runs_s", "ours_stall_runs_s", min),
    ):
        paired = [
            statistics.median(x / y for x, y in zip(r["A"][num], r["A"][den], strict=True))
            for r in a
            if r["A"].get(num) and r["A"].get(den)
        ]
        out["save"][f"{key}_worst_rank"] = round(worst(paired), 3) if paired else None
    for name, phase, rs in (("restore_same_layout", "A", a), ("restore_reshard", "B", b)):
        section: dict[str, Any] = {"ranks": len(rs), "shard_bytes": figure(rs, phase, "shard_bytes")}
        for impl in ("ours_restore", "dcp_load"):
            section[impl] = {
                key: figure(rs, phase, impl, key)
                for key in (
                    "s",
                    "copy_in_s",
                    "s_with_copy_in",
                    "bytes_read",
                    "io_read_bytes",
                    "io_rchar",
                    "peak_extra_bytes",
                    "device_peak_extra_bytes",
                    "sampled_extra_anon_bytes",
                    "sampled_extra_file_bytes",
                )
            }
            section[impl]["verified"] = sorted({str(r.get(phase, {}).get(impl, {}).get("verified")) for r in rs})
            runs = [r.get(phase, {}).get(impl, {}).get("s_runs") or [] for r in rs]
            slowest = [_round(max(col)) for col in zip(*runs, strict=False)]  # a rank that failed has fewer
            section[impl]["s_runs_slowest_rank"] = slowest if all(runs) else None
            # host memory the restore held beyond the shard it returns (ours) or fills in place (DCP);
            # on cuda the shard is on the GPU, so all of the peak is beyond it
            beyond = [
                peak - r[phase]["host_shard_bytes"] if isinstance(peak, int) else None
                for r in rs
                for peak in [r.get(phase, {}).get(impl, {}).get("peak_extra_bytes")]
            ]
            section[impl]["peak_extra_minus_shard_bytes"] = (
                None
                if all(v is None for v in beyond)
                else {"per_rank": beyond, "max": max(v for v in beyond if v is not None)}
            )
        out[name] = section
    out["ratios"] = ratios(out, b)
    return out


def ours_time(section: dict[str, Any]) -> float | None:
    """Ours' restore time as compared with dcp.load: including the copy into the template."""
    ours = section["ours_restore"]
    return _max(ours["s_with_copy_in"]) if ours["s_with_copy_in"] is not None else _max(ours["s"])


def ratios(out: dict[str, Any], b: list[dict[str, Any]]) -> dict[str, float | None]:
    save, persist, same, reshard = out["save"], out["persist"], out["restore_same_layout"], out["restore_reshard"]
    r: dict[str, float | None] = {
        "ours_stall_over_copy_limit": _ratio(_max(save["ours_stall_s"]), _max(save["copy_limit_s"])),
        "dcp_async_blocked_over_ours_stall": _ratio(_max(save["dcp_async_blocked_s"]), _max(save["ours_stall_s"])),
        # the most dcp_async_blocked_over_ours_stall can be while ours blocks at least the copy limit
        "dcp_async_blocked_over_copy_limit": _ratio(_max(save["dcp_async_blocked_s"]), _max(save["copy_limit_s"])),
        "dcp_async_blocked_first_over_ours_stall": _ratio(
            _max(save["dcp_async_blocked_first_s"]), _max(save["ours_stall_s"])
        ),
        "ours_persist_over_dcp_save": _ratio(_max(persist["ours_persist_s"]), _max(persist["dcp_save_s"])),
        "same_layout_ours_over_dcp_load": _ratio(ours_time(same), _max(same["dcp_load"]["s"])),
        "reshard_ours_over_dcp_load": _ratio(ours_time(reshard), _max(reshard["dcp_load"]["s"])),
        "reshard_ours_without_copy_in_over_dcp_load": _ratio(
            _max(reshard["ours_restore"]["s"]), _max(reshard["dcp_load"]["s"])
        ),
    }
    # per rank against its own new shard, worst rank
    for impl, key, name in (
        ("ours_restore", "bytes_read", "reshard_bytes_read_over_new_shard"),
        ("ours_restore", "io_read_bytes", "reshard_io_read_bytes_over_new_shard"),
        ("dcp_load", "io_read_bytes", "reshard_dcp_io_read_bytes_over_new_shard"),
        ("ours_restore", "io_rchar", "reshard_io_rchar_over_new_shard"),
        ("dcp_load", "io_rchar", "reshard_dcp_io_rchar_over_new_shard"),
    ):
        per = [_ratio(x["B"].get(impl, {}).get(key), x["B"]["shard_bytes"]) for x in b]
        r[name] = max((v for v in per if v is not None), default=None)
    for impl, name in (
        ("ours_restore", "reshard_peak_extra_over_shard_plus_chunk"),
        ("dcp_load", "reshard_dcp_peak_extra_over_shard_plus_chunk"),
    ):
        per = [
            _ratio(x["B"].get(impl, {}).get("peak_extra_bytes"), x["B"]["host_shard_bytes"] + CHUNK_BYTES) for x in b
        ]
        r[name] = max((v for v in per if v is not None), default=None)
    return r


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result: dict[str, Any] = {"device": args.device}
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.ranks:
            result["skipped"] = f"--ranks {args.ranks} needs one GPU per rank, this host has {gpus}" + (
                f"; run with --ranks {gpus} (--ranks 1 skips the reshard phase)" if gpus else ""
            )
            return _emit(result, args.json)
    cpus = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="sharded-bench-", dir=args.dir))
    (work / "results").mkdir()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=args.timeout)
    )
    job = Job(
        device=args.device,
        ranks=args.ranks,
        state_bytes=int(args.state_gb * (1 << 30)),
        saves=args.saves,
        restores=args.restores,
        work=str(work),
        store_port=store.port,
        timeout_s=args.timeout,
        threads=max(1, cpus // args.ranks),
        skip_ours=args.skip_ours,
        skip_dcp=args.skip_dcp,
        drop_cache=args.drop_cache,
    )
    params = plan_params(job.state_bytes)
    leaves = leaves_of(params)
    result.update(
        device_name=(
            torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
        ),
        cpu_count=cpus,
        torch=torch.__version__,
        ranks=args.ranks,
        reshard_ranks=args.ranks - 1 if args.ranks > 1 else None,
        threads_per_rank=job.threads,
        state_bytes=sum(math.prod(leaf.shape) for leaf in leaves) * BYTES,
        dtensors=len(leaves),
        largest_shape=list(max((leaf.shape for leaf in leaves), key=math.prod)),
        chunk_bytes=CHUNK_BYTES,
        saves=args.saves,
        restores=args.restores,
        dir=str(work),
        code=code_version(),
    )
    started = time.perf_counter()
    load_before = os.getloadavg()
    try:
        results = spawn(job)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    # the machine's load (1-minute average) before and after: other work shares these cores
    result["loadavg_1m"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    methods = {r.get(p, {}).get("page_cache") for r in results for p in ("A", "B")} | {
        r.get("page_cache") for r in results
    }
    methods.discard(None)
    result["page_cache"] = {
        "dropped_before_each_restore_with": sorted(methods),
        "note": "io_read_bytes > 0 in a restore means its reads reached the disk, not the page cache",
    }
    result["malloc"] = MALLOC_ENV
    if args.ranks == 1:
        result["reshard_skipped"] = "--ranks 1: no N-1 layout to restore into"
    result.update(summarize(results, job))
    ratios_ = result["ratios"]
    result["targets"] = {k: f"{op} {v}" for k, (op, v) in TARGETS.items()}
    result["targets_met"] = {
        k: None if ratios_.get(k) is None else (ratios_[k] <= v if op == "<=" else ratios_[k] >= v)
        for k, (op, v) in TARGETS.items()
    }
    result["errors"] = {f"rank{r['rank']}": r["errors"] for r in results if r.get("errors")}
    result["exitcodes"] = [r.get("exitcode") for r in results]
    # seconds after the spawn, slowest rank: where the run's wall time goes
    result["timeline_s"] = {
        key: max(r["timeline"][key] for r in results if key in r["timeline"])
        for key in ("ready", "A_done", "B_done")
        if any(key in r["timeline"] for r in results)
    }
    result["section_s"] = {
        key: max(r.get("section_s", {}).get(key, 0.0) for r in results)
        for key in sorted({k for r in results for k in r.get("section_s", {})})
    }
    return _emit(result, args.json)


def code_version() -> dict[str, Any]:
    """The commit measured, and which of ckpt's files differ from it (uncommitted edits)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "--short", "HEAD").strip() or None,
        "ckpt_uncommitted": git("status", "--porcelain", "--", "ckpt").splitlines(),
    }


def _emit(result: dict[str, Any], path: Path | None) -> dict[str, Any]:
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
