"""The node's checkpoint helper (ckpt/helper.py, ckpt/helper_process.py) as a real process on a real
Unix socket, with a real tier 0 in tmpfs: it publishes the worker's snapshots; when it dies, hangs or
comes back, snapshots go on and a restore gets the newest whole step, never a manifest over another
step's bytes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointConfig, Checkpointer, SharedConfig
from ckpt.checksum import CHUNK_BYTES, Checksum, digest_parts, sum64_checksum
from ckpt.helper import HelperClient, socket_path
from ckpt.helper_process import NICE
from ckpt.layout import STATE_FILE
from ckpt.snapshot import HostSnapshot
from ckpt.tier0 import SlotLock
from tests import s3_fixtures
from tests.conftest import REPO
from tests.s3_fixtures import MotoS3

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

moto_s3 = s3_fixtures.moto_s3


class HelperProcess:
    def __init__(self, tier0: Path, log: Path) -> None:
        self.log = log
        self.socket = socket_path(tier0)
        self.socket.unlink(missing_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckpt.helper_process", "--socket", str(self.socket),
                 "--parent", str(os.getpid())], cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            assert self.proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the helper did not listen within 60 s"
            time.sleep(0.05)

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text():
            assert time.monotonic() < deadline, f"{text!r} not in the helper's log: {self.log.read_text()}"
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> None:
        """SIGSTOP it and wait until every thread of it is stopped: the signal only takes effect once one of its
        threads runs, and on a loaded machine a thread woken by a request (niced, as the helper is) can answer
        it first (seen: steps published after kill() returned)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(_stopped(stat) for stat in Path(f"/proc/{self.proc.pid}/task").glob("*/stat")):
            assert time.monotonic() < deadline, f"the helper (pid {self.proc.pid}) did not stop within {timeout} s"
            time.sleep(0.01)

    def end(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


def _stopped(stat: Path) -> bool:
    """Whether the thread of /proc/<pid>/task/<tid>/stat is stopped (state T), or gone."""
    try:
        return stat.read_text().rpartition(")")[2].split()[0] == "T"
    except FileNotFoundError:
        return True


@pytest.fixture
def helpers(shm: Path, tmp_path: Path) -> Iterator[list[HelperProcess]]:
    started: list[HelperProcess] = []
    try:
        yield started
    finally:
        for h in started:
            h.end()


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.arange(step, step + 9), "step": step}


def make(tmp_path: Path, shm: Path, *, helper_timeout: float = 30.0) -> Checkpointer:
    ck = Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm), rank=0, world_size=1)
    assert len(ck._writer.helpers) == 2  # the writer thread's and the tier-0 thread's connections
    for helper in ck._writer.helpers:
        helper.timeout = helper_timeout  # before its first connection
    return ck


def published(ck: Checkpointer) -> int:
    return sum(h.published for h in ck._writer.helpers)


def snapshot(ck: Checkpointer, step: int) -> None:
    pending = ck.snapshot(step, state(step))
    pending.wait_persisted()
    assert not pending.skipped, pending.metrics.error
    # Done, and its thread idle too (it is marked idle just after the save's events): the next snapshot is
    # not skipped as "still being checksummed" on a loaded machine.
    assert ck._writer.tier0_thread.wait_idle(60)


def restored(tmp_path: Path, shm: Path) -> tuple[int, str]:
    """The step and tier a fresh checkpointer restores; its tensors must be that step's."""
    ck = Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm, tier0_helper=False),
                      rank=0, world_size=1)
    try:
        found = ck.restore()
        assert found is not None
        expected = state(found.step)
        assert torch.equal(found.state["w"], expected["w"]) and torch.equal(found.state["b"], expected["b"])
        return found.step, found.tier
    finally:
        ck.close()


def manifest_steps(shm: Path) -> list[int]:
    return sorted(json.loads(p.read_text())["step"] for p in shm.glob("rank_00000/slot_*/manifest.json"))


