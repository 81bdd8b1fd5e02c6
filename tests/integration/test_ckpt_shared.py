"""Tier 2 end to end: background replication, the commit protocol, retention, restore from the
shared store, run isolation and a store outage. Each test runs against a mounted-path URL and
against S3 (s3fs talking HTTP to moto's server on a free port)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from ckpt import (
    CheckpointConfig,
    CheckpointError,
    CheckpointTimeoutError,
    RetryConfig,
    SharedConfig,
    SharedStorageError,
)
from tests import s3_fixtures
from tests.s3_fixtures import Checkpointers, MotoS3
from tests.unit.test_ckpt_async import assert_same, flip_bit, state_of
from trainer import Resumable, ResumeConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# Fixtures shared with the other ckpt tests.
checkpointers = s3_fixtures.checkpointers
fast_s3fs_retries = s3_fixtures.fast_s3fs_retries
moto_s3 = s3_fixtures.moto_s3
own_moto_s3 = s3_fixtures.own_moto_s3

WAIT = timedelta(seconds=20)
FAST_RETRY = RetryConfig(
    attempts=3,
    initial=timedelta(seconds=0.02),
    maximum=timedelta(seconds=0.1),
    jitter=timedelta(seconds=0.01),
    deadline=timedelta(seconds=2),
)


class Store:
    """A shared store URL plus the means to look inside it."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url
        self.options = options
        self.fs, self.root = fsspec.core.url_to_fs(url, **options)

    def shared(self, run: str, **kw: Any) -> SharedConfig:
        kw.setdefault("retry", FAST_RETRY)
        kw.setdefault("commit_timeout", timedelta(seconds=15))
        return SharedConfig(url=self.url, run_name=run, storage_options=self.options, **kw)

    def path(self, run: str, step: int, *rest: str) -> str:
        return "/".join([self.root, run, f"step_{step:012d}", *rest])

    def committed(self, run: str) -> list[int]:
        self.fs.invalidate_cache()
        try:
            names = self.fs.ls(f"{self.root}/{run}", detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            if not name.rstrip("/").rsplit("/", 1)[-1].startswith("step_"):
                continue  # RUN.json, OWNER.json
            step = int(name.rstrip("/").rsplit("_", 1)[1])
            if self.fs.exists(f"{name.rstrip('/')}/COMMIT"):
                steps.append(step)
        return sorted(steps)

    def commit(self, run: str, step: int) -> dict[str, Any]:
        return json.loads(self.fs.cat_file(self.path(run, step, "COMMIT")))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(params=["path", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "path":
        return Store(str(tmp_path / "shared"), {})
    moto: MotoS3 = request.getfixturevalue("moto_s3")
    return Store(f"s3://{moto.make_bucket()}/ckpt", moto.storage_options())


def local(tmp_path: Path, node: str, shared: SharedConfig, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(local_dir=tmp_path / node, shared=shared, **kw)


def test_commit_marker_is_written_only_after_every_rank_uploaded(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    shared = store.shared("run")
    # Two nodes, one rank each: their tier-1 dirs differ, tier 2 is the only common ground.
    r0, r1 = (
        checkpointers.make(
            local(tmp_path, f"node-{r}", shared),
            rank=r,
            world_size=2,
            local_world_size=1,
            generation="g1",
        )
        for r in range(2)
    )
    r0.save_async(10, state_of(0)).wait_persisted(WAIT)
    with pytest.raises(CheckpointTimeoutError, match=r"steps \[10\] not replicated"):
        r0.wait_uploaded(timedelta(seconds=0.5))  # rank 0 waits for rank 1's marker
    # its own upload finishes in the background (on a loaded machine after the 0.5 s above)
    wait_for(lambda: store.fs.exists(store.path("run", 10, "rank_00000.done")), "rank 0's upload marker", 60)
    assert store.committed("run") == []  # partial: invisible
    reader = checkpointers.make(local(tmp_path, "node-c", shared), rank=1, world_size=2)
    assert reader.available_steps() == [] and reader.restore() is None

    r1.save_async(10, state_of(1)).wait_persisted(WAIT)
    r1.wait_uploaded(WAIT)
    r0.wait_uploaded(WAIT)
    assert store.committed("run") == [10]
    commit = store.commit("run", 10)
    assert (commit["run"], commit["generation"], commit["world_size"]) == ("run", "g1", 2)
    assert set(commit["manifests"]) == {"0", "1"}
    metrics = r0.metrics[-1]
    assert (
        metrics.status == "committed"
        and metrics.tier2_s is not None
        and metrics.tier1_s is not None
    )

    restored = reader.restore()  # node c has no local copy: it comes from the shared tier
    assert restored is not None and (restored.step, restored.rank, restored.tier) == (
        10,
        1,
        "shared",
    )
    assert_same(restored.state, state_of(1))
    assert not list((tmp_path / "node-c").glob(".tmp-*"))  # download scratch removed


def test_closing_at_the_end_of_a_world_does_not_wait_for_a_lost_rank(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    # An in-place re-formation closes each rank's checkpointer of the old world (trainer/resumable.py). A rank lost
    # with its node never uploads the step it was saving: rank 0 must not wait commit_timeout for its marker.
    shared = store.shared("run", commit_timeout=timedelta(minutes=10))
    r0 = checkpointers.make(local(tmp_path, "node-0", shared), rank=0, world_size=2, local_world_size=1,
                            generation="g1")
    r0.save_async(10, state_of(0)).wait_persisted(WAIT)
    assert r0.close(timedelta(seconds=30), world_over=True)  # its own upload done, the step given up
    assert store.fs.exists(store.path("run", 10, "rank_00000.done"))
    assert store.committed("run") == []
    assert r0.metrics[-1].status == "abandoned"


def test_closing_at_the_end_of_a_world_still_commits_what_every_rank_uploaded(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    shared = store.shared("run")
    r0, r1 = (checkpointers.make(local(tmp_path, f"node-{r}", shared), rank=r, world_size=2, local_world_size=1,
                                 generation="g1") for r in range(2))
    for rank, c in ((0, r0), (1, r1)):
        c.save_async(10, state_of(rank)).wait_persisted(WAIT)
    assert r1.close(WAIT, world_over=True)
    assert r0.close(WAIT, world_over=True)
    assert store.committed("run") == [10]


def test_retention_per_tier_and_every_nth_forever(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    shared = store.shared("run", keep_last=2, keep_every=3)
    c = checkpointers.make(local(tmp_path, "node", shared, keep_last=1))
    for step in range(1, 8):
        c.save_async(step, {"s": torch.tensor(step)}).wait_persisted(WAIT)
        c.wait_uploaded(WAIT)
    assert store.committed("run") == [3, 6, 7]
    assert c.committed_steps() == [7]
    fresh = checkpointers.make(local(tmp_path, "fresh", shared))
    assert fresh.available_steps() == [7, 6, 3]
    assert fresh.restore(step=3).state["s"].item() == 3


def test_local_copy_is_kept_until_its_upload_is_committed(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    shared = store.shared("run")
    r0, r1 = (
        checkpointers.make(
            local(tmp_path, f"node-{r}", shared, keep_last=1),
            rank=r,
            world_size=2,
            local_world_size=1,
        )
        for r in range(2)
    )
    for step in (1, 2, 3):
        r0.save_async(step, {"s": torch.tensor(step)}).wait_persisted(WAIT)
    # Beyond keep_last and not in tier 2 yet: only the newest is kept for its upload, the older ones are
    # superseded in the upload queue (holding them all filled tier 1 in a long tier-2 outage).
    wait_for(lambda: r0.committed_steps() == [3], "steps 1 and 2 released locally")
    r1.save_async(3, {"s": torch.tensor(3)}).wait_persisted(WAIT)  # rank 1 only saved step 3
    r1.wait_uploaded(WAIT)
    r0.wait_uploaded(WAIT)  # commits 3; 1 and 2 are superseded (given up) and released locally
    assert store.committed("run") == [3]
    assert r0.committed_steps() == [3]
    statuses = [m.status for m in r0.metrics]
    # 1 and 2: uploaded then given up when 3 committed ("abandoned"), or, if 3 was already queued
    # when their turn came, never uploaded ("superseded").
    assert statuses[-1] == "committed" and set(statuses[:-1]) <= {"abandoned", "superseded"}, statuses


def test_two_runs_sharing_a_prefix_never_mix(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    a = checkpointers.make(local(tmp_path, "a", store.shared("run-a", keep_last=1)))
    b = checkpointers.make(local(tmp_path, "b", store.shared("run-b", keep_last=1)))
    a.save_async(5, {"who": torch.tensor(1)}).wait_persisted(WAIT)
    b.save_async(3, {"who": torch.tensor(2)}).wait_persisted(WAIT)
    a.save_async(9, {"who": torch.tensor(1)}).wait_persisted(WAIT)  # a's retention runs
    a.wait_uploaded(WAIT)
    b.wait_uploaded(WAIT)
    assert store.committed("run-a") == [9] and store.committed("run-b") == [3]
    fresh_b = checkpointers.make(local(tmp_path, "fresh-b", store.shared("run-b")))
    assert fresh_b.available_steps() == [3]
    restored = fresh_b.restore()
    assert restored is not None and restored.step == 3 and restored.state["who"].item() == 2
    # A COMMIT copied in from another run is refused, even under this run's prefix.
    store.fs.copy(store.path("run-a", 9), store.path("run-b", 9), recursive=True)
    assert store.fs.exists(store.path("run-b", 9, "COMMIT"))
    assert fresh_b.available_steps() == [3]


def test_damaged_local_copy_is_replaced_by_the_shared_one(
    tmp_path: Path, store: Store, checkpointers: Checkpointers, caplog: pytest.LogCaptureFixture
) -> None:
    c = checkpointers.make(local(tmp_path, "node", store.shared("run")))
    for step in (1, 2):
        c.save_async(step, state_of(step)).wait_persisted(WAIT)
    c.wait_uploaded(WAIT)
    rank_dir = tmp_path / "node" / "step_000000000002" / "rank_00000"
    flip_bit(rank_dir)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        restored = c.restore()
    assert restored is not None and (restored.step, restored.tier) == (2, "shared")
    assert_same(restored.state, state_of(2))
    assert any(str(rank_dir / "state.safetensors") in r.getMessage() for r in caplog.records)


def test_damaged_shared_copy_falls_back_to_the_previous_step(
    tmp_path: Path, store: Store, checkpointers: Checkpointers, caplog: pytest.LogCaptureFixture
) -> None:
    c = checkpointers.make(local(tmp_path, "node", store.shared("run")))
    for step in (1, 2):
        c.save_async(step, state_of(step)).wait_persisted(WAIT)
    c.wait_uploaded(WAIT)
    path = store.path("run", 2, "rank_00000", "state.safetensors")
    data = bytearray(store.fs.cat_file(path))
    data[-3] ^= 0x10
    store.fs.pipe_file(path, bytes(data))
    fresh = checkpointers.make(local(tmp_path, "fresh", store.shared("run")))
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (1, "shared")
    assert_same(restored.state, state_of(1))
    assert any("step 2" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)


def test_a_shared_copy_missing_a_file_falls_back_to_the_previous_step(
    tmp_path: Path, store: Store, checkpointers: Checkpointers
) -> None:
    # The store answered "no such object" (damage, not an outage): the download raised FileNotFoundError past
    # the restore, which stopped instead of taking step 1.
    c = checkpointers.make(local(tmp_path, "node", store.shared("run")))
    for step in (1, 2):
        c.save_async(step, state_of(step)).wait_persisted(WAIT)
    c.wait_uploaded(WAIT)
    store.fs.rm_file(store.path("run", 2, "rank_00000", "state.safetensors"))
    fresh = checkpointers.make(local(tmp_path, "fresh", store.shared("run")))
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (1, "shared")


def test_shared_store_down_then_back_uploads_catch_up(
    tmp_path: Path,
    own_moto_s3: MotoS3,
    fast_s3fs_retries: None,
    checkpointers: Checkpointers,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store(f"s3://{own_moto_s3.make_bucket()}/ckpt", own_moto_s3.storage_options())
    shared = store.shared("run", keep_last=5)
    c = checkpointers.make(local(tmp_path, "node", shared, keep_last=2))
    c.save_async(1, state_of(1)).wait_persisted(WAIT)
    c.wait_uploaded(WAIT)

    own_moto_s3.stop()
    assert own_moto_s3.refuses_connections()
    for step in (2, 3, 4, 5):  # training goes on: tier 1 works, saves do not wait for tier 2
        pending = c.save_async(step, state_of(step))
        assert pending.wait_persisted(WAIT).stall_s < 1.0
    # the newest steps, the older ones superseded in the queue
    with pytest.raises(CheckpointTimeoutError, match=r"steps \[(\d, )*5\] not replicated .*last error"):
        c.wait_uploaded(timedelta(seconds=1.5))
    wait_for(lambda: "failed" in (c.last_error or ""), "the upload error to be surfaced")
    # Tier 1 keeps its keep_last while tier 2 is down: held for their upload, the steps of a long outage
    # filled the disk until the job stopped. Step 5 waits for its upload, 1 is in tier 2, 2-3 are superseded.
    wait_for(lambda: c.committed_steps() == [5, 4], "tier 1's retention to run while tier 2 is down")
    assert any("retrying in" in r.getMessage() for r in caplog.records)  # tenacity backoff ran

    own_moto_s3.start()  # same port, same bucket: the store is back
    c.wait_uploaded(WAIT)
    # The backlog catches up with the newest step only: steps 2-4 were superseded by step 5.
    assert store.committed("run") == [1, 5]
    by_step = {m.step: m for m in c.metrics}
    assert by_step[2].status == "superseded"
    latest = by_step[5]
    assert latest.status == "committed" and latest.error is None and latest.upload_lag_steps == 4
    fresh = checkpointers.make(local(tmp_path, "fresh", shared))
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (5, "shared")
    assert_same(restored.state, state_of(5))


def test_restore_works_from_the_local_tier_while_the_store_is_down(
    tmp_path: Path, own_moto_s3: MotoS3, fast_s3fs_retries: None, checkpointers: Checkpointers
) -> None:
    store = Store(f"s3://{own_moto_s3.make_bucket()}/ckpt", own_moto_s3.storage_options())
    c = checkpointers.make(local(tmp_path, "node", store.shared("run")))
    c.save_async(4, state_of(4)).wait_persisted(WAIT)
    c.wait_uploaded(WAIT)
    own_moto_s3.stop()
    started = time.monotonic()
    restored = c.restore()
    assert restored is not None and (restored.step, restored.tier) == (4, "local")
    assert time.monotonic() - started < 10


def test_a_fresh_node_does_not_start_over_while_the_shared_tier_cannot_be_read(
    tmp_path: Path, own_moto_s3: MotoS3, fast_s3fs_retries: None, checkpointers: Checkpointers
) -> None:
    """A node with an empty tier 1 restored while tier 2 could not be listed, or while its downloads failed
    (503, or no room in tier 1 for them), started from step 0 (a failed download counted as a damaged step), and
    the first save of that new start removed every committed step in tier 2. Now restore raises, naming the
    store, and the steps are there once it answers."""

    proxy = s3_fixtures.FailingGets(own_moto_s3, r"state\.safetensors")
    try:
        bucket = own_moto_s3.make_bucket()
        store = Store(f"s3://{bucket}/ckpt", proxy.storage_options())
        first = checkpointers.make(local(tmp_path, "node", store.shared("run")))
        for step in (1, 2):
            first.save_async(step, state_of(step)).wait_persisted(WAIT)
        first.wait_uploaded(WAIT)
        first.close()

        fresh = checkpointers.make(local(tmp_path, "fresh", store.shared("run")))
        proxy.failing.set()  # the downloads of the tensors fail
        with pytest.raises(SharedStorageError, match=r"step 2 .*could not be read .*Not going back to an older"):
            fresh.restore()
        proxy.failing.clear()
        own_moto_s3.stop()  # the store does not answer at all
        with pytest.raises(SharedStorageError, match="cannot tell whether run .* has checkpoints in the shared"):
            fresh.restore()
        own_moto_s3.start()
        restored = fresh.restore()
        assert restored is not None and (restored.step, restored.tier) == (2, "shared")
        assert store.committed("run") == [1, 2]
    finally:
        proxy.close()


def test_a_bucket_that_does_not_exist_is_named_at_start(
    tmp_path: Path, moto_s3: MotoS3, fast_s3fs_retries: None, checkpointers: Checkpointers,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A bare FileNotFoundError ("The specified bucket does not exist") stopped the start, naming no URL nor option.
    store = Store("s3://no-such-bucket-here/ckpt", moto_s3.storage_options())
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        checkpointers.make(local(tmp_path, "node", store.shared("run")))
    assert any("s3://no-such-bucket-here/ckpt/run/OWNER.json: the store says it does not exist" in r.getMessage()
               and "create the bucket, or fix shared.url" in r.getMessage() for r in caplog.records), caplog.text


def test_a_bucket_deleted_mid_run_is_named_and_uploads_go_on_once_it_is_back(
    tmp_path: Path, moto_s3: MotoS3, fast_s3fs_retries: None, checkpointers: Checkpointers,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The upload's FileNotFoundError was taken for the local copy gone ("nothing to retry"): the step was given up
    # and the log blamed the local disk.
    bucket = moto_s3.make_bucket()
    store = Store(f"s3://{bucket}/ckpt", moto_s3.storage_options())
    ckpt = checkpointers.make(local(tmp_path, "node", store.shared("run")))
    ckpt.save_async(1, state_of(1)).wait_persisted(WAIT)
    ckpt.wait_uploaded(WAIT)
    assert store.committed("run") == [1]
    store.fs.rm(bucket, recursive=True)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        ckpt.save_async(2, state_of(2)).wait_persisted(WAIT)
        wait_for(lambda: any("was the bucket deleted?" in r.getMessage() for r in caplog.records),
                 "the failed upload named")
    assert not any("gave up" in r.getMessage() or "giving up" in r.getMessage() for r in caplog.records), caplog.text
    moto_s3.make_bucket(bucket)  # back, empty
    ckpt.save_async(3, state_of(3)).wait_persisted(WAIT)
    ckpt.wait_uploaded(WAIT)
    assert 3 in store.committed("run"), store.committed("run")
    ckpt.close()


def test_a_store_that_takes_connections_and_never_answers_costs_the_retry_deadline_not_minutes(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    # A hung gateway: connections accepted, nothing ever answered. Each call held the job's start for the S3
    # client's own timeouts and retries (over 7 minutes with a 10 s deadline); now each ends by shared.retry.deadline.
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        options = {"endpoint_url": f"http://127.0.0.1:{listener.getsockname()[1]}", "key": "k", "secret": "s",
                   "client_kwargs": {"region_name": "us-east-1"}}  # s3fs's and botocore's own timeouts
        retry = RetryConfig(attempts=2, initial=timedelta(seconds=0.02), maximum=timedelta(seconds=0.1),
                            jitter=timedelta(seconds=0.01), deadline=timedelta(seconds=0.5))
        c = checkpointers.make(local(tmp_path, "node", Store("s3://bucket/ckpt", options).shared("run", retry=retry)))
        with pytest.raises(SharedStorageError, match=r"shared\.retry\.deadline"):  # no answer, or no time left
            c.restore()  # the start's calls and this one each within the 0.5 s deadline, in the test's 60 s
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_step_linked_out_of_a_mounted_shared_tier_is_neither_read_nor_removed_through(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    store = Store(str(tmp_path / "shared"), {})
    shared = store.shared("run", keep_last=2)
    first = checkpointers.make(local(tmp_path, "n1", shared, keep_last=1))
    for step in (1, 2):
        first.save_async(step, state_of(step)).wait_persisted(WAIT)
    first.wait_uploaded(WAIT)
    outside = tmp_path / "elsewhere"
    Path(store.path("run", 1)).rename(outside)
    Path(store.path("run", 1)).symlink_to(outside)  # another tree's files in a step's place
    fresh = checkpointers.make(local(tmp_path, "n2", shared, keep_last=1))
    assert fresh.restore(step=1) is None  # not read through the link
    restored = fresh.restore()
    assert restored is not None and restored.step == 2
    for step in (3, 4):  # tier-2 retention (keep_last 2) runs: step 2 goes, nothing is removed through the link
        fresh.save_async(step, state_of(step)).wait_persisted(WAIT)
    fresh.wait_uploaded(WAIT)
    wait_for(lambda: not Path(store.path("run", 2)).exists(), "shared retention to remove step 2")
    assert sorted(p.name for p in outside.iterdir()) == ["COMMIT", "rank_00000", "rank_00000.done"]


def test_init_from_a_curated_directory_of_links_to_steps_still_reads_them(
    tmp_path: Path, checkpointers: Checkpointers
) -> None:
    source = checkpointers.make(CheckpointConfig(local_dir=tmp_path / "run-a"))
    source.save_async(2, state_of(2)).wait_persisted(WAIT)
    (tmp_path / "curated").mkdir()  # a read-only source: links out of it are the user's choice, not a hazard
    (tmp_path / "curated" / "step_000000000002").symlink_to(tmp_path / "run-a" / "step_000000000002")
    fresh = checkpointers.make(CheckpointConfig(local_dir=tmp_path / "run-b", init_from=str(tmp_path / "curated")))
    restored = fresh.restore()
    assert restored is not None and restored.step == 2 and restored.init_from
    assert_same(restored.state, state_of(2))


@pytest.mark.timeout(120)
def test_closing_a_run_with_the_store_down_waits_its_retry_deadline_not_five_minutes(
    tmp_path: Path, own_moto_s3: MotoS3, fast_s3fs_retries: None
) -> None:
    # Resumable.close waited a fixed 5 minutes for the uploads, whatever retry.deadline the user set for the store.
    retry = RetryConfig(attempts=2, initial=timedelta(seconds=0.2), maximum=timedelta(seconds=0.5),
                        jitter=timedelta(0), deadline=timedelta(seconds=3))
    shared = SharedConfig(url=f"s3://{own_moto_s3.make_bucket()}/ckpt", storage_options=own_moto_s3.storage_options(),
                          retry=retry)
    run = Resumable(ResumeConfig.at(tmp_path / "local", persist_every=1, shared=shared), model=nn.Linear(2, 1))
    assert run.restore() == 0
    run.step_done(1)
    run.checkpointer.wait_uploaded(WAIT)
    own_moto_s3.stop()
    run.step_done(2)
    started = time.monotonic()
    with contextlib.suppress(CheckpointError):
        run.close()
    assert time.monotonic() - started < 60, "close waited for the store past its retry deadline"
    assert 2 in run.checkpointer.committed_steps()  # the local copy stays for the next start to upload
