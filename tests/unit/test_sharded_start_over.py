"""A sharded run's restore when some ranks hold none of its parts (trainer/part_transfer.py and
Resumable._refuse_to_start_over): the parts go over the process group, or the run stops; it never starts over.

Two real gloo processes train FSDP2 (`fully_shard` over a 1-D mesh of 2) on one node (a shared checkpoint
directory and tier 0) and save step 2. Then rank 1 moves to an empty node of its own (LOCAL_WORLD_SIZE=1, no
shared tier), as a replacement node would:
- without a tier 0 there it cannot keep parts sent to it: both ranks stop with StateUnreachableError naming
  step 2 (before, both went on from step 0), and the checkpoint is still there;
- with a tier 0, rank 0 sends both parts over the group, rank 1 keeps them (verified) and both restore step 2:
  the global digest right after the restore equals the one at the save.
The model has a trainable head its forward never uses (no gradient, so no optimizer state: before, every restore
failed in torch's set_state_dict). Last, both ranks restore the sharded checkpoint into the plain model, whole
(before, it was judged malformed: the run started over at step 0 and overwrote it)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import join_or_kill

pytestmark = pytest.mark.timeout(180)


def _rank(rank: int, port: int, work: str, shm: str, out: mp.Queue) -> None:
    os.environ.update(LOCAL_RANK=str(rank), ELASTIC_TIER0_DIR="", ELASTIC_EVENTS_DIR=f"{work}/events",
                      TORCHELASTIC_RUN_ID=f"parts-{port}")  # one job: the two ranks share node A's directory
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer import Resumable, ResumeConfig
    from trainer.errors import StateUnreachableError

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    class Net(torch.nn.Sequential):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
            self.head = torch.nn.Linear(8, 3)  # trainable, never used: no gradient, so no optimizer state

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self[1](self[0](x))

    def run(node: str, local_world: int, tier0: bool, sharded: bool = True) -> Resumable:
        os.environ.update(LOCAL_WORLD_SIZE=str(local_world), LOCAL_RANK=str(rank if local_world == 2 else 0))
        torch.manual_seed(0)
        model = Net()
        if sharded:
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = ResumeConfig.at(Path(work) / node, save_every=2, tier0_dir=f"{shm}/{node}" if tier0 else "",
                                 tier0_helper=False)
        return Resumable(config, model=model, optimizer=optimizer, mesh=mesh if sharded else None)

    def whole(model: torch.nn.Module) -> str:
        """sha256 of the model's whole parameters, in name order (gathered from their shards: collective)."""
        digest = hashlib.sha256()
        for _, p in sorted(model.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest.update(full.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()

    try:
        with run("nodeA", 2, True) as first:
            assert first.restore() == 0
            for step in (1, 2):
                first.optimizer.zero_grad()  # type: ignore[union-attr]
                first.model(torch.ones(4, 8)).sum().backward()
                first.optimizer.step()  # type: ignore[union-attr]
                first.step_done(step)
            saved, saved_whole = first.final_digest(), whole(first.model)
        for tier0 in (False, True):
            with run("nodeA" if rank == 0 else f"fresh-{tier0}", 1, tier0 or rank == 0) as second:
                try:
                    step = second.restore()
                    same = second.final_digest() == saved
                    out.put((rank, tier0, f"restored step {step}, from {second.restored and second.restored.tier}, "
                                          f"{'same' if same else 'another'} digest"))
                except StateUnreachableError as exc:
                    out.put((rank, tier0, f"refused: {exc}"))
        # The sharded checkpoint restored into the plain model (evaluation, export): whole, from tier 1.
        with run("nodeA", 2, False, sharded=False) as plain:
            step = plain.restore()
            same = whole(plain.model) == saved_whole
            out.put((rank, "plain", f"restored step {step}, from {plain.restored and plain.restored.tier}, "
                                    f"{'same' if same else 'other'} parameters, optimizer state of "
                                    f"{len(plain.optimizer.state)} of 6"))  # type: ignore[union-attr]
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, None, f"error: {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_sharded_group_sends_the_parts_a_new_node_lacks_or_stops_but_never_starts_over(tmp_path: Path) -> None:
    from core.tier0_dir import shm_root

    shm = Path(shm_root()) / f"test-parts-{os.getpid()}-{tmp_path.name}"
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), str(shm), out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {(r, t): text for r, t, text in (out.get(timeout=150) for _ in range(6))}
    finally:
        join_or_kill(procs)
        import shutil
        shutil.rmtree(shm, ignore_errors=True)
    for rank in (0, 1):  # no tier 0 on the new node: stopped, not started over
        text = results[(rank, False)]
        assert text.startswith("refused:") and "the newest some rank holds is step 2" in text, results
        assert "shared tier" in text, results
    assert "this rank's newest is none" in results[(1, False)], results
    assert list((tmp_path / "nodeA").glob("step_*2/COMMIT")), "the checkpoint is gone"
    # With a tier 0 there: both parts sent to rank 1, both ranks on step 2, the saved state exactly.
    assert results[(0, True)] == "restored step 2, from memory, same digest", results
    assert results[(1, True)] == "restored step 2, from memory, same digest", results
    for rank in (0, 1):  # the unused head's two parameters have none, as when it was saved
        assert results[(rank, "plain")] == "restored step 2, from local, same parameters, optimizer state of 4 of 6", \
            results
    events = "".join(p.read_text() for p in (tmp_path / "events").glob("*"))
    assert '"event": "ckpt_parts_received"' in events and '"parts": 2' in events, events[-2000:]