def test_the_helper_publishes_snapshots_and_a_restore_reads_them_bitwise(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess]
) -> None:
    helpers.append(HelperProcess(shm, tmp_path / "helper.log"))
    # It runs below the training processes' CPU priority: its checksums take the cores they leave.
    assert os.getpriority(os.PRIO_PROCESS, helpers[0].proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + NICE
    # Its start-up objects (torch's among them) are out of the cyclic collector's reach: a full collection over
    # them held a snapshot's publish, and step_done with it, 20-56 ms once a run on one H200 host.
    helpers[0].wait_for_log("objects of the start-up frozen")
    frozen = re.search(r"\((\d+) objects of the start-up frozen\)", helpers[0].log.read_text())
    assert frozen is not None and int(frozen.group(1)) > 50_000, helpers[0].log.read_text()
    ck = make(tmp_path, shm)
    ck.prepare(state(1))  # both slots mapped by the helper too, before the loop: it must still see what is written
    assert ck._writer.thread.wait_idle(60)  # (the writer thread asks for that, not holding up a restore)
    assert sum(h.mapped for h in ck._writer.helpers) == 2
    for step in range(1, 5):
        snapshot(ck, step)
        if step == 2:  # a terminal's Ctrl-C reaches the agent's whole process group, the helper too: its agent
            os.kill(helpers[0].proc.pid, signal.SIGINT)  # decides (it stops the helper), so the helper serves on
    assert published(ck) == 4
    ck.close()
    assert manifest_steps(shm) == [3, 4]
    assert restored(tmp_path, shm) == (4, "memory")
    assert helpers[0].proc.poll() is None and "Traceback" not in helpers[0].log.read_text()


def test_a_bad_request_is_answered_with_an_error_and_the_helper_serves_on(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess]
) -> None:
    from core.frames import recv_frame, send_frame

    helpers.append(HelperProcess(shm, tmp_path / "helper.log"))
    fifo = shm / "rank_00005" / "slot_0"
    fifo.mkdir(parents=True)
    os.mkfifo(fifo / STATE_FILE)

    def call(header: dict[str, object], raw: bytes | None = None) -> dict[str, object] | None:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(20)
            sock.connect(str(helpers[0].socket))
            if raw is not None:
                sock.sendall(raw)
            else:
                send_frame(sock, header)
            try:
                return recv_frame(sock)[0]
            except OSError:
                return None  # the helper closed the connection: fine, it is not the one waiting

    # A FIFO in place of a slot's data file: its open blocked with the mappings' lock held, and every worker's
    # map and publish after it waited on that lock for good.
    for size in (0, 100):
        reply = call({"op": "map", "path": str(fifo), "size": size})
        assert reply is not None and reply["ok"] is False, reply
    nested = b"[" * 100_000 + b"]" * 100_000  # its thread died of RecursionError
    assert call({}, struct.pack("!I", len(nested)) + nested + struct.pack("!I", 0)) is None
    ck = make(tmp_path, shm, helper_timeout=20)
    for step in (1, 2):
        snapshot(ck, step)
    assert published(ck) == 2
    ck.close()


