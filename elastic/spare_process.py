"""A warm spare's own process (the agent's side, and what a spare is for: elastic/spare.py).

`python -m elastic.spare_process --control-fd N` (or a child forked by the launcher, `_forked_child`) imports
torch and the parts of it common calls load, then `serve`s its control pipe: `prepare` (the worker's command
line and environment; with `warm`, the script's top-level imports, the CUDA context and a tiny step where
the agent named the device, and the node's tier-0 slots mapped once they exist: `SlotMapper`), then the
order, which `become`s the worker: the script run as `__main__` as `python script.py` / `python -m module`
would run it. End-of-file on the pipe before the order: the spare exits quietly.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import logging
import os
import runpy
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, NoReturn

from core import premap
from core.heap import imports_without_gc
from core.numbers import decimal
from core.tier0_dir import ENV as TIER0_ENV
from elastic import fast_exit, stop_signals
from elastic.fast_exit import KILLED_BY_SIGINT
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
    # A fresh interpreter's own torch seed: a forked one has the launcher's, the same in every worker of the node
    # (unseeded dropout masks, augmentation and DataLoader worker seeds alike on every rank). CPU only: a fresh
    # process's CUDA generators start from torch's fixed default, which the warm-up did not touch.
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()
    if target.kind == "path":
        # `python sub/train.py` gives the script an absolute __file__ (Python 3.9+); sys.argv[0] stays as given.
        runpy.run_path(os.path.abspath(target.name), run_name="__main__")
    else:
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)


def _set_threads_from_env() -> None:
    """torch's intra-op threads as OMP_NUM_THREADS says (torchrun sets 1 for several workers a node): torch read the
    variable when it loaded, before the worker's environment was known (in the launcher, for a forked spare)."""
    value = decimal(os.environ.get("OMP_NUM_THREADS", ""))
    if value and value <= 1 << 16:  # more overflowed torch's C int: every warm worker died (plain torch ignores it)
        import torch

        torch.set_num_threads(value)


def _forked_child(control_fd: int, write_end: int, pipes: Sequence[IO[bytes]], env: dict[str, str]) -> NoReturn:
    """The child side of `Spare.fork`: its siblings' pipes closed, a session of its own (torch signals a worker's
    process group), stdio unbuffered as `python -u` has it, then `serve`; it never returns into the launcher's code."""
    code = 1
    try:
        stop_signals.restore()  # a worker's handlers, as a fresh interpreter has them (the launcher's are its own)
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
        # Never unwinds into the launcher's frames this process was forked from; nor does the interpreter's
        # finalization run (a native profiler that writes its file from a C++ static destructor: use a spawned
        # worker, ELASTIC_PRESTART_SPAWN=1).
        fast_exit.exit_as_python_does(code)


def main(argv: Sequence[str]) -> int:
    """`python -m elastic.spare_process --control-fd N` (Spare.spawn): see `serve`."""
    parser = argparse.ArgumentParser(prog="python -m elastic.spare_process")
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
        sys.stderr.write(f"elastic.spare_process: cannot run the worker command line {prepare['args']!r}\n")
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
    ready = None
    if directory := os.environ.get(ENV_PROGRESS_DIR):
        ready = os.path.join(directory, f"spare_ready_{os.getpid()}")
        with open(ready, "w"):
            pass  # for the agent (Spare.warm)
    order = message()
    control.close()  # not the worker's
    if ready is not None:  # read by the agent until it sent its order or dismissed it: one file per spare was left
        with contextlib.suppress(OSError):
            os.unlink(ready)
    if mapper is not None:
        mapper.stop()
    if order is None:
        return 0
    try:
        become(order, set_by_imports)
    except SystemExit as exc:
        if not (exc.code is None or isinstance(exc.code, int)):
            print(exc.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return fast_exit.code_of(exc.code)
    except KeyboardInterrupt as exc:
        _report(exc)
        return KILLED_BY_SIGINT  # as Python ends on an uncaught KeyboardInterrupt
    except BaseException as exc:  # noqa: BLE001 - the worker's uncaught error, reported as Python would
        _report(exc)
        return 1
    return 0


def _report(exc: BaseException) -> None:
    """The script's uncaught `exc` through sys.excepthook, its traceback from the script's own frames on (the
    hook prints the exception's own traceback, whatever it is passed)."""
    exc.__traceback__ = _script_traceback(exc.__traceback__)
    sys.excepthook(type(exc), exc, exc.__traceback__)


_THIS_FILE = os.path.abspath(__file__)


def _script_traceback(tb: TracebackType | None) -> TracebackType | None:
    """`tb` from the script's own frames on, as `python train.py` prints it: this module's and runpy's are not
    the user's."""
    def ours(frame: FrameType) -> bool:  # runpy's frames may be named "<frozen runpy>"
        return os.path.abspath(frame.f_code.co_filename) == _THIS_FILE or frame.f_globals.get("__name__") == "runpy"

    while tb is not None and tb.tb_next is not None and ours(tb.tb_frame):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    if code == KILLED_BY_SIGINT:
        fast_exit.end(code)
    sys.exit(code)
