"""A sharded run never starts over from step 0 while some rank holds its state (trainer/resumable.py,
`_refuse_to_start_over`).

Two real gloo processes train FSDP2 (`fully_shard` over a 1-D mesh of 2), each rank with a checkpoint directory
of its own, as two nodes have (LOCAL_WORLD_SIZE=1, no tier 0, no shared tier), and save step 2. Then rank 1's
node is replaced by an empty one: no step can be read by both ranks, and a sharded state's parts do not travel
over the process group. Both ranks must stop with StateUnreachableError (naming step 2), not go on from step 0,
and rank 0's checkpoint must still be there."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def _rank(rank: int, port: int, work: str, out: mp.Queue) -> None:
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", ELASTIC_TIER0_DIR="")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer import Resumable, ResumeConfig
    from trainer.errors import StateUnreachableError

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def run(ckpt: Path) -> Resumable:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return Resumable(ResumeConfig.at(ckpt, save_every=2), model=model, optimizer=optimizer, mesh=mesh)

    try:
        with run(Path(work) / f"node{rank}") as first:
            assert first.restore() == 0
            for step in (1, 2):
                first.optimizer.zero_grad()  # type: ignore[union-attr]
                first.model(torch.ones(4, 8)).sum().backward()
                first.optimizer.step()  # type: ignore[union-attr]
                first.step_done(step)
        # Rank 1's node replaced by an empty one.
        with run(Path(work) / ("node0" if rank == 0 else "fresh1")) as second:
            try:
                step = second.restore()
                out.put((rank, f"went on from step {step}"))
            except StateUnreachableError as exc:
                out.put((rank, f"refused: {exc}"))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"error: {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_sharded_group_that_can_agree_on_no_step_stops_rather_than_start_over(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=150) for _ in range(2))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    for rank in (0, 1):
        assert results[rank].startswith("refused:"), results
        assert "the newest some rank holds is step 2" in results[rank] and "shared tier" in results[rank], results
    assert "this rank's newest is step 2" in results[0] and "this rank's newest is none" in results[1], results
    assert list((tmp_path / "node0").glob("step_*2/COMMIT")), "rank 0's checkpoint is gone"
