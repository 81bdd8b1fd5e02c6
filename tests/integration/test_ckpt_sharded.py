"""Sharded (DTensor) checkpoints through the Checkpointer: save on a 2-D mesh, restore resharded.

Real processes (torch.multiprocessing), real gloo groups, real files. Four ranks on two simulated
nodes (ranks 0-1 write tier-1 dir A, ranks 2-3 dir B) save a 2-D (dp 2 x tp 2) state and upload it
to a shared tier; then node B's tier-1 dir is deleted and
- 3 ranks on a 1-D mesh restore it (the pieces of ranks 2-3 come from tier 2),
- 2 ranks on a TP-only mesh restore it, and a template of another global shape is refused,
- one process with no process group restores it into a plain (unsharded) state;
- crafted input: a piece missing from every tier, and overlapping pieces, are skipped in favour of
  the older step, with messages that name the tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt import CheckpointConfig, Checkpointer, ShardMismatchError, SharedConfig

pytestmark = pytest.mark.timeout(240)

RUN = "sharded-test"
SHAPES = {"w": (10, 6), "bias": (7,), "rep": (3, 3), "emb": (8, 4), "qkv": (12, 4)}


def _full(name: str, step: int) -> torch.Tensor:
    shape = SHAPES[name]
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32).reshape(shape) + 1000 * step + 100 * len(name))


def _config(local: Path, shared: Path | None) -> CheckpointConfig:
    return CheckpointConfig(
        local_dir=str(local), run_name=RUN, shared=None if shared is None else SharedConfig(url=shared.as_uri())
    )


def _state(step: int, mesh: Any, placements: dict[str, Any], rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    model = {}
    for name in SHAPES:  # a placement entry is a list, or (sub-mesh, list)
        on, where = placements[name] if isinstance(placements[name], tuple) else (mesh, placements[name])
        model[name] = distribute_tensor(_full(name, step), on, where)
    return {"model": model, "optim": {"step": torch.tensor(float(step))}, "rng": torch.full((4,), rank),
            "extras": {"rank": rank, "step": step}}


def _run(world: int, fn: Callable[..., None], *args: Any) -> None:
    # forkserver: torch is imported once by the server, not by every worker (that takes a loaded
    # 2-core machine ~10 s per process); the workers still are fresh processes of their own.
    mp.set_forkserver_preload(["torch", "torch.distributed.tensor", "ckpt", __name__])
    mp.start_processes(fn, args=(world, *args), nprocs=world, join=True, start_method="forkserver")


def _init(rank: int, world: int, work: Path, tag: str) -> None:
    os.environ["TORCHELASTIC_RUN_ID"] = f"{tag}-{work.name}"  # the ranks sharing a tier-1 dir: one job
    dist.init_process_group("gloo", init_method=(work / f"init-{tag}").as_uri(), rank=rank, world_size=world)


def _save_worker(rank: int, world: int, work: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    _init(rank, world, work, "save")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = {"w": [Shard(0), Shard(1)], "bias": [Shard(0), Replicate()], "rep": [Replicate(), Replicate()],
                  "emb": (mesh["dp"], [Shard(0)]),  # FSDP's embeddings and norms: on the dp sub-mesh
                  "qkv": [_StridedShard(0, split_factor=2), Shard(0)]}  # FSDP over TP on one dim
    node = "A" if rank < 2 else "B"
    with Checkpointer(_config(work / node, work / "shared"), rank=rank, world_size=world, local_world_size=2) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step, mesh, placements, rank))
        ckpt.wait_uploaded()
    dist.destroy_process_group()


def _restore_worker(rank: int, world: int, work: Path) -> None:
    """Three ranks restore on a 1-D FSDP mesh; then ranks 0-1 restore on a TP-only mesh of two."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    _init(rank, world, work, "restore")
    fsdp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    _check_restore(rank, world, work, fsdp, {"w": [Shard(0)], "bias": [Shard(0)], "rep": [Replicate()],
                                             "emb": [Shard(0)], "qkv": [Shard(0)]})
    tp = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))  # every rank builds it; rank 2 is not in it
    if rank < 2:
        _check_restore(rank, 2, work, tp, {"w": [Shard(1)], "bias": [Replicate()], "rep": [Shard(0)],
                                           "emb": [Replicate()], "qkv": [Shard(1)]})
    dist.barrier()
    dist.destroy_process_group()


