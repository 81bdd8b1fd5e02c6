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

The agent side is `Spare` (spawn, prepare, take, stop); the process side is this module's `main`
(`python -m elastic.spare --control-fd N`), which imports torch, then reads two JSON lines on the control pipe:
`prepare` (the worker's interpreter arguments and environment, and whether to warm up: import the script's
modules and make the device context) and the order. The launcher spawns one per local worker before its own
imports (elastic/prestart.py) and the agent prepares them once it knows the command line, so the two torch
imports overlap; a job's first workers are prepared without the warm-up (nothing is imported before the rank
variables are set), a joining node's and the spares with it.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import io
import json
import logging
import os
import runpy
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from core import premap
from core.heap import imports_without_gc
from core.tier0_dir import ENV as TIER0_ENV
from elastic.progress import ENV_DIR as ENV_PROGRESS_DIR

log = logging.getLogger(__name__)

ENV_CUDA_DEVICE = "ELASTIC_SPARE_CUDA_DEVICE"
"""Set by the agent where it knows which device the spare's worker will use (one worker per node)."""


# Parts of torch that common calls import on first use: a torch.optim optimizer's constructor,
# torch.use_deterministic_algorithms and torch.compile load dynamo and inductor's config (1.1-2.8 s of CPU
# here). Imported ahead by every process this module starts, a job's first workers too: inductor's config
# then reads its TORCHINDUCTOR_* variables from the launcher's environment, not from a script's own code.
_LAZY_TORCH_MODULES = ("torch._dynamo", "torch._inductor.config", "torch.profiler")


