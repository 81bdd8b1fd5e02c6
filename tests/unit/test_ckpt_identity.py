"""Run identity (issue G item 2): one run per checkpoint directory, one live job, init_from.

Real files, real processes holding real flocks, a real shared tier (a mounted path, and S3 on
moto's server for the owner record)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from ckpt import (
    CheckpointConfig,
    CheckpointConflictError,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    SharedConfig,
)
from ckpt.owner import OWNER_FILE
from tests.conftest import Procs
from tests.s3_fixtures import MotoS3, moto_s3  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(90)
WAIT = timedelta(seconds=30)


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "step": int(value)}


def save(c: Checkpointer, step: int) -> None:
    c.save_async(step, state(step)).wait_persisted(WAIT)


def run_in(root: Path, name: str = "default", **kw: Any) -> Checkpointer:
    return Checkpointer(CheckpointConfig(local_dir=root, run_name=name, **kw), rank=0, world_size=1)


def test_a_run_with_another_name_refuses_the_directory_at_start(tmp_path: Path) -> None:
    with run_in(tmp_path, "pretrain") as a:
        for step in (40, 60):
            save(a, step)
    with pytest.raises(CheckpointConflictError) as info:
        run_in(tmp_path, "other")
    message = str(info.value)
    assert str(tmp_path) in message and "'pretrain'" in message and "'other'" in message
    assert "steps 60, 40" in message and "init_from=" in message
    # Nothing was replaced: run "pretrain" resumes from its own newest step.
    with run_in(tmp_path, "pretrain") as a:
        restored = a.restore()
        assert restored is not None and restored.step == 60 and not restored.init_from
        assert torch.equal(restored.state["w"], state(60)["w"])


def test_a_directory_whose_owner_left_no_checkpoint_is_taken_over(tmp_path: Path) -> None:
    run_in(tmp_path, "first").close()  # RUN.json names "first", but it committed nothing
    with run_in(tmp_path, "second") as c:
        save(c, 5)
        assert c.committed_steps() == [5]
    assert json.loads((tmp_path / "RUN.json").read_text())["run_name"] == "second"


def test_a_step_copied_in_from_another_run_is_refused_and_never_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Both runs keep the default name; only their uids tell them apart.
    with run_in(tmp_path / "a") as a:
        save(a, 60)
        uid_a = a.identity.uid
    with run_in(tmp_path / "b") as b:
        save(b, 10)
        uid_b = b.identity.uid
    assert uid_a != uid_b
    shutil.copytree(tmp_path / "a" / "step_000000000060", tmp_path / "b" / "step_000000000060")
    with caplog.at_level(logging.WARNING, logger="ckpt"), run_in(tmp_path / "b") as b:
        restored = b.restore()
        assert restored is not None and restored.step == 10
        warning = next(r.getMessage() for r in caplog.records if "ignoring" in r.getMessage())
        assert str(tmp_path / "b" / "step_000000000060" / "COMMIT") in warning
        assert uid_a in warning and uid_b in warning
        assert b.committed_steps() == [10]
        # Saving step 60 again must not replace the other run's step 60.
        pending = b.save_async(60, state(61))
        refused = "step 60 .* is committed by run 'default' .*not replacing it"
        with pytest.raises(CheckpointConflictError, match=refused):
            pending.wait_persisted(WAIT)
        save(b, 70)  # retention never deletes the foreign step either
    commit = json.loads((tmp_path / "b" / "step_000000000060" / "COMMIT").read_text())
    assert commit["run_uid"] == uid_a


def test_checkpoints_without_identity_still_load_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with run_in(tmp_path) as c:
        save(c, 3)
    commit_path = tmp_path / "step_000000000003" / "COMMIT"
    commit = json.loads(commit_path.read_text())
    del commit["run"], commit["run_uid"]  # as written before run identity existed
    commit_path.write_text(json.dumps(commit))
    (tmp_path / "RUN.json").unlink()
    with caplog.at_level(logging.WARNING, logger="ckpt"), run_in(tmp_path) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 3
    assert any("predate run identity" in r.getMessage() for r in caplog.records)
    assert any("carries no run identity" in r.getMessage() for r in caplog.records)


def test_init_from_starts_a_new_run_from_another_runs_checkpoint(tmp_path: Path) -> None:
    with run_in(tmp_path / "pre", "pretrain") as a:
        for step in (40, 60):
            save(a, step)
    with run_in(tmp_path / "ft", "finetune", init_from=str(tmp_path / "pre")) as b:
        restored = b.restore()
        assert restored is not None and restored.init_from
        assert restored.step == 60 and torch.equal(restored.state["w"], state(60)["w"])
        save(b, 1)
    step_dir = tmp_path / "pre" / "step_000000000040"
    with run_in(tmp_path / "ft", "finetune", init_from=str(step_dir)) as b:
        restored = b.restore()  # the run has a checkpoint of its own now: init_from is not used
        assert restored is not None and (restored.step, restored.init_from) == (1, False)
    with run_in(tmp_path / "ft2", "finetune", init_from=str(step_dir)) as c:
        restored = c.restore()  # a named step
        assert restored is not None and (restored.step, restored.init_from) == (40, True)
    with run_in(tmp_path / "pre", "pretrain") as a:
        assert a.committed_steps() == [60, 40]  # the source is only read


@pytest.mark.parametrize("where", ["no/such/dir", "a-file", "step_000000000050"])
def test_an_init_from_that_holds_nothing_is_an_error_naming_it_not_a_start_from_scratch(
        tmp_path: Path, where: str) -> None:
    with run_in(tmp_path / "pre", "pretrain") as a:
        save(a, 40)
    (tmp_path / "pre" / "a-file").write_text("x")
    source = tmp_path / "pre" / where  # a typo: the run trained from random weights, logging only "no checkpoint"
    with run_in(tmp_path / "ft", "finetune", init_from=str(source)) as b:
        with pytest.raises(CheckpointNotFoundError, match=re.escape(f"init_from {tmp_path / 'pre'}")):
            b.restore()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from ckpt import CheckpointConfig, Checkpointer, SharedConfig
    local, run, url, options = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
    shared = None
    if url:
        shared = SharedConfig(url=url, storage_options=options,
                              owner_heartbeat=timedelta(seconds=0.3))
    c = Checkpointer(CheckpointConfig(local_dir=local, run_name=run, shared=shared),
                     rank=0, world_size=1)
    print("ready", flush=True)
    time.sleep(120)
    """
)


