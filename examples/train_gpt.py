"""A small GPT-style transformer on synthetic tokens, with AMP, resumable, elastic.

It uses `trainer.train_loop` (you write the step, the loop is written once): restore at start,
the data position and the RNG streams included, a checkpoint every --ckpt-every steps and of the
last step. `--ckpt-mode overlapped` hides the device-to-host copy of a save behind the next
forward/backward (the optimizer's step waits for it by itself).

    # CPU, a few steps (fp32; --dtype bf16/fp16 autocast also works on CPU)
    python examples/train_gpt.py --steps 20 --ckpt-dir /tmp/gpt --device cpu
    # one GPU: bf16 autocast (no GradScaler needed); --dtype fp16 uses a GradScaler
    elastic-run --nproc-per-node 1 examples/train_gpt.py --device cuda --steps 300 --ckpt-dir /tmp/gpt \\
        --layers 12 --heads 12 --d-model 768 --seq-len 1024 --vocab 8192 --global-batch 64 --max-micro-batch 16

Rank 0 prints `step=<n> loss=<x> lr=<y> tok/s=<z>` every --log-every steps, then `tokens_per_s=<z>`
(all ranks, steps after the first, checkpoint saves included) and `final_digest=<hex>`. Under
elastic-run or torchrun it runs DDP (NCCL on CUDA, gloo on CPU); without them, one process. The
global batch (--global-batch sequences) stays the same at any world size; each rank accumulates
gradients over micro-batches of at most --max-micro-batch sequences.

The data: sequence i is an arithmetic progression modulo the vocabulary, with a start and stride
drawn from a generator seeded by (seed, i), so any rank or DataLoader worker makes any sample.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from core.numbers import at_least
from trainer import (
    DataConfig,
    ElasticSampler,
    Resumable,
    ResumeConfig,
    train_loop,
    wrap_ddp,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def show(line: str) -> None:
    """Print a line for people, in one write: ranks share the launcher's stdout, and print() writes
    the text and the newline separately, so two ranks' lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """The flags of this example (examples/train_fsdp.py adds its own to them)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=at_least(0), required=True, help="total optimizer steps")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory (node-local tier)")
    p.add_argument("--ckpt-every", type=at_least(1), default=50, help="save to disk (tier 1) every K steps")
    p.add_argument("--snapshot-every", type=at_least(0), default=0,
                   help="snapshot into host memory (tier 0, under elastic-run) every K steps; 0: only at --ckpt-every")
    p.add_argument("--replica-every", type=at_least(1), default=10,
                   help="copy a tier-0 snapshot to the next node (peer replica, ckpt/replica.py) every K steps")
    p.add_argument("--ckpt-mode", choices=["staged", "overlapped"], default="overlapped",
                   help="overlapped (default): the copy of the state to host overlaps the next forward/backward")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="autocast dtype: bf16 (default on CUDA), fp16 (with a GradScaler), fp32 (default on CPU)")
    p.add_argument("--layers", type=at_least(1), default=2)
    p.add_argument("--heads", type=at_least(1), default=4)
    p.add_argument("--d-model", type=at_least(1), default=64)
    p.add_argument("--seq-len", type=at_least(1), default=32)
    p.add_argument("--vocab", type=at_least(2), default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dataset-size", type=at_least(1), default=100_000, help="number of synthetic sequences")
    p.add_argument("--global-batch", type=at_least(1), default=16, help="sequences per step over all ranks")
    p.add_argument("--max-micro-batch", type=at_least(1), default=None,
                   help="most sequences per forward/backward on a rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=at_least(0), default=10, help="linear warm-up steps, then cosine decay to --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=at_least(0), default=0, help="DataLoader worker processes")
    p.add_argument("--log-every", type=at_least(1), default=1)
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels where torch has them (always on for CPU); "
                        "needed for bitwise resume on CUDA")
    return p


def parse_args() -> argparse.Namespace:
    p = build_parser(__doc__)
    return checked_args(p, p.parse_args())


def checked_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


class ProgressionTokens(Dataset[torch.Tensor]):
    """Sequence i: (a + b * k) mod vocab for k = 0..seq_len, a and b drawn from a generator seeded by (seed, i)."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        a, b = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        return (a + (b % 16 + 1) * torch.arange(self.seq_len + 1)) % self.vocab


class Block(nn.Module):
    """Pre-norm attention + MLP. The rows of `qkv` are ordered (head, q|k|v, head dim), so that a
    tensor-parallel shard of it (examples/train_fsdp.py) holds whole heads: the forward works on the
    heads it has (`-1`), a full set or a TP rank's share."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim, self.dropout = d // heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        d = args.d_model
        self.tok, self.pos = nn.Embedding(args.vocab, d), nn.Embedding(args.seq_len, d)
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(Block(d, args.heads, args.dropout) for _ in range(args.layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, args.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lr_schedule(warm: int, total: int) -> Callable[[int], float]:
    """The LR factor of step s: linear warm-up over `warm` steps, then cosine decay to 0.1 at `total`."""
    def lr_factor(s: int) -> float:
        if s < warm:
            return min(1.0, (s + 1) / warm)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))

    return lr_factor


