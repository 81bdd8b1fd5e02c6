"""Replacement workers, warm ones ahead of need: only the failed process restarts, and quickly.

A worker process that starts from nothing pays for Python, `import torch` and the device context
before it runs a line of the user's script: about 3.5 s of CPU here, about 3.6 s on an H200 host,
and every survivor of the job waits for it in the new process group. A *warm spare* pays that while
nothing waits: the agent starts it with a job's first workers (forked by the launcher with theirs,
elastic/prestart.py, and warmed up while they start) or, after a failure, once its workers train again;
it imports torch and the script's own top-level imports, creates the CUDA context where the node has one
worker, maps the node's tier-0 slots once they exist (`SlotMapper`), and then blocks reading
a pipe from the agent (its control pipe; its stdin stays the launcher's, as a worker's). When a worker
crashes, the agent writes the order (the crashed local rank's environment for the new round, its
arguments, its log files) on that pipe; the spare becomes that worker and runs the script as
`python script.py` / `python -m module` would (its sys.path, its own packages over ours of the same
name, its environment plus what its modules set while they were imported ahead). The same path, started on demand,
replaces a worker when no warm spare is ready (a cold spare).

The pipe is also the spare's lifeline: if the agent dies, the spare reads end-of-file and exits, so a
spare never outlives its agent.

What a user may notice: modules the script imports at its top level are imported before the rank
variables are set (RANK, WORLD_SIZE, ...), so a module that reads them *at import time* sees the
node's environment; such a script should read them in its main function or run with
`--no-warm-spare`. Likewise cuBLAS starts in the warm-up with `CUBLAS_WORKSPACE_CONFIG=:4096:8` unless
the launcher's environment sets it: a script that sets another value in its own code should set it in
the environment instead.

This module is the agent's side, `Spare` (spawn, fork, prepare, take, stop); the process side is
elastic/spare_process.py (`python -m elastic.spare_process --control-fd N`), which imports torch, then reads
two JSON lines on the control pipe:
`prepare` (the worker's interpreter arguments and environment, and whether to warm up: import the script's
modules and make the device context) and the order. The launcher spawns one per local worker before its own
imports (elastic/prestart.py) and the agent prepares them once it knows the command line, so the two torch
imports overlap; a job's first workers are prepared without the warm-up (nothing is imported before the rank
variables are set), a joining node's and the spares with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

from core.heap import imports_without_gc
from elastic.progress import ENV_DIR as ENV_PROGRESS_DIR
from elastic.spare_process import ENV_CUDA_DEVICE, Target, _forked_child

__all__ = ["ENV_CUDA_DEVICE", "Spare", "Target", "can_run", "stop_all"]


def can_run(entrypoint: object, interpreter_args: Sequence[str]) -> bool:
    """Whether a worker started as `entrypoint *interpreter_args` can be replaced through a spare: this
    interpreter (it must import elastic) running a script or a module."""
    if not isinstance(entrypoint, str) or Target.parse(interpreter_args) is None:
        return False
    try:
        return os.path.samefile(entrypoint, sys.executable)
    except OSError:
        return False


# -- the agent's side -----------------------------------------------------------------------------


class Spare:
    """One spare process, started by the agent; `take` turns it into a worker.

    The agent talks to it over a pipe of its own (`--control-fd`), not its stdin: the worker it becomes keeps the
    launcher's stdin, as torch's workers do (a `breakpoint()` under one worker reads the terminal)."""

    def __init__(self, proc: subprocess.Popen[bytes], control: IO[bytes]) -> None:
        self.proc = proc
        self.control = control
        self.prepared = False

    @staticmethod
    def spawn(entrypoint: str, env: dict[str, str]) -> Spare:
        """Start an interpreter that imports torch and waits for `prepare`: the launcher starts these before its
        own imports (elastic/prestart.py), when it does not know the worker's command line yet."""
        read_end, write_end = os.pipe()
        try:
            proc = subprocess.Popen([entrypoint, "-u", "-m", "elastic.spare_process", "--control-fd", str(read_end)],
                                    env=env, pass_fds=(read_end,), start_new_session=True)  # a session like torch's
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        return Spare(proc, os.fdopen(write_end, "wb"))

    @staticmethod
    def fork(env: dict[str, str], *, siblings: Sequence[Spare] = ()) -> Spare:
        """A spare forked from this process once it has imported torch: it skips the interpreter start and the torch
        import a spawned one pays (1.2-1.5 s of CPU here, per worker), which on a busy node is what a joining node
        waits for. For the launcher, before it starts any thread or connection of its own: the child is a copy of it
        (torch imported, no operation run, so no intra-op thread pool yet; numpy's OpenBLAS thread, started by the
        import, is stopped and restarted around a fork by OpenBLAS itself). Set the environment torch and numpy read
        when they load (OMP_NUM_THREADS) before the first call. `siblings`: spares forked before this one, whose
        control pipes the child must not hold open (each spare's pipe is its lifeline)."""
        with imports_without_gc():
            import torch  # noqa: F401 - the launcher's own import, made before the fork so its children share it

        sys.stdout.flush()  # else what the launcher left buffered is written again by each child
        sys.stderr.flush()
        pipes = [s.control for s in siblings]
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                _forked_child(read_end, write_end, pipes, env)
            finally:
                os._exit(1)  # never back into the launcher's frames
        os.close(read_end)
        return Spare(_ForkedProcess(pid), os.fdopen(write_end, "wb"))

    @staticmethod
    def start(entrypoint: str, interpreter_args: Sequence[str], env: dict[str, str]) -> Spare:
        """Start a spare that warms up for the worker command line `entrypoint *interpreter_args`.
        `env` is the environment it starts in (the workers' without the per-round variables)."""
        spare = Spare.spawn(entrypoint, env)
        spare.prepare(interpreter_args, env)
        return spare

    def prepare(self, interpreter_args: Sequence[str], env: dict[str, str], *, warm: bool = True) -> None:
        """Tell the spare the worker's command line and the environment it runs in. `warm`: also import the script's
        top-level modules, the parts of torch common calls load, the device context and the tier-0 mappings ahead
        (a spare, a joining node's worker); without, it only waits (a job's first worker: as `python script.py`,
        less the torch import). The first of two messages; `take` sends the other. Raises OSError if it is gone."""
        self._send({"args": [str(a) for a in interpreter_args], "env": env, "warm": warm})
        self.prepared = True

    def _send(self, message: dict[str, Any]) -> None:
        self.control.write((json.dumps(message) + "\n").encode())
        self.control.flush()

    def release(self) -> None:
        """Close the control pipe: a spare waiting for a message exits (the first step of `stop`)."""
        if not self.control.closed:
            try:
                self.control.close()
            except OSError:
                pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def warm(self) -> bool:
        """Whether it has finished warming up (it says so with a file in the agent's progress directory)."""
        directory = os.environ.get(ENV_PROGRESS_DIR)
        return bool(directory) and os.path.exists(os.path.join(str(directory), f"spare_ready_{self.pid}"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def take(self, *, local_rank: int, interpreter_args: Sequence[str], env: dict[str, str],
             stdout: str | None, stderr: str | None) -> Any:
        """Make this spare the worker `local_rank`: hand it the order. Returns the handler torch's process
        context polls and closes for that local rank (torch's SubprocessHandler, around this process).
        Raises OSError if it is gone."""
        if not self.prepared:
            self.prepare(interpreter_args, env)
        self._send({"args": list(interpreter_args), "env": env, "stdout": stdout or None, "stderr": stderr or None})
        self.release()  # the order is the last message
        return _adopt(self.proc, local_rank)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Dismiss an unused spare: end-of-file on its control pipe tells it to exit; a stuck one is killed. One
        never prepared has run no user code (it imports torch, or waits for `prepare`): it is killed at once."""
        self.release()
        try:
            self.proc.wait(timeout_s if self.prepared else 0)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:  # a forked one not yet in its own session (it calls setsid first thing)
            try:
                os.kill(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(5.0)


def stop_all(spares: Sequence[Spare], timeout_s: float = 5.0) -> None:
    """`stop` for several, their waits overlapping (each closes its pipe first)."""
    for spare in spares:
        spare.release()
    for spare in spares:
        spare.stop(timeout_s)


class _ForkedProcess(subprocess.Popen[bytes]):
    """A `Popen` for a child made by `os.fork`: torch's process context polls, signals, waits on and kills a
    Popen. The attributes are those Popen's own poll/wait/send_signal use; nothing is started here."""

    def __init__(self, pid: int) -> None:  # noqa: D107 - not Popen's __init__: the child exists already
        self.args = ["elastic.spare_process", "--forked"]
        self.pid = pid
        self.returncode: Any = None
        self.stdin = self.stdout = self.stderr = None
        self._child_created = True
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False


def _adopt(proc: subprocess.Popen[bytes], local_rank: int) -> Any:
    """torch's SubprocessHandler (what its process context polls and closes) around a running process."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    handler = SubprocessHandler.__new__(SubprocessHandler)
    handler._stdout = None  # noqa: SLF001 - the spare writes its log files itself
    handler._stderr = None  # noqa: SLF001
    handler.local_rank_id = local_rank
    handler.proc = proc
    return handler
