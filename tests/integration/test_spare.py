"""elastic/spare.py: a warm spare process becomes the worker its order describes.

One real spare (Python + torch + the script's imports, then the order over its stdin pipe), the real
script run as `__main__`: its environment is the order's (not the one it warmed up in), its arguments are
the order's, its output goes to the order's log files (appended, as torch's log files for that rank),
its exit status is the script's. The command-line forms a spare can and cannot run are unit-checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.spare import Spare, can_run
from elastic.spare_process import Target, _top_level_imports

pytestmark = pytest.mark.integration

SCRIPT = '''
import json, os, sys
import helper_module_of_the_script  # found beside the script, as `python script.py` would find it
from core import model_of_the_script  # the script's own `core` package, not the framework's of that name
stdin = os.fstat(0)
print("out:" + json.dumps({"argv": sys.argv[1:], "rank": os.environ.get("RANK"),
                           "warm_only": os.environ.get("ONLY_WHILE_WARMING"), "name": __name__,
                           "helper_preloaded": helper_module_of_the_script.LOADED_BEFORE_ORDER,
                           "set_by_helper": os.environ.get("SET_BY_HELPER"), "own_core": model_of_the_script.OWN,
                           "stdin": [stdin.st_dev, stdin.st_ino]}))
print("err line", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
'''

HELPER = '''
import os
LOADED_BEFORE_ORDER = os.environ.get("RANK") is None
os.environ["SET_BY_HELPER"] = "yes"  # a module that sets what the script's process then runs with
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["started", "spawned-then-prepared", "prepared-without-warm-up"])
def test_a_spare_runs_the_order_it_is_given(tmp_path: Path, how: str) -> None:
    """started: a warm spare; spawned-then-prepared: spawned before the command line is known (the launcher's
    elastic/prestart.py), prepared later; prepared-without-warm-up: a job's first worker, nothing imported ahead."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "helper_module_of_the_script.py").write_text(HELPER)
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "model_of_the_script.py").write_text("OWN = True\n")
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    stdout.write_text("the dead worker's last line\n")
    progress = tmp_path / "progress"  # the agent's: a spare says it is warm there
    progress.mkdir()
    warm_env = {**os.environ, "ONLY_WHILE_WARMING": "1", "ELASTIC_PROGRESS_DIR": str(progress)}
    warm_env.pop("RANK", None)
    if how == "started":
        spare = Spare.start(sys.executable, ["-u", str(script), "--flag"], warm_env)
    else:
        spare = Spare.spawn(sys.executable, {**warm_env, "RANK": "7"})  # what prepare's environment replaces
        spare.prepare(["-u", str(script), "--flag"], warm_env, warm=how == "spawned-then-prepared")
    order_env = {k: v for k, v in warm_env.items() if k != "ONLY_WHILE_WARMING"} | {"RANK": "5"}
    spare.take(local_rank=1, interpreter_args=["-u", str(script), "--flag", "3"], env=order_env,
               stdout=str(stdout), stderr=str(stderr))
    assert spare.proc.wait(timeout=100) == 3  # the script's own exit status
    assert list(progress.glob("spare_ready_*")) == []  # one per spare ever started was left there

    lines = stdout.read_text().splitlines()
    assert lines[0] == "the dead worker's last line"  # appended, like the rank's log file
    out = json.loads(next(line for line in lines if line.startswith("out:"))[4:])
    ours = os.fstat(0)
    assert out == {"argv": ["--flag", "3"], "rank": "5", "warm_only": None, "name": "__main__",
                   "helper_preloaded": how != "prepared-without-warm-up", "set_by_helper": "yes", "own_core": True,
                   "stdin": [ours.st_dev, ours.st_ino]}  # the launcher's stdin, as torch's workers have
    assert "err line" in stderr.read_text()


def test_which_command_lines_a_spare_can_run(tmp_path: Path) -> None:
    assert Target.parse(["-u", "train.py", "--x", "1"]) == Target("path", "train.py", ("--x", "1"))
    assert Target.parse(["-u", "-m", "pkg.train", "--x"]) == Target("module", "pkg.train", ("--x",))
    assert Target.parse(["-c", "print(1)"]) is None
    assert Target.parse([]) is None
    assert can_run(sys.executable, ["-u", "train.py"])
    assert not can_run("/bin/true", ["-u", "train.py"])  # --no-python: a binary, not this interpreter
    assert not can_run(sys.executable, ["-c", "print(1)"])
    script = tmp_path / "s.py"
    script.write_text("import os\nfrom torch import nn\nfrom . import rel\ndef f():\n    import json\n")
    assert _top_level_imports(str(script)) == ["os", "torch"]  # not relative ones, not those inside functions
    assert _top_level_imports(str(tmp_path / "missing.py")) == []


