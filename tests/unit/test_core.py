"""core: the event file sink (the harness's only protocol) and the deadline helper."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest

from core import events
from core.deadline import Deadline

pytestmark = pytest.mark.timeout(60)


def _emit_many(directory: str, n: int) -> None:
    os.environ[events.EVENTS_DIR_ENV] = directory
    for i in range(n):
        events.emit("step", step=i, loss=float(i))


def test_events_go_to_a_file_per_process_with_identity(tmp_path, monkeypatch):
    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("ELASTIC_NODE_ID", "node-b")
    events.emit("restored", step=7, tier="local", source_rank=2, path="/x")
    lines = (tmp_path / f"events-{os.getpid()}.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert [json.loads(line) for line in lines] == [
        {"event": "restored", "ts": first["ts"], "mono": first["mono"], "boot": first["boot"], "pid": os.getpid(),
         "rank": 2, "restart": 1, "node": "node-b", "step": 7, "tier": "local", "source_rank": 2, "path": "/x"}]
    assert abs(first["mono"] - time.monotonic()) < 60 and first["boot"]


def test_events_of_one_machine_are_ordered_by_its_monotonic_clock_not_the_wall_clock(tmp_path, monkeypatch):
    # The wall clock stepped back 1 h between the two (NTP, an operator): by `ts` the later event came first.
    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0)
    events.emit("hang_detected", rank=1)
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0 - 3600)
    events.emit("worker_started", rank=1)
    assert [r["event"] for r in events.read_events(str(tmp_path))] == ["hang_detected", "worker_started"]
    before = time.monotonic()
    stamped = events.emit("step", step=3, ts=1_000_000.0 - 3600 - 0.5)  # stamped with a moment 0.5 s earlier
    assert before - 0.5 - 1e-5 <= stamped["mono"] <= time.monotonic() - 0.5 + 1e-5, (before, stamped)
    # Records of another boot (another machine) in the same directory: the wall clock is all they share.
    other = {"event": "join", "ts": 1_000_000.0 - 3600 - 10, "pid": 1, "mono": 5.0, "boot": "another-boot"}
    (tmp_path / "events-1.jsonl").write_text(json.dumps(other) + "\n")
    assert [r["event"] for r in events.read_events(str(tmp_path))][0] == "join"


def test_read_events_merges_processes_and_skips_a_torn_line(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_emit_many, args=(str(tmp_path), 50)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with open(tmp_path / "events-999999.jsonl", "w") as f:
        f.write('{"event": "step", "ts": 1.0, "step": 1}\n{"event": "st')  # killed mid-write
    records = events.read_events(str(tmp_path))
    assert len(records) == 101
    by_pid: dict[int, list[int]] = {}
    for r in records:
        by_pid.setdefault(r["pid"], []).append(r["step"]) if "pid" in r else None
    assert sorted(len(v) for v in by_pid.values()) == [50, 50]
    assert all(v == list(range(50)) for v in by_pid.values())


def test_the_kept_event_file_follows_a_removed_file_a_new_directory_and_a_fork(tmp_path, monkeypatch):
    """emit keeps its file open between events; an event still lands where read_events looks for it."""
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(first))
    events.emit("step", step=1)
    (first / f"events-{os.getpid()}.jsonl").unlink()  # e.g. a harness clearing its directory between runs
    events.emit("step", step=2)
    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(second))
    events.emit("step", step=3)
    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(first))
    pid = os.fork()
    if pid == 0:  # the child inherits the open file; its events must go to a file of its own pid
        try:
            events.emit("step", step=4)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    events.emit("step", step=5)
    assert sorted((r["step"], r["pid"]) for r in events.read_events(str(first))) == [
        (2, os.getpid()), (4, pid), (5, os.getpid())]
    assert [r["step"] for r in events.read_events(str(second))] == [3]


def test_no_directory_means_no_file(tmp_path, monkeypatch):
    monkeypatch.delenv(events.EVENTS_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert events.emit("step", step=1)["step"] == 1
    assert list(tmp_path.iterdir()) == []


def test_deadline_with_a_fake_clock():
    now = [100.0]
    d = Deadline.after(5, clock=lambda: now[0])
    assert d.remaining() == 5 and not d.expired()
    assert d.capped(1.0) == 1.0
    now[0] = 104.5
    assert d.remaining() == pytest.approx(0.5) and d.capped(1.0) == pytest.approx(0.5)
    now[0] = 200.0
    assert d.remaining() == 0.0 and d.expired()
    forever = Deadline.after(None, clock=lambda: now[0])
    assert forever.remaining() is None and not forever.expired() and forever.capped(2.0) == 2.0


def test_faults_match_on_rank_restart_and_point(tmp_path, monkeypatch):
    from core import faults

    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(faults.FAULTS_ENV, faults.encode([
        faults.Fault(point="step", step=3, rank=1, action="raise"),
        faults.Fault(point="save", step=5, action="raise", restart=None)]))
    monkeypatch.setenv("RANK", "0")
    faults.fire("step", 3)  # another rank's fault
    monkeypatch.setenv("RANK", "1")
    faults.fire("save", 3)  # another point
    with pytest.raises(faults.InjectedFault):
        faults.fire("step", 3)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    faults.fire("step", 3)  # restart 0 only, by default
    with pytest.raises(faults.InjectedFault):
        faults.fire("save", 5)  # restart=None: every restart
    assert [(r["event"], r["point"], r["step"]) for r in events.read_events(str(tmp_path))] == [
        ("fault", "step", 3), ("fault", "save", 5)]


def test_bad_fault_config_names_the_variable(monkeypatch):
    from core import faults

    monkeypatch.setenv(faults.FAULTS_ENV, '[{"point": "lunch", "step": 1}]')
    with pytest.raises(ValueError, match="ELASTIC_FAULTS: point 'lunch'"):
        faults.fire("step", 1)


def test_decimal_takes_ascii_digits_that_fit_an_int64_only():
    from core.numbers import decimal

    assert [decimal(t) for t in ("0", "7", "007", "9" * 18)] == [0, 7, 7, 10**18 - 1]
    # str.isdigit() is true of the Unicode digits and of any length; int() then raises or overflows a pid
    assert [decimal(t) for t in ("\u00b2", "\u0663", "1" * 19, "1" * 5000, "", "-1", "+1", " 1", "1_0")] == [None] * 9


def test_the_examples_refuse_a_bad_count_naming_the_flag() -> None:
    """Session 50's audit: train_tiny.py --steps -1 trained 0 steps and exited 0; --ckpt-every 0 and
    --global-batch 0 failed in every worker, after the group formed, as tracebacks."""
    import argparse
    import subprocess
    import sys

    from core.numbers import at_least
    from tests.conftest import REPO

    assert at_least(0)("0") == 0 and at_least(1)("12") == 12
    for text in ("-1", "x", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be a whole number >= 0, got {text!r}"):
            at_least(0)(text)
    done = subprocess.run([sys.executable, str(REPO / "examples" / "train_tiny.py"), "--steps", "4", "--ckpt-dir",
                           "unused", "--ckpt-every", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "argument --ckpt-every: must be a whole number >= 1, got '0'" in done.stderr
