"""The node's worker interpreters, made from the launcher before anything else it does.

`elastic-run` imports torch (its agent is torch's) before it can start a worker, and each worker then
imports torch again: two imports of 1.5-3 s, one after the other, before a node's first step. A node
that joins a running job pays both while it is the one everybody waits for (issue K: ≤ 3 s from the
joiner's agent start to its first step). So the launcher's first act is to import torch and fork one
interpreter per local worker from itself, and one more for the node's warm spare (elastic/spare.py
`Spare.fork`: the child imports the rest of what workers load, then waits), before it starts any thread
or connection; the agent then prepares them with the worker's command line and starts the node's first
workers through them, a joining node's after they are warm, and warms the spare up while a job's first
workers start. One torch import for the node: on a busy 2-core host a joiner's worker was warm 3.9-4.7 s
after the launcher's start against 6.7-7.7 s with interpreters spawned beside the launcher's import
(`ELASTIC_PRESTART_SPAWN=1`, the previous way), and 2.4-2.7 s against 3.7-3.8 s on an idle one.

This runs before argument parsing (torch's parser needs torch), so `begin` reads the few flags it needs
from the raw command line and starts nothing where the agent could not use the processes (warm spares
off, `--reform restart`, `--no-python`, a backend other than etcd-v3). Where it guessed wrong, the agent
dismisses them: `take` hands them over only for the number of local workers the agent starts, and the
launcher kills unprepared ones on its way out (`dismiss`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from core.numbers import decimal
from elastic.spare import Spare, stop_all

ENV_WARM_SPARE = "ELASTIC_WARM_SPARE"
"""The default of --warm-spare where the flag is not given ("0" turns it off: test suites, tight hosts)."""

ENV_PRESTART = "ELASTIC_PRESTART"
"""`0` keeps the launcher from starting its workers' interpreters before its own imports."""

_MAX_WORKERS = 64
_BACKEND = "etcd-v3"

_spares: list[Spare] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_spares.clear)  # a forked worker holds none of its siblings

ENV_SPAWN = "ELASTIC_PRESTART_SPAWN"
"""`1`: spawn fresh interpreters (each imports torch, beside the launcher's import) instead of forking them from
the launcher once it has imported torch (one torch import for the node). For A/B runs."""


def warm_spare_default(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(ENV_WARM_SPARE, "1").lower() not in ("0", "off", "false", "no")


def _flags(argv: Sequence[str]) -> dict[str, str]:
    """`--name value` and `--name=value` pairs and bare `--name` flags (value ""), underscores as dashes. Reads
    the whole line: a script argument that looks like a launcher flag only makes a wrong guess, which `take`
    corrects."""
    found: dict[str, str] = {}
    args = list(argv)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            value = "" if nxt.startswith("-") else nxt
        found.setdefault(name, value)
    return found


def planned_workers(argv: Sequence[str], environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """How many worker interpreters to start ahead for this command line; 0 where the agent would not use them.
    Mirrors the launcher's defaults (elastic/launcher.py `_plan`) closely enough to avoid waste."""
    flags = _flags(argv)
    if (environ.get(ENV_PRESTART, "1") == "0" or "--help" in flags or "-h" in argv or "--no-python" in flags
            or "--numa-binding" in flags
            or flags.get("--reform") == "restart" or "--no-warm-spare" in flags
            or ("--warm-spare" not in flags and not warm_spare_default(environ))):
        return 0
    backend = flags.get("--rdzv-backend")
    if backend is not None and backend != _BACKEND:
        return 0
    nnodes = flags.get("--nnodes", "1")
    fixed_multi_node = (decimal(nnodes) or 0) > 1
    if (backend is None and "--rdzv-endpoint" not in flags and "--standalone" not in flags
            and (fixed_multi_node or "--master-port" in flags)):
        return 0  # torchrun's static rendezvous: restarts only
    nproc = decimal(flags.get("--nproc-per-node", "1"))
    if nproc is None or not 0 < nproc <= _MAX_WORKERS:
        return 0  # "auto", "gpu", ...: the agent works it out with torch
    return nproc


def begin(argv: Sequence[str]) -> None:
    """Start the worker interpreters this command line will want (see `planned_workers`). Call it first thing,
    before anything else is imported or started (a forked interpreter is a copy of this process)."""
    count = planned_workers(argv)
    if count == 0 or _spares:
        return
    if count > 1:
        # What torchrun sets for several workers a node (its launcher too, a moment later): here, before torch and
        # numpy load in this process, since forked workers keep the thread settings they loaded with.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    env = dict(os.environ)
    try:
        for _ in range(count + 1):  # the last: the node's warm spare, warm before the first step (`take`)
            _spares.append(Spare.spawn(sys.executable, env) if os.environ.get(ENV_SPAWN) == "1"
                           else Spare.fork(env, siblings=_spares))
    except OSError:
        dismiss()  # the agent starts its workers itself


def take(count: int) -> tuple[list[Spare], Spare | None]:
    """The worker interpreters started ahead, if there are `count` of them alive, and the one started with them for
    the node's warm spare (None if it is gone); otherwise none (and those are ended). The agent warms that spare up
    while its first workers start, not beside their first steps: its CUDA context and warm-up step then cost the
    training nothing (on one H200 they slowed 8 steps by 5-12 ms each when made after the first step)."""
    spares = list(_spares)
    _spares.clear()
    workers, extra = (spares[:count], spares[count:]) if count >= 0 else ([], spares)
    if count <= 0 or len(workers) != count or len(extra) > 1 or not all(s.alive() for s in workers):
        stop_all(spares)
        return [], None
    spare = extra[0] if extra and extra[0].alive() else None
    if extra and spare is None:
        stop_all(extra)
    return workers, spare


def dismiss() -> None:
    """End the interpreters nobody took (a launcher that failed or exited before its agent started workers)."""
    take(-1)