def hold(
    procs: Procs, local: Path, run: str, *, job: str, url: str = "", options: Any = None
) -> subprocess.Popen[str]:
    proc = procs.start(
        [sys.executable, "-c", HOLDER, str(local), run, url, repr(options or {})],
        env={"TORCHELASTIC_RUN_ID": job},
        cwd=str(Path(__file__).parents[2]),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + proc.stdout.read()
    return proc


def test_two_live_jobs_cannot_share_a_directory(
    tmp_path: Path, procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = hold(procs, tmp_path, "alpha", job="job-a")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    for name in ("alpha", "beta"):  # whatever the run name
        with pytest.raises(CheckpointConflictError) as info:
            run_in(tmp_path, name)
        message = str(info.value)
        assert str(tmp_path) in message and "another live job" in message
        assert f"pid {holder.pid} on {socket.gethostname()}" in message and "'alpha'" in message
    # The same job's other ranks on this node share the directory.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    run_in(tmp_path, "alpha").close()
    # Once the holder is dead (SIGKILL: no cleanup), the kernel has dropped its flock.
    procs.kill_group(holder, signal.SIGKILL)
    holder.wait(timeout=30)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    run_in(tmp_path, "alpha").close()


def test_a_directory_deleted_while_the_job_runs_is_locked_again_at_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Its saves recreated the directory without a LOCK: another job could then start in it beside this one.
    root = tmp_path / "ckpt"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    with run_in(root, "alpha") as job:
        save(job, 1)
        shutil.rmtree(root)
        with caplog.at_level(logging.ERROR, logger="ckpt"):
            save(job, 2)
        assert any(f"{root} lost its LOCK" in r.getMessage() for r in caplog.records), caplog.text
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        with pytest.raises(CheckpointConflictError, match="another live job"):
            run_in(root, "alpha")
        save(job, 3)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ckpt"):
        job._apply_local_retention()  # a thread that outlived close(): the lock was released on purpose
    assert not caplog.records, caplog.text
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    run_in(root, "alpha").close()  # nothing holds the directory once the job closed
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    with run_in(root, "alpha") as again:
        restored = again.restore()
    assert restored is not None and restored.step == 3  # under the run's own identity, as before the deletion


@pytest.fixture(params=["path", "s3"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "path":
        return str(tmp_path / "shared"), {}
    moto: MotoS3 = request.getfixturevalue("moto_s3")
    return f"s3://{moto.make_bucket()}/ckpt", moto.storage_options()


def test_two_live_jobs_cannot_share_a_shared_prefix(
    tmp_path: Path,
    procs: Procs,
    monkeypatch: pytest.MonkeyPatch,
    shared_store: tuple[str, dict[str, Any]],
) -> None:
    url, options = shared_store
    holder = hold(procs, tmp_path / "node-a", "run", job="job-a", url=url, options=options)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    shared = SharedConfig(url=url, storage_options=options, owner_heartbeat=timedelta(seconds=0.3))

    def start() -> Checkpointer:
        return Checkpointer(
            CheckpointConfig(local_dir=tmp_path / "node-b", run_name="run", shared=shared),
            rank=0,
            world_size=1,
        )

    with pytest.raises(CheckpointConflictError) as info:
        start()
    message = str(info.value)
    assert f"{url}/run/{OWNER_FILE}" in message and "another live job" in message
    assert "job torchelastic:job-a" in message and f"pid {holder.pid}" in message
    # A crashed job's record is stale: taken over (here at once: its pid is gone on this host).
    procs.kill_group(holder, signal.SIGKILL)
    holder.wait(timeout=30)
    with start() as c:
        save(c, 1)
        c.wait_uploaded(WAIT)
    # A record from another host whose heartbeat stopped is taken over after 3 heartbeats.
    tier_record = json.dumps(
        {"job": "elsewhere", "host": "other-host", "pid": 1, "run_name": "run", "started": "x", "beat": 7}
    ).encode()
    fs, base = fsspec.core.url_to_fs(url, **options)
    fs.pipe_file(f"{base}/run/{OWNER_FILE}", tier_record)
    with start() as c:
        restored = c.restore()
        assert restored is not None and restored.step == 1
    fs.invalidate_cache()
    assert not fs.exists(f"{base}/run/{OWNER_FILE}")  # a clean close removes its own record


def test_local_ranks_starting_together_share_one_run_identity(tmp_path, monkeypatch):
    """The local ranks of one job share the directory lock; each reads RUN.json or mints the
    identity. Unguarded, ranks that all find no RUN.json mint different uids, and the restarted
    job then refuses its own checkpoints. A delay after the read (as on a loaded machine) makes
    every rank read before any writes."""
    import threading
    import time

    from ckpt import identity

    read = identity.read_identity

    def slow_read(root):
        found = read(root)
        time.sleep(0.2)
        return found

    monkeypatch.setattr(identity, "read_identity", slow_read)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    world = 4
    start = threading.Barrier(world)
    made: list[Checkpointer | BaseException] = [RuntimeError("not started")] * world

    def rank(r: int) -> None:
        start.wait(30)
        try:
            made[r] = Checkpointer(CheckpointConfig(local_dir=tmp_path, run_name="run"),
                                   rank=r, world_size=world, local_world_size=world)
        except BaseException as exc:  # reported by the assertion below
            made[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    checkpointers = [c for c in made if isinstance(c, Checkpointer)]
    try:
        assert len(checkpointers) == world, made
        assert len({c.identity.uid for c in checkpointers}) == 1
        on_disk = json.loads((tmp_path / "RUN.json").read_text())
        assert on_disk["run_uid"] == checkpointers[0].identity.uid
    finally:
        for c in checkpointers:
            c.close()


def test_nodes_starting_together_agree_on_the_shared_run_identity(tmp_path, monkeypatch):
    """Two nodes (tier-1 dirs A and B) mint their own uids; the shared tier's RUN.json must end up
    holding the uid rank 0 commits with. When every rank wrote its node's uid, a rank that read
    "none" before rank 0 wrote and wrote after it won, and rank 0's COMMITs named a uid RUN.json
    did not hold: every later restore ignored them ("committed by ... not by this run")."""
    import threading
    import time

    from ckpt.shared import SharedTier

    read = SharedTier.read_identity
    here = threading.local()

    def late_read(self):
        # Read 1 is Checkpointer._shared_uid (all ranks: "none"), read 2 the claim's. Rank 0 claims
        # at 0.3 s; the others read "none" at once and act on it late (rank 1 at 0.4 s, 2-3 at 0.6 s).
        r = getattr(here, "rank", 0)
        here.reads = getattr(here, "reads", 0) + 1
        if here.reads != 2:
            return read(self)
        if r == 0:
            time.sleep(0.3)
            return read(self)
        found = read(self)
        time.sleep(0.4 if r == 1 else 0.6)
        return found

    monkeypatch.setattr(SharedTier, "read_identity", late_read)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    shared = SharedConfig(url=(tmp_path / "shared").as_uri())
    world = 4
    made: list[Checkpointer | BaseException] = [RuntimeError("not started")] * world

    def rank(r: int) -> None:
        here.rank = r
        try:
            node = tmp_path / ("A" if r < 2 else "B")
            made[r] = Checkpointer(CheckpointConfig(local_dir=node, run_name="run", shared=shared),
                                   rank=r, world_size=world, local_world_size=2)
        except BaseException as exc:  # reported by the assertion below
            made[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    checkpointers = [c for c in made if isinstance(c, Checkpointer)]
    try:
        assert len(checkpointers) == world, made
        saves = [threading.Thread(target=c.save, args=(1, state(1.0))) for c in checkpointers]
        for t in saves:
            t.start()
        for t in saves:
            t.join(60)
        for c in checkpointers:
            c.wait_uploaded(WAIT)
    finally:
        for c in checkpointers:
            c.close()
    monkeypatch.setattr(SharedTier, "read_identity", read)
    with Checkpointer(CheckpointConfig(local_dir=tmp_path / "C", run_name="run", shared=shared),
                      rank=0, world_size=1) as fresh:
        assert fresh.available_steps() == [1]
        restored = fresh.restore()
    assert restored is not None and restored.tier == "shared"


def test_a_damaged_run_record_gets_advice_about_itself_not_about_a_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(CheckpointConfig(local_dir=root), rank=0, world_size=1) as c:
        c.save_async(1, {"w": torch.ones(4)}).wait_persisted()
    (root / "RUN.json").write_text("{garbage")
    with caplog.at_level(logging.WARNING, logger="ckpt"), \
            Checkpointer(CheckpointConfig(local_dir=root), rank=0, world_size=1) as c:
        restored = c.restore()
    assert restored is not None and restored.step == 1  # the identity comes from the COMMITs
    damaged = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage() and "RUN.json" in r.getMessage()]
    assert damaged and all("delete its checkpoint step directory" not in m for m in damaged), damaged
    (root / "RUN.json").unlink()
    (root / "RUN.json").mkdir()  # a directory in its place: the error names it, not the temp file renamed onto it
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(CheckpointConfig(local_dir=root), rank=0, world_size=1).close()
    assert f"{root / 'RUN.json'} exists" in str(caught.value) and ".tmp-" not in str(caught.value).split(";")[-1]


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_lock_that_is_a_link_or_a_fifo_is_named_with_what_to_do(tmp_path: Path, kind: str) -> None:
    # A LOCK that was a symbolic link got "check that <dir> is a writable directory on a healthy file system".
    root = tmp_path / "ckpt"
    root.mkdir()
    if kind == "link":
        (root / "LOCK").symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(root / "LOCK")
    with pytest.raises(CheckpointWriteError) as info:
        run_in(root)
    message = str(info.value)
    assert f"{root / 'LOCK'}" in message and ("never follows a link" if kind == "link" else "move it away") in message
    assert not (tmp_path / "elsewhere").exists()  # the link was not followed