@pytest.mark.timeout(60)
def test_a_spare_never_prepared_is_killed_at_once_and_one_dismissed_exits(tmp_path: Path) -> None:
    """A launcher that exits before its agent took its interpreters (bad flags, a failed start) ends them at once;
    a prepared spare that is dismissed reads end-of-file and exits by itself."""
    unprepared = Spare.spawn(sys.executable, dict(os.environ))
    unprepared.stop()
    assert unprepared.proc.returncode == -9  # killed while importing torch: it has run no user code
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit(9)\n")
    prepared = Spare.start(sys.executable, ["-u", str(script)], dict(os.environ))
    prepared.stop(timeout_s=50)
    assert prepared.proc.returncode == 0  # end-of-file before the order: dismissed, the script never ran


FORKED_SCRIPT = '''
import atexit, json, os, sys, threading, time
def at_exit():
    open(os.environ["MARKS"] + "/atexit", "w").close()
def late():
    time.sleep(0.5)
    open(os.environ["MARKS"] + "/thread", "w").close()
atexit.register(at_exit)
threading.Thread(target=late).start()  # not a daemon: the process waits for it, as at any exit
import torch
print("out:" + json.dumps({"argv": sys.argv[1:], "rank": os.environ.get("RANK"), "name": __name__,
                           "session_leader": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads()}))
if sys.argv[-1] == "interrupt":
    raise KeyboardInterrupt  # Python prints it, then ends killed by SIGINT (a shell sees 130, torch -2)
sys.exit(int(sys.argv[-1]))
'''

FORK_DRIVER = '''
import json, os, sys
from elastic.spare import Spare
script, out, marks = sys.argv[1:]
env = {**os.environ, "MARKS": marks}
first = Spare.fork(env)
second = Spare.fork(env, siblings=[first])
third = Spare.fork(env, siblings=[first, second])
third.stop()  # never prepared: killed at once (perhaps before it has a session of its own)
first.release()  # dismissed: it reads end-of-file although two were forked while first's pipe was open
first_code = first.proc.wait(timeout=60)
env["OMP_NUM_THREADS"] = "1"  # torchrun's for several workers a node; torch loaded in the driver without it
second.prepare(["-u", script], env, warm=True)
second.take(local_rank=0, interpreter_args=["-u", script, "--flag", "4"], env={**env, "RANK": "3"},
            stdout=out, stderr=out)
second_code = second.proc.wait(timeout=60)
fourth = Spare.fork(env)
fourth.prepare(["-u", script], env, warm=False)
fourth.take(local_rank=0, interpreter_args=["-u", script, "interrupt"], env={**env, "RANK": "4"},
            stdout=marks + "/fourth.log", stderr=marks + "/fourth.log")
print("driver:" + json.dumps({"first": first_code, "second": second_code, "third": third.proc.returncode,
                             "fourth": fourth.proc.wait(timeout=60)}))
'''


@pytest.mark.timeout(120)
def test_a_spare_forked_from_the_launcher_runs_its_order_and_exits_as_python_does(tmp_path: Path) -> None:
    """elastic/prestart.py forks the node's first interpreters from the launcher (one torch import): a forked spare
    is a session of its own (torch signals a worker's process group), runs the order's script as `__main__`, and
    ends as an interpreter does (non-daemon threads joined, atexit handlers run, the script's exit status); a
    sibling forked later does not keep an earlier one's control pipe open (a dismissed spare exits)."""
    script, out, marks = tmp_path / "job.py", tmp_path / "worker.log", tmp_path / "marks"
    script.write_text(FORKED_SCRIPT)
    marks.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.run([sys.executable, "-c", FORK_DRIVER, str(script), str(out), str(marks)], env=env,
                            cwd=str(repo), capture_output=True, text=True, timeout=100)
    assert driver.returncode == 0, driver.stdout + driver.stderr
    reports = [x for x in driver.stdout.splitlines() if x.startswith("driver:")]
    assert len(reports) == 1, driver.stdout  # only the driver: no child came back into the code it was forked from
    assert json.loads(reports[0][7:]) == {"first": 0, "second": 4, "third": -9, "fourth": -2}
    interrupted = (marks / "fourth.log").read_text()
    assert "KeyboardInterrupt" in interrupted and f'File "{script}", line' in interrupted, interrupted
    assert "spare_process" not in interrupted and "runpy" not in interrupted, interrupted  # the script's frames only
    line = next(x for x in out.read_text().splitlines() if x.startswith("out:"))
    assert json.loads(line[4:]) == {"argv": ["--flag", "4"], "rank": "3", "name": "__main__", "session_leader": True,
                                     "threads": 1}
    assert (marks / "atexit").exists() and (marks / "thread").exists()