@dataclass
class Throughput:
    """Tokens per second between log points. The first step (after a start or a resume) is shown with its
    own rate, from its start, but left out of the overall figure (allocator, kernel selection)."""

    tokens_per_step: int
    first_step: int = -1
    first_started: float = 0.0
    started: float = 0.0
    last: float = 0.0
    logged: int = 0
    timed_steps: int = 0

    def tick(self, done: int) -> float:
        now = time.perf_counter()
        if done == self.first_step + 1:
            rate = self.tokens_per_step / max(now - self.first_started, 1e-9)
            self.started = now
        else:
            rate = (done - self.logged) * self.tokens_per_step / (now - self.last)
            self.timed_steps = done - self.first_step - 1
        self.last, self.logged = now, done
        return rate

    def overall(self) -> float:
        return self.timed_steps * self.tokens_per_step / (self.last - self.started)


def forward_backward(model: nn.Module, batches: Any, *, device: torch.device, amp_dtype: torch.dtype,
                     scaler: torch.amp.GradScaler) -> torch.Tensor:
    """One step's forward and backward over its micro-batches, (tokens, loss weight, sync context) as
    `Resumable.accumulate` yields them; returns the sum of the weighted losses (on the device)."""
    loss_sum = torch.zeros((), device=device)
    for tokens, weight, sync in batches:
        tokens = tokens.to(device, non_blocking=True)
        with sync:  # gradients are all-reduced once per step, on the last micro-batch
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) * weight
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    return loss_sum


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    if args.device == "cpu" or args.deterministic:
        if args.device == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        # On CUDA a kernel without a deterministic variant warns instead of stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=args.device == "cuda")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if "RANK" in os.environ:  # under elastic-run / torchrun
        if not dist.is_initialized():  # (a run re-entered in place is in its new group already: trainer.run_elastic)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def main() -> None:
    args = parse_args()
    rank, world, device = setup(args)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
    show(f"worker rank={rank} world={world} pid={os.getpid()} restart={restart}")
    torch.manual_seed(args.seed)
    with device:  # built on its device: no host-side initialisation of every parameter, then a copy
        model = GPT(args)
    # wrap_ddp (one gradient-bucket layout) for bitwise resume; plain DDP rebuilds its buckets for speed.
    wrap = wrap_ddp if args.deterministic or device.type == "cpu" else DDP
    ddp = wrap(model, device_ids=[device.index] if device.type == "cuda" else None) if dist.is_initialized() else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args.warmup, args.steps))
    amp_dtype = DTYPES[args.dtype]
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    sampler = ElasticSampler(DataConfig(dataset_size=args.dataset_size, global_batch=args.global_batch, seed=args.seed,
                                        max_micro_batch=args.max_micro_batch))
    loader = sampler.loader(ProgressionTokens(args.dataset_size, args.seq_len, args.vocab, args.seed),
                            num_workers=args.num_workers, pin_memory=device.type == "cuda")
    config = ResumeConfig.at(args.ckpt_dir, save_every=args.snapshot_every or args.ckpt_every,
                             persist_every=args.ckpt_every, mode=args.ckpt_mode, replica_every=args.replica_every)
    run = Resumable(config, model=ddp, optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler,
                    extras={"tokens": 0})
    meter = Throughput(tokens_per_step=args.global_batch * args.seq_len)

    def train_step(step: int, micro_batches: list[torch.Tensor]) -> None:
        if meter.first_step < 0:
            if rank == 0 and run.resumed_from is not None:
                show(f"resumed from step {step}")
            meter.first_step, meter.first_started = step, time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = forward_backward(ddp, run.accumulate(micro_batches), device=device, amp_dtype=amp_dtype,
                                    scaler=scaler)
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        run.extras["tokens"] += args.global_batch * args.seq_len
        done = step + 1
        if done == meter.first_step + 1 or done % args.log_every == 0 or done == args.steps:
            if dist.is_initialized():
                dist.all_reduce(loss_sum)  # sum over ranks of their weighted losses = world * global mean
            mean = loss_sum.item() / world  # .item() waits for the GPU, so the timing is honest
            rate = meter.tick(done)
            if rank == 0:
                show(f"step={done} loss={mean:.6f} lr={scheduler.get_last_lr()[0]:.3e} tok/s={rate:.0f}")

    # Flash and memory-efficient attention have no deterministic backward: --deterministic on CUDA
    # uses the math kernel (slower), so that a resumed run can match an uninterrupted one bitwise.
    attention = (sdpa_kernel(SDPBackend.MATH) if args.deterministic and device.type == "cuda" else nullcontext())
    with attention:
        step = train_loop(train_step, run, args.steps, loader=loader)
    if rank == 0 and run.resumed_from == step:
        show(f"resumed from step {step}")
    if rank == 0 and meter.timed_steps > 0:
        show(f"tokens_per_s={meter.overall():.0f} over {meter.timed_steps} steps on {world} x {device.type} "
            f"({args.dtype})")
    digest = run.teardown()  # train_loop saved the last step and closed: digest, then the process group
    if rank == 0:
        show(f"final_digest={digest}")


if __name__ == "__main__":
    main()