def _check_restore(rank: int, world: int, work: Path, mesh: Any, placements: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    template = _state(0, mesh, placements, rank)
    with Checkpointer(_config(work / "A", work / "shared"), rank=rank, world_size=world,
                      local_world_size=world) as ckpt:
        restored = ckpt.restore(into=template)
        assert restored is not None and restored.step == 2, restored
        for name in SHAPES:
            got = restored.state["model"][name]
            assert isinstance(got, DTensor) and got.placements == tuple(placements[name]), (name, got)
            expected = distribute_tensor(_full(name, 2), mesh, placements[name]).to_local()
            assert torch.equal(got.to_local(), expected), (mesh, rank, name)
        # the non-sharded leaves are this rank's own part (rank 2's from tier 2: its node is gone)
        assert restored.state["extras"] == {"rank": rank, "step": 2}
        assert torch.equal(restored.state["rng"], torch.full((4,), rank))
        wrong = {"model": {"w": distribute_tensor(torch.zeros(11, 6), mesh, [Shard(0)])}}
        with pytest.raises(ShardMismatchError, match=r"'model/w'.*\[10, 6\].*\[11, 6\]"):
            ckpt.restore(into=wrong)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("sharded")
    _run(4, _save_worker, work)
    shutil.rmtree(work / "B")  # node B is lost: its ranks' pieces live on in tier 2 only
    return work


def _manifest(work: Path, step: int, rank: int) -> dict[str, Any]:
    path = work / "shared" / RUN / f"step_{step:012d}" / f"rank_{rank:05d}" / "manifest.json"
    return dict(json.loads(path.read_text()))


def test_replicated_pieces_are_written_once_and_shards_describe_their_box(saved: Path) -> None:
    pieces = {r: _manifest(saved, 2, r)["shards"] for r in range(4)}
    assert [("piece" in pieces[r]["model/rep"]) for r in range(4)] == [True, False, False, False]
    assert [("piece" in pieces[r]["model/bias"]) for r in range(4)] == [True, False, True, False]
    assert [("piece" in pieces[r]["model/emb"]) for r in range(4)] == [True, False, True, False]  # sub-mesh
    assert [pieces[r]["model/qkv"]["piece"]["offsets"] for r in range(4)] == [[0, 0], [6, 0], [3, 0], [9, 0]]
    assert pieces[3]["model/w"]["piece"] == {"offsets": [5, 3], "sizes": [5, 3]}
    assert pieces[3]["model/w"]["global_shape"] == [10, 6] and pieces[3]["model/w"]["mesh_shape"] == [2, 2]


def _box_worker(rank: int, world: int, work: Path) -> None:
    """The box each rank describes (ckpt.sharding.split_sharded) on a flattened sub-mesh, and after an in-process
    re-formation that swapped the ranks (FSDP2's parameters then carry a mesh object with the old coordinate)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpt.sharding import split_sharded

    def piece(tensor: Any) -> Any:
        found = split_sharded({"w": tensor})[1]["w"].piece
        return found and [list(found.offsets), list(found.sizes)]

    _init(rank, world, work, "box-1")
    # torchtitan's FSDP + context parallel: FSDP over ("dp_shard", "cp") flattened; its name is no guide
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    seen = {"flat": piece(distribute_tensor(torch.zeros(4, 2), flat, [Shard(0)]))}
    layer = torch.nn.Linear(2, 4)
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    seen["first"] = piece(layer.weight)
    dist.destroy_process_group()
    _init(world - 1 - rank, world, work, "box-2")  # the same process, the other rank
    layer = torch.nn.Linear(2, 4)
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    seen["swapped"] = piece(layer.weight)
    dist.destroy_process_group()
    (work / f"boxes-{rank}.json").write_text(json.dumps(seen))


def test_every_rank_describes_the_box_it_holds_on_a_flattened_mesh_and_after_a_rank_change(tmp_path: Path) -> None:
    _run(2, _box_worker, tmp_path)
    seen = {r: json.loads((tmp_path / f"boxes-{r}.json").read_text()) for r in range(2)}
    # Before: only the rank at coordinate 0 of "dp_shard" wrote (the other piece was missing from every save), and
    # after the swap each rank described the other's rows (a restore put them in the wrong place).
    for rank in range(2):
        assert seen[rank]["flat"] == [[2 * rank, 0], [2, 2]], seen
        assert seen[rank]["first"] == [[2 * rank, 0], [2, 2]], seen
        assert seen[rank]["swapped"] == [[2 * (1 - rank), 0], [2, 2]], seen


def test_restore_reshards_into_another_layout(saved: Path) -> None:
    _run(3, _restore_worker, saved)


def test_restore_into_a_plain_state_gives_the_global_tensors(saved: Path, tmp_path: Path) -> None:
    with Checkpointer(_config(tmp_path / "plain", saved / "shared"), rank=0, world_size=1) as ckpt:
        restored = ckpt.restore()
    assert restored is not None and restored.step == 2 and restored.tier == "shared"
    for name in SHAPES:
        assert torch.equal(restored.state["model"][name], _full(name, 2)), name
    assert restored.bytes_read > 0


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved / "shared", tmp_path / "shared")
    return tmp_path / "shared"


def _rewrite_manifest(shared: Path, step: int, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest and re-sign it in the COMMIT, as a crafted checkpoint would."""
    step_dir = shared / RUN / f"step_{step:012d}"
    path = step_dir / f"rank_{rank:05d}" / "manifest.json"
    obj = json.loads(path.read_text())
    edit(obj)
    data = json.dumps(obj, separators=(",", ":")).encode()
    path.write_bytes(data)
    commit = json.loads((step_dir / "COMMIT").read_text())
    commit["manifests"][str(rank)] = hashlib.sha256(data).hexdigest()
    (step_dir / "COMMIT").write_text(json.dumps(commit))


def test_a_piece_missing_from_every_tier_falls_back_naming_the_tensor(
    saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = _copy(saved, tmp_path)
    shutil.rmtree(shared / RUN / f"step_{2:012d}" / f"rank_{3:05d}")
    with caplog.at_level(logging.WARNING), Checkpointer(_config(tmp_path / "l", shared), rank=0, world_size=1) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["model"]["w"], _full("w", 1))
    text = caplog.text
    assert "skipping checkpoint step 2" in text and "'model/w'" in text and "box [0:10, 0:6]" in text
    assert "searched tiers shared (" in text and "rank 3: shared:" in text and "manifest is missing" in text


def test_overlapping_pieces_are_refused(saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = _copy(saved, tmp_path)

    def overlap(obj: dict[str, Any]) -> None:
        obj["shards"]["model/w"]["piece"]["offsets"] = [0, 0]  # rank 1's piece moved onto rank 0's

    _rewrite_manifest(shared, 2, 1, overlap)
    with caplog.at_level(logging.WARNING), Checkpointer(_config(tmp_path / "l", shared), rank=0, world_size=1) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1
    assert "skipping checkpoint step 2" in caplog.text and "overlap at [0:5, 0:3]" in caplog.text


def test_a_damaged_piece_in_tier_1_is_read_from_tier_2(
    saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = _copy(saved, tmp_path)
    local = tmp_path / "A"
    shutil.copytree(saved / "A", local)
    data = local / f"step_{2:012d}" / f"rank_{1:05d}" / "state.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last byte lies in rank 1's piece of some tensor
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING), Checkpointer(_config(local, shared), rank=0, world_size=1) as ckpt:
        restored = ckpt.restore()
    assert restored is not None and restored.step == 2 and restored.tier == "local"
    for name in SHAPES:
        assert torch.equal(restored.state["model"][name], _full(name, 2)), name
    assert "does not match its sha256 digest" in caplog.text and str(data) in caplog.text