def test_a_dead_helper_leaves_the_work_to_the_worker_and_a_new_one_takes_it_back(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(HelperClient, "RETRY_S", 0.0)
    helpers.append(HelperProcess(shm, tmp_path / "helper.log"))
    ck = make(tmp_path, shm)
    snapshot(ck, 1)
    helpers[0].proc.kill()
    helpers[0].proc.wait(30)
    snapshot(ck, 2)  # published by the worker itself
    assert published(ck) == 1
    assert restored(tmp_path, shm) == (2, "memory")
    helpers.append(HelperProcess(shm, tmp_path / "helper2.log"))
    snapshot(ck, 3)
    assert published(ck) == 2
    ck.close()
    assert restored(tmp_path, shm) == (3, "memory")


@pytest.mark.parametrize("by", ["helper", "worker"])
def test_a_checksum_summed_on_the_gpu_is_what_the_slot_is_verified_against(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess], monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    # A snapshot staged through the GPU's file image brings its checksum with it (ckpt/device_image.py; this CPU
    # machine stands in for the GPU's sums): the helper, or the worker without one, writes it into the slot's
    # manifest without reading the slot for it, and restore verifies the slot's bytes against it. Sums that do
    # not match the bytes (step 4) make the slot unusable; restore takes the previous snapshot.
    def gpu_sums(snapshot: HostSnapshot) -> Checksum:
        image = bytearray(snapshot.layout.prefix) + bytearray(snapshot.parts()[1])
        summed = digest_parts([memoryview(image)], algorithm="sum64", chunk_bytes=CHUNK_BYTES)
        if snapshot.tensors()["b"][0] == 4:  # step 4's
            return sum64_checksum([1] * (len(summed.chunks) // 8), CHUNK_BYTES)
        return summed

    monkeypatch.setattr(HostSnapshot, "checksum", gpu_sums)
    if by == "helper":
        helpers.append(HelperProcess(shm, tmp_path / "helper.log"))
    ck = make(tmp_path, shm)
    for step in (1, 2, 3, 4):
        snapshot(ck, step)
    assert published(ck) == (4 if by == "helper" else 0)
    ck.close()
    assert manifest_steps(shm) == [3, 4]
    assert restored(tmp_path, shm) == (3, "memory")


def test_a_helper_that_answers_too_late_never_writes_over_a_reused_slot(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess]
) -> None:
    helper = HelperProcess(shm, tmp_path / "helper.log")
    helpers.append(helper)
    ck = make(tmp_path, shm)
    snapshot(ck, 1)
    assert published(ck) == 1  # the helper answers (a loaded machine gets the default 30 s for it)
    for h in ck._writer.helpers:
        h.timeout = 1.0
    helper.stop()  # it gets the request of step 2 and does not answer
    snapshot(ck, 2)  # the worker gives up after 1 s and publishes step 2 itself
    snapshot(ck, 3)  # (the helper is not asked again for RETRY_S) into the other slot
    snapshot(ck, 4)  # into step 2's slot: its bytes are step 4's now
    os.kill(helper.proc.pid, signal.SIGCONT)
    helper.wait_for_log("the worker gave up on this request")  # it dropped step 2's manifest
    ck.close()
    assert manifest_steps(shm) == [3, 4]
    assert restored(tmp_path, shm) == (4, "memory")


def test_a_slot_the_helper_may_still_publish_is_not_reused_until_it_lets_go(tmp_path: Path, shm: Path) -> None:
    # No helper answers (none runs) while something holds step 1's slot lock, as a helper stopped inside a
    # publish would: the worker leaves that slot alone, the next snapshot is skipped (the other slot holds
    # the newest), and once the lock is free snapshots go on.
    ck = make(tmp_path, shm)
    snapshot(ck, 1)
    snapshot(ck, 2)
    slot_1 = next(p.parent for p in shm.glob("rank_00000/slot_*/manifest.json")
                     if json.loads(p.read_text())["step"] == 1)
    with SlotLock(slot_1 / "state.safetensors", wait=True):
        pending = ck.snapshot(3, state(3))  # goes into step 1's slot, finds it locked
        pending.wait_persisted()
        assert pending.skipped and "helper still holds" in str(pending.metrics.error)
        pending = ck.snapshot(4, state(4))  # the newest (2) and the held slot: none free
        pending.wait_persisted()
        assert pending.skipped
        assert restored(tmp_path, shm) == (2, "memory")
    snapshot(ck, 5)
    ck.close()
    assert restored(tmp_path, shm) == (5, "memory")


def step_dir(tmp_path: Path, step: int) -> Path:
    return tmp_path / "ckpt" / f"step_{step:012d}"


def test_the_helper_writes_and_commits_tier1_for_the_nodes_ranks(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess]
) -> None:
    # Two ranks of one node: each rank's tier-1 directory is written from its slot by the helper, and the
    # step is committed once both are there. Restored from tier 1 alone (tier 0 gone), bitwise.
    helpers.append(HelperProcess(shm, tmp_path / "helper.log"))
    cks = [Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm), rank=r, world_size=2,
                        local_world_size=2) for r in range(2)]
    for step in (1, 2, 3):  # a snapshot, then two persists
        for ck in cks:
            pending = ck.save_async(step, state(step)) if step > 1 else ck.snapshot(step, state(step))
            pending.wait_persisted()
            assert not pending.skipped, pending.metrics.error
    for ck in cks:
        assert ck._writer.helper is not None and ck._writer.helper.persisted == 2
        ck.close()
    for step in (2, 3):
        assert (step_dir(tmp_path, step) / "COMMIT").exists()
        assert sorted(p.name for p in step_dir(tmp_path, step).iterdir()) == ["COMMIT", "rank_00000", "rank_00001"]
    for rank_dir in shm.glob("rank_*"):
        shutil.rmtree(rank_dir)
    ck = Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm, tier0_helper=False),
                      rank=1, world_size=2, local_world_size=2)
    found = ck.restore()
    ck.close()
    assert found is not None and (found.step, found.tier) == (3, "local")
    assert torch.equal(found.state["w"], state(3)["w"])


