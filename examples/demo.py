"""`make demo`: a real kill and a real resume, on a private etcd, in about a minute.

1. An uninterrupted reference run of examples/train_tiny.py under elastic-run (2 workers).
2. The same job again; when rank 1 has passed step KILL_AT, this script SIGKILLs it by pid.
   The elastic agent restarts the worker group, the job resumes from its newest checkpoint,
   and finishes.
3. A summary: the kill, the restart, the step it resumed from, and whether the final digest
   equals the reference's (it must: same state, bit for bit).

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

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "demo-out"
STEPS, EVERY, KILL_AT = 60, 10, 25
SHOWN = re.compile(r"^(worker |resumed from|final_digest=|step=\d*[05] |fault:)|rendezvous: node|embedded etcd at|Worker group|restart worker group")


def launch(name: str, ckpt_dir: Path, kill_at: int | None) -> dict[str, object]:
    cmd = [
        sys.executable, "-m", "elastic.launcher", "--nproc-per-node", "2", "--max-restarts", "3",
        str(REPO / "examples" / "train_tiny.py"),
        "--steps", str(STEPS), "--ckpt-dir", str(ckpt_dir), "--ckpt-every", str(EVERY), "--step-sleep", "0.05",
    ]
    print(f"\n=== {name}: elastic-run --nproc-per-node 2 examples/train_tiny.py --steps {STEPS} --ckpt-every {EVERY}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
    result: dict[str, object] = {"killed": None, "resumed_from": None, "digest": None, "restarts": 0}
    workers: dict[int, int] = {}
    started = time.monotonic()
    with open(OUT / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                text = line.strip()
                if m := re.match(r"worker rank=(\d+) world=\d+ pid=(\d+) restart=(\d+)", text):
                    workers[int(m[1])] = int(m[2])
                    result["restarts"] = max(int(result["restarts"]), int(m[3]))  # type: ignore[call-overload]
                if m := re.match(r"resumed from step (\d+)", text):
                    result["resumed_from"] = int(m[1])
                if m := re.match(r"final_digest=(\w+)", text):
                    result["digest"] = m[1]
                if SHOWN.search(text):
                    print(f"  {text[:160]}")
                step = re.match(r"step=(\d+) ", text)
                if kill_at is not None and result["killed"] is None and step and int(step[1]) >= kill_at and 1 in workers:
                    victim = workers[1]
                    print(f"  >>> demo: SIGKILL worker rank 1 (pid {victim}) after step {step[1]}")
                    os.kill(victim, signal.SIGKILL)
                    result["killed"] = int(step[1])
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result["exit_code"] = proc.returncode
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    reference = launch("reference", OUT / "ckpt-reference", kill_at=None)
    faulty = launch("with-kill", OUT / "ckpt-with-kill", kill_at=KILL_AT)
    same = reference["digest"] is not None and reference["digest"] == faulty["digest"]
    print("\n=== summary")
    print(f"  reference run : exit {reference['exit_code']}, {reference['seconds']}s, final_digest={reference['digest']}")
    print(f"  killed run    : exit {faulty['exit_code']}, {faulty['seconds']}s, final_digest={faulty['digest']}")
    print(f"  fault         : SIGKILL of worker rank 1 after step {faulty['killed']}")
    print(f"  recovery      : worker group restarted {faulty['restarts']} time(s), resumed from step {faulty['resumed_from']}")
    print(f"  digests equal : {same}")
    print(f"  logs          : {OUT}/")
    ok = same and faulty["killed"] is not None and faulty["resumed_from"] is not None and faulty["exit_code"] == 0
    print("  DEMO PASSED" if ok else "  DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
