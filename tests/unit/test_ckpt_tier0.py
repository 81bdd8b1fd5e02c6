"""Tier 0 (ckpt/tier0.py) against real files in tmpfs: snapshots every step in two slots per rank,
restored first, verified; torn, damaged and other runs' slots never used."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer, CheckpointWriteError
from ckpt.identity import RunIdentity
from ckpt.tier0 import HostMemoryError, HostSlots

pytestmark = pytest.mark.timeout(60)


def make(tmp_path: Path, shm: Path, *, run_name: str = "default", local: str = "ckpt") -> Checkpointer:
    return Checkpointer(CheckpointConfig(local_dir=tmp_path / local, tier0_dir=shm, run_name=run_name),
                        rank=0, world_size=1)


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 70, generator=g), "h": torch.randn(33, generator=g).half(), "step": step,
            "rng": torch.get_rng_state()}


def train(ck: Checkpointer, steps: range, *, persist_every: int) -> None:
    for step in steps:
        pending = ck.save_async(step, state(step)) if step % persist_every == 0 else ck.snapshot(step, state(step))
        pending.wait_persisted()
        assert not pending.skipped, pending.metrics.error


def slot_of(shm: Path, step: int) -> Path:
    for manifest in shm.glob("rank_00000/slot_*/manifest.json"):
        if json.loads(manifest.read_text())["step"] == step:
            return manifest.parent
    raise AssertionError(f"no tier-0 slot holds step {step}")


def damage(slot: Path) -> None:
    with open(slot / "state.safetensors", "r+b") as f:
        f.seek(os.path.getsize(slot / "state.safetensors") // 2)
        f.write(b"\xa5" * 64)


def test_a_new_process_restores_the_newest_snapshot_from_memory_bitwise(tmp_path: Path, shm: Path) -> None:
    with make(tmp_path, shm) as ck:
        train(ck, range(1, 8), persist_every=5)
        assert ck.committed_steps() == [5]  # only the persisted step went to disk
    with make(tmp_path, shm) as again:  # the worker's replacement: same node, same tier-0 directory
        restored = again.restore()
        assert restored is not None and (restored.step, restored.tier) == (7, "memory")
        assert torch.equal(restored.state["w"], state(7)["w"]) and torch.equal(restored.state["h"], state(7)["h"])
        assert torch.equal(restored.state["rng"], state(7)["rng"])
        # Copied out of the slot: the next snapshots rewrite the slots, not the restored tensors.
        train(again, range(8, 10), persist_every=5)
        assert torch.equal(restored.state["w"], state(7)["w"])


def test_a_damaged_snapshot_is_rejected_naming_its_file_and_the_previous_one_is_used(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with make(tmp_path, shm) as ck:
        train(ck, range(1, 8), persist_every=5)
    damage(slot_of(shm, 7))
    with make(tmp_path, shm) as again, caplog.at_level(logging.WARNING):
        restored = again.restore()
        assert restored is not None and (restored.step, restored.tier) == (6, "memory")
        assert torch.equal(restored.state["w"], state(6)["w"])
    assert any(str(slot_of(shm, 7) / "state.safetensors") in r.getMessage() for r in caplog.records), caplog.text
    damage(slot_of(shm, 6))
    with make(tmp_path, shm) as third:
        restored = third.restore()  # both slots damaged: tier 1's step 5
        assert restored is not None and (restored.step, restored.tier) == (5, "local")
        assert torch.equal(restored.state["w"], state(5)["w"])


def test_a_torn_snapshot_is_never_used(tmp_path: Path, shm: Path) -> None:
    with make(tmp_path, shm) as ck:
        train(ck, range(1, 8), persist_every=5)
    torn = slot_of(shm, 7)
    (torn / "manifest.json").unlink()  # what a crash mid-copy leaves: the manifest goes before the copy starts
    damage(torn)
    with make(tmp_path, shm) as again:
        restored = again.restore()
        assert restored is not None and (restored.step, restored.tier) == (6, "memory")
        assert torch.equal(restored.state["w"], state(6)["w"])


def test_another_runs_snapshots_are_ignored(tmp_path: Path, shm: Path) -> None:
    with make(tmp_path, shm, run_name="a", local="a") as ck:
        train(ck, range(1, 4), persist_every=10)
    with make(tmp_path, shm, run_name="b", local="b") as other:
        assert other.restore() is None


def test_restoring_an_older_step_drops_the_newer_snapshots_at_the_next_save(tmp_path: Path, shm: Path) -> None:
    with make(tmp_path, shm) as ck:
        train(ck, range(1, 8), persist_every=5)
        restored = ck.restore(max_step=5)  # e.g. the other ranks only had step 5
        assert restored is not None and restored.step == 5
        train(ck, range(6, 7), persist_every=5)  # the future (steps 6, 7) is gone: the slots hold 6 and nothing
    with make(tmp_path, shm) as again:
        assert again.available_steps() == [6, 5]


def test_both_slots_in_use_skip_a_snapshot_instead_of_waiting(shm: Path) -> None:
    slots = HostSlots(shm, 0, RunIdentity("default", "uid"))
    first = slots.claim(1)
    assert first is not None
    slots.published(first, 1, b"{}")
    second = slots.claim(2)  # the only slot that is not the newest
    assert second is not None and second is not first
    assert slots.claim(3) is None  # the newest (1) is kept, the other is still being written
    slots.release(second)
    assert slots.claim(3) is second


@pytest.mark.parametrize("count", [2, 3])
def test_a_third_slot_keeps_snapshots_going_while_a_tier1_write_reads_one(shm: Path, count: int) -> None:
    slots = HostSlots(shm, 0, RunIdentity("default", "uid"), count)
    persisted = slots.claim(10)  # a tier-1 save: its slot is read by the write to disk for a while
    assert persisted is not None
    slots.published(persisted, 10, b"{}")
    snapshot = slots.claim(11)
    assert snapshot is not None
    slots.published(snapshot, 11, b"{}")
    slots.release(snapshot)
    during = slots.claim(12)  # the write still reads step 10's slot; step 11's is the newest
    if count == 2:
        assert during is None  # skipped: a worker killed now loses 2 steps
        return
    assert during is not None and during not in (persisted, snapshot)
    slots.published(during, 12, b"{}")
    slots.release(during)
    after = slots.claim(13)
    assert after is snapshot  # the oldest free one, never the newest nor the one being written to disk


def test_fewer_slots_than_a_predecessor_had_drop_the_extra_ones(shm: Path) -> None:
    identity = RunIdentity("default", "uid")
    three = HostSlots(shm, 0, identity, 3)
    for step in (1, 2, 3):
        slot = three.claim(step)
        assert slot is not None
        slot.buffer(b"", 64, pin=False, room=0)
        three.published(slot, step, b"{}")
        three.release(slot)
    three.close()
    assert len(list(shm.glob("rank_00000/slot_*"))) == 3
    HostSlots(shm, 0, identity, 2).close()  # slot_2 is never written again: a restore must not find it
    assert sorted(p.name for p in shm.glob("rank_00000/slot_*")) == ["slot_0", "slot_1"]


def test_a_tier0_dir_that_is_a_file_is_refused_naming_the_setting(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointWriteError, match=f"tier0_dir {afile} .* not a directory"):
        Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=afile), rank=0, world_size=1)
    Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt"), rank=0, world_size=1).close()  # nothing held


def test_tier0_slots_below_two_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tier0_slots must be an int >= 2"):
        CheckpointConfig(local_dir=tmp_path, tier0_slots=1)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (a container's small /dev/shm), unmounted afterwards."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield small
    finally:
        if subprocess.run(["umount", str(small)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(small)], capture_output=True)  # a mapping still open: detach it


def test_a_tier0_dir_too_small_is_a_clear_error_at_start(tmp_path: Path, small_tmpfs: Path) -> None:
    with make(tmp_path, small_tmpfs) as ck:  # asked for: CheckpointConfig.tier0_dir
        big = {"w": torch.zeros(1 << 19)}  # 2 MiB: one slot does not fit
        with pytest.raises(HostMemoryError, match=r"tier 0 does not fit in .*small.*tier0_dir=\"\""):
            ck.prepare(big)  # Resumable prepares right after its restore, before the loop
        ck.save(2, {"w": torch.zeros(16)})  # small enough: saving goes on


def test_the_agents_tier0_too_small_falls_back_to_disk_with_a_warning(
    tmp_path: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ELASTIC_TIER0_DIR", str(small_tmpfs))  # what elastic-run's agent hands its workers
    big = {"w": torch.arange(1 << 19, dtype=torch.float32)}
    with Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt"), rank=0, world_size=1) as ck:
        assert ck.has_tier0
        with caplog.at_level(logging.WARNING):
            ck.prepare(big)
        assert "Going on without tier 0" in caplog.text and str(small_tmpfs) in caplog.text
        ck.save(5, big)  # a job that ran before tier 0 existed runs on
        assert ck.snapshot(6, big).skipped
        restored = ck.restore()
        assert restored is not None and (restored.step, restored.tier) == (5, "local")
        assert torch.equal(restored.state["w"], big["w"])


def test_a_step_counts_only_once_every_rank_of_the_node_holds_it(tmp_path: Path, shm: Path) -> None:
    # Rank 0 was killed before its snapshot of step 5 was whole; rank 1's is. Rank 0 must not resume from
    # rank 1's copy of step 5 (another rank's RNG streams): the node resumes from step 4, each rank its own.
    ranks = [Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm), rank=r, world_size=2,
                          local_world_size=2) for r in (0, 1)]
    try:
        for step in (3, 4):
            for ck in ranks:
                ck.snapshot(step, state(step)).wait_persisted()
        ranks[1].snapshot(5, state(5)).wait_persisted()
        for ck in ranks:
            restored = ck.restore()
            assert restored is not None and (restored.step, restored.tier, restored.own) == (4, "memory", True)
    finally:
        for ck in ranks:
            ck.close()


def test_a_snapshot_whose_copy_fails_gives_its_slot_back(tmp_path: Path, shm: Path) -> None:
    # A tensor resized in place no longer fits the slot planned for it: the copy raises to the caller (staged
    # mode copies in the call). The slot it had claimed is free again, so later snapshots go on.
    with make(tmp_path, shm) as ck:
        first = state(1)
        ck.snapshot(1, first).wait_persisted()
        w = first["w"]
        assert isinstance(w, torch.Tensor)
        saved = w.clone()
        w.resize_(7)
        with pytest.raises(RuntimeError):
            ck.snapshot(2, first)
        w.resize_(300, 70).copy_(saved)
        for step in (3, 4):
            pending = ck.snapshot(step, {**first, "step": step})
            pending.wait_persisted()
            assert not pending.skipped, pending.metrics.error
        restored = ck.restore()
        assert restored is not None and (restored.step, restored.tier) == (4, "memory")
        assert torch.equal(restored.state["w"], saved)


def test_what_someone_left_in_tier0_is_not_written_through_and_stops_neither_snapshots_nor_restores(
        tmp_path: Path, shm: Path) -> None:
    with make(tmp_path, shm) as ck:
        train(ck, range(1, 3), persist_every=10)
    # A link in place of a slot's data file (it was written through, to a file outside tier 0), a file in place
    # of the other slot's directory (its slot stayed busy: tier 0 off for the run), a symlink loop beside the
    # rank's slots and one in place of another rank's directory (the restore raised ELOOP, no fallback).
    outside = tmp_path / "precious"
    outside.write_bytes(b"precious" * 4096)
    data = slot_of(shm, 1) / "state.safetensors"
    data.unlink()
    data.symlink_to(outside)
    other = slot_of(shm, 2)
    for entry in other.iterdir():
        entry.unlink()
    other.rmdir()
    other.write_bytes(b"x")
    (shm / "rank_00000" / "slot_9").symlink_to(shm / "rank_00000" / "slot_9")
    (shm / "rank_00001").symlink_to(shm / "rank_00001")
    with make(tmp_path, shm) as ck:
        assert ck.restore() is None  # neither slot holds a snapshot now (tier 1 has none either)
        train(ck, range(3, 6), persist_every=10)
        restored = ck.restore()
        assert restored is not None and (restored.step, restored.tier) == (5, "memory")
    assert outside.read_bytes() == b"precious" * 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshots_copy_into_page_locked_slots_overlapped_and_restore_exactly(tmp_path: Path, shm: Path) -> None:
    config = CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm, mode="overlapped")
    w = torch.randn(1 << 22, device="cuda")
    with Checkpointer(config, rank=0, world_size=1) as ck:
        for step in range(1, 4):
            w.add_(1.0)  # queued before the snapshot: must be in it
            pending = ck.snapshot(step, {"w": w})
            ck.wait_staged()
            expected = w.cpu()
            w.mul_(2.0)  # after wait_staged: must not reach the snapshot
            pending.wait_persisted()
            w.div_(2.0)
        assert all(s._pinned for s in ck._writer.tier0.slots)  # type: ignore[union-attr]
    with Checkpointer(config, rank=0, world_size=1) as again:
        restored = again.restore()
        assert restored is not None and (restored.step, restored.tier) == (3, "memory")
        assert torch.equal(restored.state["w"], expected)


def test_when_the_layout_grows_after_prepare_the_other_slot_is_mapped_in_that_save_not_in_the_next(
        tmp_path: Path, shm: Path) -> None:
    # Resumable prepares before the loop, when the optimizer has no state yet; its first save brings a larger
    # layout. The slot that save takes is mapped for it in the save, and so is the other one (pinning it later,
    # even from another thread, held up a step of the loop on one H200): no later save maps a whole slot.
    with make(tmp_path, shm) as ck:
        ck.prepare({"w": torch.zeros(300, 70)})
        sizes = {len(s.view()) for s in ck._writer.tier0.slots}
        full = state(1)
        ck.snapshot(1, full)
        grown = {len(s.view()) for s in ck._writer.tier0.slots}  # before the snapshot's own thread finished
        assert ck._writer.tier0_thread.wait_idle(30)
        assert len(grown) == 1 and grown != sizes, (sizes, grown)
        assert slot_of(shm, 1)  # the save's own snapshot is whole and still the newest
        ck.snapshot(2, state(2)).wait_persisted()
        restored = ck.restore()
        assert restored is not None and restored.step == 2 and torch.equal(restored.state["w"], state(2)["w"])


def test_slots_a_warm_spare_mapped_ahead_are_what_the_restarted_worker_uses(tmp_path: Path, shm: Path) -> None:
    # A warm spare (elastic/spare.py) maps the node's slot files before it becomes a worker; the worker's
    # slots take those mappings when file and size are unchanged, map anew when not, and restore bitwise.
    from core import premap

    with make(tmp_path, shm) as ck:
        train(ck, range(1, 4), persist_every=10)
    other = shm / "rank_00007" / "slot_0"  # another rank's slot, once on this node
    other.mkdir(parents=True)
    (other / "state.safetensors").write_bytes(bytes(4096))
    assert premap.add(shm, pin=False) == sum(p.stat().st_size for p in shm.glob("rank_*/slot_*/state.*"))
    premapped = dict(premap._maps)
    assert len(premapped) == 3
    with make(tmp_path, shm) as again:
        assert str(other / "state.safetensors") not in premap.held()  # dropped: not this rank's
        restored = again.restore()
        assert restored is not None and restored.step == 3 and torch.equal(restored.state["w"], state(3)["w"])
        train(again, range(4, 6), persist_every=10)
        adopted = [s._map for s in again._writer.tier0.slots]
        assert all(any(m is entry[2] for entry in premapped.values()) for m in adopted), "mapped anew"
        assert not premap.held()
    with make(tmp_path, shm) as third:
        assert third.restore().step == 5  # type: ignore[union-attr]
    # A file resized since it was mapped ahead is mapped anew, not through the stale mapping.
    assert premap.add(shm, pin=False) > 0
    with make(tmp_path, shm) as grown:
        bigger = {"w": torch.randn(600, 70), "step": 6}
        grown.snapshot(6, bigger).wait_persisted()
        grown.snapshot(7, bigger).wait_persisted()
        assert grown._writer.tier0_thread.wait_idle(30)
        restored = grown.restore()
        assert restored is not None and restored.step == 7 and torch.equal(restored.state["w"], bigger["w"])
    assert not premap.held()


@pytest.mark.timeout(60)
def test_a_spare_warm_before_the_slots_exist_maps_them_once_the_worker_makes_them(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The node's warm spare warms up with a job's first workers (elastic/prestart.py), before any slot exists: its
    # mapper keeps looking, maps the slots the worker then makes, tells it in an event, and stops when asked.
    from core import premap
    from core.events import EVENTS_DIR_ENV
    from elastic.spare_process import SlotMapper

    monkeypatch.setenv(EVENTS_DIR_ENV, str(tmp_path / "events"))
    mapper = SlotMapper(shm, pin=False, interval_s=0.05).start()
    try:
        with make(tmp_path, shm) as ck:
            train(ck, range(1, 4), persist_every=10)
        slots = sorted(str(p) for p in shm.glob("rank_*/slot_*/state.*"))
        deadline = time.monotonic() + 30
        while premap.held() != slots and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        mapper.stop()
    assert len(slots) >= 2 and premap.held() == slots
    events = [json.loads(line) for f in (tmp_path / "events").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert sum(e["bytes"] for e in events if e["event"] == "spare_premapped") == sum(
        os.path.getsize(p) for p in slots)
    with make(tmp_path, shm) as again:  # the worker it becomes restores through those mappings
        restored = again.restore()
        assert restored is not None and restored.step == 3 and torch.equal(restored.state["w"], state(3)["w"])
        train(again, range(4, 5), persist_every=10)
        assert not premap.held()


def test_a_peers_replicas_do_not_stand_in_for_a_rank_of_this_node(tmp_path: Path, shm: Path) -> None:
    # Ranks 0 and 1 run here, 2 and 3 on a peer whose replicas this node holds (tier0/peers/). Rank 0 was killed
    # before its snapshot of step 5 was whole: step 5 has three pieces here (rank 1's and the two replicas), but not
    # this node's two. Counted with the replicas, rank 0 resumed from another rank's copy of step 5 (its RNG
    # streams); the node resumes from step 4, each rank its own.
    peer_shm = tmp_path / "peer-shm"
    ranks = [Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm), rank=r, world_size=4,
                          local_world_size=2) for r in (0, 1)]
    peers = [Checkpointer(CheckpointConfig(local_dir=tmp_path / "peer-ckpt", tier0_dir=peer_shm), rank=r,
                          world_size=4, local_world_size=2) for r in (2, 3)]
    try:
        for step in (3, 4):
            for ck in ranks + peers:
                ck.snapshot(step, state(step)).wait_persisted()
        for ck in (ranks[1], *peers):
            ck.snapshot(5, state(5)).wait_persisted()
        for rank_dir in peer_shm.glob("rank_*"):
            shutil.copytree(rank_dir, shm / "peers" / "node-b" / rank_dir.name)
        for ck in ranks:
            restored = ck.restore()
            assert restored is not None and (restored.step, restored.tier, restored.own) == (4, "memory", True)
    finally:
        for ck in ranks + peers:
            ck.close()