def test_a_tier1_write_the_helper_does_not_finish_in_time_is_written_by_the_worker_and_the_helpers_dropped(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    helper = HelperProcess(shm, tmp_path / "helper.log")
    helpers.append(helper)
    ck = make(tmp_path, shm)
    assert ck._writer.helper is not None
    ck._writer.helper.persist_timeout = 1.0
    publish = HelperClient.publish

    def publish_then_stop(self: HelperClient, **kwargs: object) -> None:
        publish(self, **kwargs)  # type: ignore[arg-type]
        helper.stop()  # between the publish and the tier-1 write

    monkeypatch.setattr(HelperClient, "publish", publish_then_stop)
    pending = ck.save_async(1, state(1))
    pending.wait_persisted()  # by the worker, after 1 s without an answer (the helper stopped before the request)
    assert ck._writer.helper.persisted == 0
    os.kill(helper.proc.pid, signal.SIGCONT)
    helper.wait_for_log("the worker gave up on this request")  # its copy of rank 0 was never renamed
    ck.close()
    assert sorted(p.name for p in step_dir(tmp_path, 1).iterdir()) == ["COMMIT", "rank_00000"]
    for rank_dir in shm.glob("rank_*"):
        shutil.rmtree(rank_dir)
    assert restored(tmp_path, shm) == (1, "local")


def test_the_helper_uploads_tier2_and_the_worker_does_when_it_is_gone(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess], moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tier 2 on S3 (moto's server, s3fs): the files of a committed tier-1 step move in the helper process; the
    # worker's replicator writes the rank marker and COMMIT. With the helper killed, the worker uploads itself.
    monkeypatch.setattr(HelperClient, "RETRY_S", 60.0)  # not asked again within this test once it is gone
    helpers.append(HelperProcess(shm, tmp_path / "helper.log"))
    shared = SharedConfig(url=f"s3://{moto_s3.make_bucket()}/ckpt", run_name="run",
                          storage_options=moto_s3.storage_options())
    ck = Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm, shared=shared),
                      rank=0, world_size=1)
    uploader = ck._shared.helper if ck._shared is not None else None
    assert uploader is not None
    ck.save_async(1, state(1)).wait_persisted()
    ck.wait_uploaded()
    assert uploader.uploaded == 2  # state.safetensors, then manifest.json
    helpers[0].end()
    ck.save_async(2, state(2)).wait_persisted()
    ck.wait_uploaded()
    assert uploader.uploaded == 2
    ck.close()
    # Tier 2 alone (a fresh node: no tier 0, an empty tier 1): both steps committed there, the newest bitwise.
    fresh = Checkpointer(CheckpointConfig(local_dir=tmp_path / "fresh", shared=shared), rank=0, world_size=1)
    try:
        for step in (2, 1):
            found = fresh.restore(step=step)
            assert found is not None and (found.step, found.tier) == (step, "shared")
            assert torch.equal(found.state["w"], state(step)["w"]) and torch.equal(found.state["b"], state(step)["b"])
    finally:
        fresh.close()


