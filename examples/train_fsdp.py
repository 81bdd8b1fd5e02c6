"""The GPT of examples/train_gpt.py, sharded: FSDP2 (`fully_shard` per block and the root), and with
--tp N tensor parallelism inside a 2-D (dp, tp) device mesh. Resumable, elastic, and resharded on
load: restarted with another world size or --tp on the same --ckpt-dir, it continues from the same
global data position with the same global batch, each rank loading only the slices it now holds.

    # CPU (gloo), 4 ranks: FSDP 2 x TP 2; then the same run continued as 1-D FSDP over 3 ranks
    elastic-run --nproc-per-node 4 examples/train_fsdp.py --steps 20 --ckpt-dir /tmp/fsdp --ckpt-every 5 --tp 2
    elastic-run --nproc-per-node 3 examples/train_fsdp.py --steps 40 --ckpt-dir /tmp/fsdp --ckpt-every 5
    # CUDA (NCCL), 8 GPUs, bf16 parameters in compute (fp32 master weights and gradient reduction)
    elastic-run --nproc-per-node 8 examples/train_fsdp.py --device cuda --dtype bf16 --tp 2 --steps 300 \\
        --ckpt-dir /nvme/fsdp --layers 12 --heads 12 --d-model 768 --seq-len 1024 --vocab 8192 --global-batch 64

The mesh: world W = dp x tp. With --tp 1 it is 1-D FSDP over all W ranks; with dp = 1 (W == --tp) it
is tensor parallelism alone (no FSDP). The TP plan splits each block's attention by heads (`qkv`
column-wise, `proj` row-wise) and its MLP (first linear column-wise, second row-wise); embeddings,
norms and the head are sharded by FSDP only. The ranks of one TP group read the same samples: the
sampler is built from the mesh (`ElasticSampler(config, mesh=mesh)`), and the global batch is split
over the dp ranks.

Rank 0 prints `step=<n> loss=<x> lr=<y>` every --log-every steps and `final_digest=<hex>`: the
global digest of the model and optimizer state (every DTensor gathered), the same bytes whatever
the layout, so runs with different --tp or world sizes compare. Without elastic-run or torchrun it
runs as one process. Faults, the sample log and events come from the environment as for the other
examples (ELASTIC_FAULTS, ELASTIC_SAMPLE_LOG_DIR, ELASTIC_EVENTS_DIR).
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel
from train_gpt import GPT, ProgressionTokens, build_parser, checked_args, lr_schedule, show
from train_gpt import setup as gpt_setup

from trainer import DataConfig, ElasticSampler, Resumable, ResumeConfig, run_elastic

TP_PLAN = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "mlp.0": ColwiseParallel(),
           "mlp.2": RowwiseParallel()}
"""Per block: attention split by heads (train_gpt's qkv rows are ordered by head), the MLP by its hidden units."""


def parse_args() -> argparse.Namespace:
    p = build_parser(__doc__)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the mesh is world/tp x tp)")
    args = checked_args(p, p.parse_args())
    if args.dtype == "fp16":
        p.error("--dtype fp16 needs a GradScaler, which this example does not use: use bf16 or fp32")
    if args.heads % args.tp:
        p.error(f"--heads {args.heads} must be a multiple of --tp {args.tp} (TP splits the attention by heads)")
    return args


def setup(args: argparse.Namespace) -> tuple[DeviceMesh, torch.device]:
    """train_gpt's setup (deterministic kernels on CPU or with --deterministic, the device, the process
    group under elastic-run / torchrun), a group of one otherwise, then the device mesh."""
    _, world, device = gpt_setup(args)
    if not dist.is_initialized():  # one process: FSDP still needs a process group
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    if args.tp == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",)), device
    return init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp")), device


def shard(model: GPT, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    """TP inside each block (on the mesh's "tp" dim), then FSDP per block and the root (on "dp")."""
    if "tp" in (mesh.mesh_dim_names or ()):
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], TP_PLAN)
        if mesh["dp"].size() == 1:
            return  # tensor parallelism alone
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def clip_grad_norm(model: nn.Module, max_norm: float) -> None:
    """Scale the gradients to a global norm of at most `max_norm`. Per parameter, because the
    parameters lie on different meshes (TP weights on (dp, tp), the others on dp), which
    torch.nn.utils.clip_grad_norm_ cannot stack."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = float(torch.stack(squares).sum().sqrt())
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))


def main() -> None:
    args = parse_args()
    mesh, device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    show(f"worker rank={rank} world={world} mesh={dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))} "
         f"pid={os.getpid()} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}")
    torch.manual_seed(args.seed)  # every rank alike: the same initial weights, and TP peers draw the same dropout
    model = GPT(args).to(device)
    shard(model, mesh, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args.warmup, args.steps))
    sampler = ElasticSampler(DataConfig(dataset_size=args.dataset_size, global_batch=args.global_batch,
                                        seed=args.seed, max_micro_batch=args.max_micro_batch), mesh=mesh)
    dataset = ProgressionTokens(args.dataset_size, args.seq_len, args.vocab, args.seed)
    config = ResumeConfig.at(args.ckpt_dir, save_every=args.snapshot_every or args.ckpt_every,
                             persist_every=args.ckpt_every, mode=args.ckpt_mode, replica_every=args.replica_every)
    # Flash and memory-efficient attention have no deterministic backward: --deterministic on CUDA uses
    # the math kernel, as train_gpt.py does.
    attention = sdpa_kernel(SDPBackend.MATH) if args.deterministic and device.type == "cuda" else nullcontext()
    with attention, Resumable(config, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                              mesh=mesh) as run:
        step = run.restore()
        if run.reformed_in_place:  # this process re-entered main() for a new round (trainer.run_elastic)
            show(f"reformed world={world} pid={os.getpid()} step={step}")
        elif rank == 0 and run.resumed_from is not None:
            show(f"resumed from step {step}")
        batches = iter(sampler.loader(dataset, num_workers=args.num_workers, pin_memory=device.type == "cuda"))
        while step < args.steps:
            try:
                optimizer.zero_grad(set_to_none=True)
                loss_sum = torch.zeros((), device=device)
                for tokens, weight, sync in run.accumulate(batches):
                    tokens = tokens.to(device, non_blocking=True)
                    with sync:  # FSDP reduce-scatters the gradients once per step, on the last micro-batch
                        logits = model(tokens[:, :-1])
                        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) * weight
                        loss.backward()
                    loss_sum += loss.detach()
                clip_grad_norm(model, 1.0)
                optimizer.step()
                scheduler.step()
                step += 1
                dist.all_reduce(loss_sum)  # the weighted losses of all ranks (TP peers alike): world x the mean
                mean = loss_sum.item() / world
                if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                    show(f"step={step} loss={mean:.6f} lr={scheduler.get_last_lr()[0]:.3e}")
                run.step_done(step, loss=mean)  # (its collectives too: a sharded state's digest, with digests on)
            except Exception as exc:  # a lost peer or a new round: run.reform re-enters main() in place
                step = run.reform(exc)  # (raises Reentry under run_elastic, re-raises anything else)
                batches = iter(sampler.loader(dataset, num_workers=args.num_workers,
                                              pin_memory=device.type == "cuda"))
        digest = run.teardown(batches)  # saves the last step, closes, digest, ends the process group
    if rank == 0:
        show(f"final_digest={digest}")


if __name__ == "__main__":
    run_elastic(main)  # under elastic-run, a membership change runs main() again in this process