@dataclass(frozen=True)
class Target:
    """What a worker's interpreter runs: a script path or a module, with the script's own arguments."""

    kind: str  # "path" or "module"
    name: str
    argv: tuple[str, ...]

    @staticmethod
    def parse(interpreter_args: Sequence[str]) -> Target | None:
        """torchrun's worker command line after the interpreter (`-u script.py ...` or `-u -m mod ...`);
        None for any other form, which a spare cannot run."""
        args = list(interpreter_args)
        while args and args[0] == "-u":
            args.pop(0)
        if len(args) >= 2 and args[0] == "-m":
            return Target("module", args[1], tuple(args[2:]))
        if args and not args[0].startswith("-"):
            return Target("path", args[0], tuple(args[1:]))
        return None


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
            proc = subprocess.Popen([entrypoint, "-u", "-m", "elastic.spare", "--control-fd", str(read_end)],
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
        self.args = ["elastic.spare", "--forked"]
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


# -- the spare process ------------------------------------------------------------------------------


def _top_level_imports(path: str) -> list[str]:
    """The absolute imports at the top level of a script (not those inside functions or `if` blocks)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def warm_torch() -> None:
    """What every worker imports first, before the spare knows its script: torch, torch.distributed, and the parts
    of torch that common calls load on first use (a torch.optim optimizer's constructor loads dynamo and inductor's
    config: 1.1-1.3 s of CPU here)."""
    import importlib

    import torch  # noqa: F401
    import torch.distributed  # noqa: F401 - the process group machinery every worker loads

    for name in _LAZY_TORCH_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optional part of this torch build
            log.debug("spare: pre-importing %s failed (%s)", name, exc)


def _script_path(target: Target) -> str:
    """sys.path[0] as `python script.py` (the script's directory) or `python -m module` (the cwd) sets it."""
    return os.path.dirname(os.path.abspath(target.name)) if target.kind == "path" else os.getcwd()


def warm(target: Target) -> dict[str, float]:
    """The rest of a spare's warm-up, off the critical path: the script's top-level imports (best effort: a module
    that fails here is imported again by the script, which then shows the error), and the CUDA context where the
    agent named the device. Returns when each part began (time.time(): `imports_at`, `cuda_at`),
    for the `spare_ready` event: a part that runs beside the training (a second CUDA context) can be told apart in
    a benchmark's steps."""
    import importlib

    import torch

    began = {"imports_at": round(time.time(), 3)}
    sys.path[0] = _script_path(target)
    if target.kind == "path":
        modules = _top_level_imports(target.name)
    else:
        modules = [target.name.rpartition(".")[0]] if "." in target.name else []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the script's own import will raise it where it belongs
            log.debug("spare: pre-importing %s failed (%s); the script imports it itself", name, exc)
    device = os.environ.get(ENV_CUDA_DEVICE)
    if device is not None and torch.cuda.is_available():
        began["cuda_at"] = round(time.time(), 3)
        torch.cuda.set_device(int(device))
        _warm_cuda(torch.device("cuda", int(device)))
    return began


class SlotMapper:
    """Maps and page-locks the node's tier-0 slot files for the worker this spare may become, which restores from
    them and snapshots into them at once (core/premap.py; only where the script's imports loaded ckpt). A thread
    that looks again every `interval_s` until `stop`: a spare warmed up with a job's first workers is ready
    before they make their slots. Each mapping is told in a `spare_premapped` event (when, for benchmarks)."""

    def __init__(self, root: Path, *, pin: bool, interval_s: float = 1.0) -> None:
        self.root, self.pin, self.interval_s = root, pin, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spare-premap", daemon=True)

    def start(self) -> SlotMapper:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop looking, and wait (bounded) for a mapping in progress: the worker then takes what is mapped."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("spare: mapping the tier-0 slots ahead is still running after %g s; the worker maps what "
                        "it needs itself", timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                mapped = premap.add(self.root, pin=self.pin) if self.root.is_dir() else 0
            except Exception as exc:  # noqa: BLE001 - the worker maps them itself
                log.debug("spare: mapping the tier-0 slots ahead failed (%s)", exc)
                return
            if mapped:
                from core.events import emit

                emit("spare_premapped", pid=os.getpid(), bytes=mapped)
            self._stop.wait(self.interval_s)


def _warm_cuda(device: Any) -> None:
    """The device context, the BLAS handles and the kernels most training steps use (CUDA loads each kernel on
    its first launch): one tiny bf16 step. Draws nothing from the random generators a restore sets."""
    import torch
    from torch import nn

    # cuBLAS reads its workspace setting once, at its first handle: here, before the script's own setting could
    # apply. ":4096:8" is what a deterministic script sets (torch's default size on Hopper, too).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    x = torch.linspace(-1, 1, 8 * 16 * 64, device=device).reshape(8, 16, 64)
    layers = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(device)
    optimizer = torch.optim.AdamW(layers.parameters(), fused=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        h = layers(x)
        h = nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)
        loss = nn.functional.cross_entropy(h.flatten(0, 1), torch.zeros(8 * 16, dtype=torch.long, device=device))
    loss.backward()
    nn.utils.clip_grad_norm_(layers.parameters(), 1.0)
    optimizer.step()
    torch.cuda.synchronize(device)


def _redirect(fd: int, path: str | None) -> None:
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


# This package's top-level names: a script's own package of the same name (a `core/` beside it) must win over
# the one this process imported for itself, as it would in `python script.py`.
_OURS = ("core", "elastic", "ckpt", "trainer", "chaos")


def _origin(module: Any) -> list[str]:
    return [os.path.realpath(p) for p in (getattr(module, "__path__", None) or [getattr(module, "__file__", "")])]


def _unshadow() -> None:
    """Forget this package's modules where the worker's sys.path finds another module of that name first."""
    from importlib.machinery import PathFinder

    for name in _OURS:
        module = sys.modules.get(name)
        spec = PathFinder.find_spec(name, sys.path) if module is not None else None
        if spec is None:
            continue  # not ours loaded, or nothing of that name on the script's path: nothing to shadow
        found = [os.path.realpath(p) for p in (spec.submodule_search_locations or [spec.origin or ""])]
        if found != _origin(module):
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]


def become(order: dict[str, Any], set_by_imports: dict[str, str]) -> None:
    """Turn this process into the worker the order describes and run its script as `__main__`. Its environment
    is the order's, plus what the warm-up's imports of the script's modules set (as they would have in the
    script's own process)."""
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    os.environ.update(set_by_imports)
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(1, order.get("stdout"))
    _redirect(2, order.get("stderr"))
    target = Target.parse(order["args"])
    if target is None:
        raise ValueError(f"spare: cannot run the worker command line {order['args']!r}")
    sys.path[0] = _script_path(target)
    _unshadow()
    sys.argv = [target.name, *target.argv]
    if target.kind == "path":
        runpy.run_path(target.name, run_name="__main__")
    else:
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)


