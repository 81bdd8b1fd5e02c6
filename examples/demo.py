"""`make demo`: a real kill and a real resume, on a private etcd, in about a minute.

1. An uninterrupted reference run of examples/train_tiny.py under elastic-run (2 workers).
2. The same job again; when rank 1 has passed step KILL_AT, this script SIGKILLs it by pid.
   The elastic agent replaces only that process (by its warm spare, a process with Python and torch
   already loaded); rank 0 keeps its process and re-forms the process group in place; the new rank 1
   resumes from its newest snapshot (tier 0: every step, in the node's memory; the disk gets every
   EVERY-th step), and the job finishes.
3. A summary: the kill, the replacement, the step it resumed from, rank 0's pid before and after,
   and whether the final digest equals the reference's (it must: same state, bit for bit).

What happened is read from the workers' structured events (core/events.py), not from their output.
The full logs go to demo-out/.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from core.events import EVENTS_DIR_ENV, read_events

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "demo-out"
STEPS, EVERY, KILL_AT = 60, 10, 25
SHOWN = re.compile(r"^(worker |resumed from|final_digest=|step=\d*[05] )|rendezvous: node|embedded etcd at|Worker group"
                   r"|restart worker group")


def launch(name: str, ckpt_dir: Path, kill_at: int | None) -> dict[str, object]:
    cmd = [
        sys.executable, "-m", "elastic.launcher", "--nproc-per-node", "2", "--max-restarts", "3",
        str(REPO / "examples" / "train_tiny.py"),
        "--steps", str(STEPS), "--ckpt-dir", str(ckpt_dir), "--ckpt-every", str(EVERY), "--snapshot-every", "1",
        "--step-sleep", "0.05",
    ]
    print(f"\n=== {name}: elastic-run --nproc-per-node 2 examples/train_tiny.py --steps {STEPS} --ckpt-every {EVERY} "
          "--snapshot-every 1")
    events_dir = OUT / f"{name}-events"  # what happened, from the workers' structured events
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO", EVENTS_DIR_ENV: str(events_dir)}
    killed: int | None = None
    started = time.monotonic()
    with open(OUT / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if SHOWN.search(line.strip()):
                    print(f"  {line.strip()[:160]}")
                if kill_at is None or killed is not None:
                    continue
                events = read_events(str(events_dir))
                victim = [e["pid"] for e in events if e["event"] == "worker_started" and e.get("rank") == 1]
                done = max((e["step"] for e in events if e["event"] == "step"), default=0)
                if victim and done >= kill_at:
                    print(f"  >>> demo: SIGKILL worker rank 1 (pid {victim[-1]}) after step {done}")
                    os.kill(victim[-1], signal.SIGKILL)
                    killed = done
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:  # interrupted (or too slow): the agent stops its workers and cleans up
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.communicate(timeout=30)  # read what it still prints: a full pipe would block it
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    events = read_events(str(events_dir))
    # The replaced rank 1 (restart >= 1): where it resumed from and which tier it read.
    resumed = [e["step"] for e in events if e["event"] == "resumed" and e.get("rank") == 1 and e.get("restart")]
    tiers = [e["tier"] for e in events if e["event"] == "restored" and e.get("rank") == 1 and e.get("restart")]
    digests = [e["digest"] for e in events if e["event"] == "final_digest" and e.get("rank") == 0]
    rank0 = sorted({e["pid"] for e in events if e["event"] == "step" and e.get("rank") == 0})
    return {
        "killed": killed,
        "resumed_from": resumed[0] if resumed else None,
        "tier": {"memory": "tier 0, host memory", "local": "tier 1, disk", "own": "its own tier-0 snapshot",
                 "peer": "a peer's memory"}.get(tiers[0], tiers[0]) if tiers else None,
        "digest": digests[-1] if digests else None,
        "warm_spare": any(e.get("warm_spare") for e in events if e["event"] == "restart"),
        "rank0_pids": rank0,
        "reformed": [e["step"] for e in events if e["event"] == "reformed" and e.get("rank") == 0],
        "exit_code": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
    }


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> int:
    # The job runs in a session of its own (a Ctrl-C reaches only this script): a SIGTERM or SIGHUP (a closed
    # terminal) to this script stops it too, as a Ctrl-C does, through its agent (launch's finally).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # under nohup, SIGHUP stays ignored
            signal.signal(sig, _interrupt)
    try:
        return _demo()
    except KeyboardInterrupt:
        print("\ndemo: interrupted; its job was stopped", file=sys.stderr)
        return 130


def _demo() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    reference = launch("reference", OUT / "ckpt-reference", kill_at=None)
    faulty = launch("with-kill", OUT / "ckpt-with-kill", kill_at=KILL_AT)
    same = reference["digest"] is not None and reference["digest"] == faulty["digest"]
    print("\n=== summary")
    print(f"  reference run : exit {reference['exit_code']}, {reference['seconds']}s, "
          f"final_digest={reference['digest']}")
    print(f"  killed run    : exit {faulty['exit_code']}, {faulty['seconds']}s, final_digest={faulty['digest']}")
    print(f"  fault         : SIGKILL of worker rank 1 after step {faulty['killed']}")
    by = "its node's warm spare" if faulty["warm_spare"] else "a new process"
    print(f"  recovery      : rank 1 replaced by {by}, "
          f"resumed from step {faulty['resumed_from']} ({faulty['tier']}); rank 0 kept pid "
          f"{faulty['rank0_pids']} and re-formed in place at step {faulty['reformed']}")
    print(f"  digests equal : {same}")
    print(f"  logs          : {OUT}/")
    ok = same and faulty["killed"] is not None and faulty["resumed_from"] is not None and faulty["exit_code"] == 0
    print("  DEMO PASSED" if ok else "  DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
