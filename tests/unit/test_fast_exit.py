"""A worker that ends without the interpreter's finalization (elastic/fast_exit.py: a survivor of an in-place
re-formation, whose kept gloo groups' threads can abort Python's finalization) ends as Python would otherwise:
the same exit code and output, its atexit handlers run (registered before and after) and its non-daemon threads
waited for; only the finalization is left out. Each case also runs without it, as the reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, threading, time
    from elastic import fast_exit
    atexit.register(print, "handler registered first", flush=True)

    class Finalized:
        def __del__(self, write=os.write):  # bound now: the os module may be gone when this runs
            write(1, b"finalized\\n")

    keep = Finalized()  # a module global: freed by the interpreter's finalization
    if sys.argv[1] == "skip":
        fast_exit.end_without_finalization()
    atexit.register(print, "handler registered last", flush=True)

    def late():
        time.sleep(0.2)
        print("thread done", flush=True)

    threading.Thread(target=late).start()
    ENDING
    """
)

ENDINGS = {
    "returns": ("pass", 0, ""),
    "sys.exit(3)": ("sys.exit(3)", 3, ""),
    "sys.exit(message)": ("sys.exit('bye now')", 1, "bye now"),
    "exception": ("raise ValueError('boom')", 1, "ValueError: boom"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", -int(signal.SIGINT), "KeyboardInterrupt"),
    "exit(2)": ("exit(2)", 2, ""),  # the builtin, as a script may call it
    "sys.exit(-2)": ("sys.exit(-2)", 254, ""),  # a status, not a death by SIGINT
    "sys.exit on a thread": ("t = threading.Thread(target=sys.exit, args=(5,)); t.start(); t.join()", 0, ""),
}


def _run(mode: str, ending: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", SCRIPT.replace("ENDING", ending), mode], env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("case", list(ENDINGS))
def test_an_end_without_finalization_keeps_the_exit_code_output_handlers_and_threads(case: str) -> None:
    ending, code, stderr = ENDINGS[case]
    python, ours = _run("python", ending), _run("skip", ending)
    for out in (python, ours):
        assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
        assert stderr in out.stderr, out.stderr
        lines = out.stdout.splitlines()
        assert lines[:3] == ["thread done", "handler registered last", "handler registered first"], out.stdout
    assert "finalized" in python.stdout  # the reference: Python's finalization freed the global
    assert "finalized" not in ours.stdout, ours.stdout


GATE = textwrap.dedent(
    """
    import json, os, sys, threading
    from elastic import fast_exit
    from trainer import regroup
    seen = []

    def check(what):
        seen.append([what, threading._shutdown is fast_exit._shutdown_then_end])

    regroup.end_without_finalization_if_kept()
    check("in-process, no old group kept")
    regroup._kept = 1  # as _destroy_default_group after a re-formation
    mode = os.environ.pop("ELASTIC_REFORM")
    regroup.end_without_finalization_if_kept()
    check("an old group kept, not in-process")
    os.environ["ELASTIC_REFORM"] = mode
    regroup.end_without_finalization_if_kept()
    check("in-process, an old group kept")
    print(json.dumps(seen), flush=True)
    """
)


def test_only_a_process_that_kept_an_old_group_under_in_process_re_formation_ends_without_finalization(
    tmp_path: Path,
) -> None:
    # Anywhere else (the pytest process, a plain script, a worker that never re-formed) Python's exit stays.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "ELASTIC_REFORM": "in-process", "ELASTIC_PROGRESS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", GATE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [
        ["in-process, no old group kept", False], ["an old group kept, not in-process", False],
        ["in-process, an old group kept", True]], out.stdout