def _set_threads_from_env() -> None:
    """torch's intra-op threads as OMP_NUM_THREADS says (torchrun sets 1 for several workers a node): torch read the
    variable when it loaded, before the worker's environment was known (in the launcher, for a forked spare)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def _forked_child(control_fd: int, write_end: int, pipes: Sequence[IO[bytes]], env: dict[str, str]) -> NoReturn:
    """The child side of `Spare.fork`: its siblings' pipes closed, a session of its own (torch signals a worker's
    process group), stdio unbuffered as `python -u` has it, then `serve`; it never returns into the launcher's code."""
    code = 1
    try:
        os.close(write_end)
        for pipe in pipes:
            pipe.close()  # nothing buffered in them yet: closes this copy's descriptor
        os.setsid()
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            raw = io.FileIO(fd, "w", closefd=False)
            raw.name = f"<{name}>"  # as Python names its standard streams
            unbuffered = io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True)
            unbuffered.mode = "w"  # type: ignore[misc]
            setattr(sys, name, unbuffered)
            setattr(sys, f"__{name}__", unbuffered)
        os.environ.clear()
        os.environ.update(env)
        code = serve(control_fd)
    except BaseException:  # noqa: BLE001 - reported as Python would, then the exit below
        sys.excepthook(*sys.exc_info())
    finally:
        _exit_as_python_does(code)


def _exit_as_python_does(code: int) -> NoReturn:
    """What an interpreter does when its main module ends (wait for non-daemon threads, run atexit handlers, flush),
    then leave without unwinding into the launcher's frames this process was forked from. Unlike a spawned worker's
    exit, the interpreter's finalization does not run: objects' finalizers at shutdown, C-level exit handlers and
    C++ static destructors (a native profiler that writes its file from one: use a spawned worker,
    ELASTIC_PRESTART_SPAWN=1)."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()  # noqa: SLF001 - the worker's own handlers (a logger's flush, a tracker's finish)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv: Sequence[str]) -> int:
    """`python -m elastic.spare --control-fd N` (Spare.spawn): see `serve`."""
    parser = argparse.ArgumentParser(prog="python -m elastic.spare")
    parser.add_argument("--control-fd", type=int, required=True, help="the agent's pipe (Spare.spawn)")
    args = parser.parse_args(argv)
    return serve(args.control_fd)


def serve(control_fd: int) -> int:
    """Two messages on the control pipe, one JSON line each: `prepare` (the worker's interpreter arguments, the
    environment, whether to warm up), then the order (`become`). End-of-file before either: exit quietly."""
    control = os.fdopen(control_fd, "rb")

    def message() -> dict[str, Any] | None:
        line = control.readline()
        return json.loads(line) if line else None  # None: dismissed, or the agent is gone

    started = time.monotonic()
    with imports_without_gc():
        warm_torch()
    prepare = message()
    if prepare is None:
        return 0
    target = Target.parse(prepare["args"])
    if target is None:
        sys.stderr.write(f"elastic.spare: cannot run the worker command line {prepare['args']!r}\n")
        return 2
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in prepare["env"].items()})
    _set_threads_from_env()
    mapper: SlotMapper | None = None
    if prepare.get("warm", True):
        before = dict(os.environ)
        with imports_without_gc():
            began = warm(target)
        set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
        from core.events import emit

        # For people and benchmarks: it is warm, and when each part of its warm-up began.
        emit("spare_ready", warm_s=round(time.monotonic() - started, 3), **began)
        if "cuda_at" in began and (root := os.environ.get(TIER0_ENV)):  # page-locked slots serve a CUDA worker
            mapper = SlotMapper(Path(root), pin=True).start()
    else:
        set_by_imports = {}
    if directory := os.environ.get(ENV_PROGRESS_DIR):
        with open(os.path.join(directory, f"spare_ready_{os.getpid()}"), "w"):
            pass  # for the agent (Spare.warm)
    order = message()
    control.close()  # not the worker's
    if mapper is not None:
        mapper.stop()
    if order is None:
        return 0
    try:
        become(order, set_by_imports)
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except BaseException:  # noqa: BLE001 - the worker's uncaught error, reported as Python would
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
