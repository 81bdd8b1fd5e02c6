"""A part sent over the process group (trainer/part_transfer.py) that its holder cannot send whole, or that its
receiver refuses, costs that part and nothing else: both ranks stay in step (the next collective pairs), no rank
raises. Two real gloo ranks; rank 0 holds real tier-0 slots, rank 1 keeps what it is sent in its own tier 0."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import tempfile
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer
from core.tier0_dir import shm_root
from tests.conftest import join_or_kill

pytestmark = pytest.mark.timeout(120)

# (what is done to rank 0's slot of step 3 before the send, the step rank 0 sends when asked for step 3)
CASES = [("nothing, but another step's part is sent", 2), ("bytes flipped", 3), ("data file cut short", 3),
         ("nothing", 3)]


def _rank(rank: int, port: int, holder: str, keeper: str, out: Any, go: Any) -> None:
    import torch.distributed as dist

    from ckpt import peer_parts
    from ckpt.tier0 import HostTier
    from trainer import part_transfer

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))

    class Node:
        sends = 3

        def open_part(self, step: int, part: int) -> AbstractContextManager[peer_parts.Part]:
            return peer_parts.open_part([HostTier(Path(holder), read_timeout=10)], self.sends, part)

        def keep_part(self, step: int, part: int, **kw: Any) -> Path:
            return peer_parts.keep_part(Path(keeper), receiver=1, step=step, rank=part, **kw)

    node = Node()
    try:
        for _, sends in CASES:
            if rank == 0:
                go.get(timeout=60)  # the parent has damaged the slot for this case
            node.sends = sends
            kept = part_transfer._send(node, rank, 3, part_transfer.Send(part=0, holder=0, receivers=(1,)))
            paired = torch.tensor([float(rank + 1)])
            dist.all_reduce(paired)  # the group's next collective: pairs only if both ranks ran the same ones
            out.put((rank, kept, paired.item()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}", None))
    finally:
        dist.destroy_process_group()


def test_a_part_that_cannot_be_sent_or_kept_costs_that_part_and_the_group_stays_in_step(tmp_path: Path) -> None:
    holder, keeper = (Path(tempfile.mkdtemp(prefix=f"test-parts-{n}-", dir=shm_root())) for n in "ab")
    try:
        with Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=holder, tier0_helper=False),
                          rank=0, world_size=1) as ck:
            for step in (1, 2, 3):
                ck.snapshot(step, {"w": torch.full((1000,), float(step)), "step": step}).wait_persisted()
        [slot] = [m.parent for m in holder.glob("rank_00000/slot_*/manifest.json") if '"step":3' in m.read_text()]
        data = slot / "state.safetensors"
        original = data.read_bytes()
        ctx = mp.get_context("spawn")
        out, go = ctx.Queue(), ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_rank, args=(r, port, str(holder), str(keeper), out, go), daemon=True)
                 for r in (0, 1)]
        for p in procs:
            p.start()
        results: dict[str, list[tuple[Any, Any]]] = {}
        try:
            for what, _ in CASES:
                data.write_bytes(original)
                if what == "bytes flipped":  # they no longer match the manifest's checksum
                    data.write_bytes(original[:-64] + bytes(b ^ 0xFF for b in original[-64:]))
                elif what == "data file cut short":  # the holder's mmap of it raised, after the header went out
                    data.write_bytes(original[: len(original) // 2])
                go.put(what)
                got = sorted(out.get(timeout=60) for _ in range(2))
                results[what] = [(kept, paired) for _, kept, paired in got]
        finally:
            join_or_kill(procs)
        for what, _ in CASES[:3]:
            assert results[what] == [(0, 3.0), (0, 3.0)], (what, results)
        assert results["nothing"] == [(0, 3.0), (1, 3.0)], results  # kept, after three failed sends
    finally:
        shutil.rmtree(holder, ignore_errors=True)
        shutil.rmtree(keeper, ignore_errors=True)