def test_when_the_helper_cannot_upload_but_the_worker_can_the_worker_uploads_from_then_on(
    tmp_path: Path, shm: Path, helpers: list[HelperProcess], moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's credentials are in the worker's environment only (set by the training script, say), not in the
    # helper's (started by the agent): the helper's upload fails, the worker's own works, and it stops asking.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup for credentials
    helpers.append(HelperProcess(shm, tmp_path / "helper.log"))  # started before the credentials are set
    options = {k: v for k, v in moto_s3.storage_options().items() if k not in ("key", "secret")}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.storage_options()["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.storage_options()["secret"])
    shared = SharedConfig(url=f"s3://{moto_s3.make_bucket()}/ckpt", run_name="run", storage_options=options)
    ck = Checkpointer(CheckpointConfig(local_dir=tmp_path / "ckpt", tier0_dir=shm, shared=shared),
                      rank=0, world_size=1)
    assert ck._shared is not None and ck._shared.helper is not None
    for step in (1, 2):
        ck.save_async(step, state(step)).wait_persisted()
        ck.wait_uploaded()
    assert ck._shared.helper.uploaded == 0 and ck._shared._helper_options is None
    ck.close()
    helpers[0].wait_for_log("upload failed")  # it was asked once, for step 1's first file
    fresh = Checkpointer(CheckpointConfig(local_dir=tmp_path / "fresh", shared=shared), rank=0, world_size=1)
    try:
        found = fresh.restore()
        assert found is not None and (found.step, found.tier) == (2, "shared")
        assert torch.equal(found.state["w"], state(2)["w"])
    finally:
        fresh.close()
    assert helpers[0].log.read_text().count("request upload failed") == 1


def test_the_agents_helper_starts_at_begin_once_and_never_after_stop(shm: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # elastic-run's agent makes its NodeHelper at start and starts the process with the workers (begin); a
    # second begin (every round's worker start) starts no second helper, and nothing starts one after stop.
    from elastic.node_helper import ENV, NodeHelper

    monkeypatch.setenv(ENV, "1")  # tests/conftest.py turns the helper off for the jobs that do not test it
    helper = NodeHelper.start(str(shm), spawn=False)
    assert helper is not None and helper.pid is None and not socket_path(shm).exists()
    try:
        helper.begin()
        first = helper.pid
        assert first is not None
        deadline = time.monotonic() + 60
        while not socket_path(shm).exists():
            assert time.monotonic() < deadline, "the helper did not listen within 60 s"
            time.sleep(0.05)
        helper.begin()
        assert helper.pid == first
    finally:
        helper.stop()
    assert helper.pid is None
    helper.begin()
    assert helper.pid is None


def test_an_agents_helper_that_stops_answering_is_killed_and_a_new_one_started(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A helper alive but not answering (SIGSTOPped here; wedged alike) was never replaced: only its death was
    # noticed, and every worker waited `timeout` for it every few seconds, skipping its snapshots meanwhile.
    from elastic import node_helper

    monkeypatch.setenv(node_helper.ENV, "1")
    for name, value in (("PING_EVERY_S", 0.1), ("PING_TIMEOUT_S", 0.5), ("MAX_SILENT_PINGS", 2)):
        monkeypatch.setattr(node_helper, name, value)
    helper = node_helper.NodeHelper.start(str(shm))
    assert helper is not None and helper.pid is not None
    first = helper.pid

    def wait_until(what: str, ok) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 60
        while not ok():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            helper.ensure_running()  # the agent's monitor tick
            time.sleep(0.05)

    try:
        wait_until("the helper to answer", lambda: node_helper.ping(socket_path(shm), 5) is None)
        time.sleep(1.0)
        assert helper.pid == first  # answering: left alone
        os.kill(first, signal.SIGSTOP)
        wait_until("a new helper", lambda: helper.pid not in (None, first))
        assert not os.path.exists(f"/proc/{first}")  # the stopped one was killed (and reaped)
        wait_until("the new helper to answer", lambda: node_helper.ping(socket_path(shm), 5) is None)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)
        helper.stop()
