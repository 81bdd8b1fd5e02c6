"""`elastic-run`: torchrun's command line on the `etcd-v3` rendezvous.

It reuses `torch.distributed.run`'s argument parser and launch config, and torch's
`LocalElasticAgent` (through `elastic/agent.py`) for process supervision, restarts and error files.
What it adds: the `etcd-v3` backend, a private embedded etcd when one node runs without
`--rdzv-endpoint` (or with `--standalone`), the agent extensions of `elastic/agent.py` (hang
detection, membership-aware restart accounting, events, metrics), flag validation up front, run ids
that cannot collide between jobs, and clean errors.

Which rendezvous a command line gets (`_plan`), following torchrun where the user gave no
`--rdzv-endpoint`:
- `--rdzv-endpoint` (or `--standalone`, or one node): `etcd-v3`, on that etcd or a private one;
- a fixed `--nnodes N>1`, or an explicit `--master-port`, without `--rdzv-endpoint`: torchrun's
  static rendezvous at `--master-addr:--master-port` (node rank 0 hosts the store), exactly as
  torchrun does; it is not elastic, and a one-line note says how to make it so;
- an explicit `--rdzv-backend` other than `etcd-v3` (c10d, static, ...): torch's backend, as asked.

Python callers use `main(argv)`, which behaves like `torch.distributed.run.main`: a bad configuration
raises `ValueError`, a failed job `ChildFailedError`. The console script is `cli()`, which maps
those to exit status 2 and 1. Run as a program (`elastic-run`, `python -m elastic.launcher`), it first
starts its workers' interpreters, before its own slow imports (elastic/prestart.py).
"""

from __future__ import annotations

import sys

from elastic import prestart

if __name__ == "__main__":  # `python -m elastic.launcher`: run as the console script (its signals, its prestart),
    import runpy  # which imports this module afresh, as `elastic.launcher`, under its early signal handlers

    runpy.run_module("elastic.console", run_name="__main__")

import argparse
import logging
import os
import re
import shutil
import signal
import socket
import uuid
from argparse import ArgumentParser, Namespace
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous.api import RendezvousError

from core import events
from elastic import fast_exit, rendezvous, stop_signals
from elastic.agent import AgentConfig, launch
from elastic.credentials import mask_conf
from elastic.errors import EXIT_BELOW_MIN, BelowMinimumError, ElasticError
from elastic.etcd_server import EtcdServer
from elastic.rdzv_settings import MAX_SECONDS

log = logging.getLogger("elastic.launcher")

ENV_WARM_SPARE = prestart.ENV_WARM_SPARE

STATIC = "static"
TORCHRUN_DEFAULT_RUN_ID = "none"
TORCHRUN_DEFAULT_MASTER_PORT = 29500
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_MAX_WORKERS = 1024
"""The most --nproc-per-node takes (10^20 made the launcher allocate without end, never starting a worker)."""
_MAX_MONITOR_INTERVAL = 3600.0
"""The agent sleeps --monitor-interval between checks: a job that ended waited that long to be seen."""
_MIN_HANG_TIMEOUT = 0.1


def build_parser() -> ArgumentParser:
    parser = torchrun.get_args_parser()
    parser.prog = "elastic-run"
    parser.description = (
        "Launch an elastic, fault-tolerant PyTorch job. Accepts torchrun's flags; the rendezvous is "
        "etcd v3 (`etcd-v3`). Without --rdzv-endpoint, one node gets a private etcd; a fixed --nnodes N>1 "
        "gets torchrun's static rendezvous at --master-addr:--master-port."
    )
    helps = {
        "standalone": "One node on a private embedded etcd with a random run id (torchrun: a c10d store). "
                      "Contradicts --rdzv-endpoint.",
        "rdzv_backend": f"Rendezvous backend (default: {rendezvous.BACKEND_NAME}, on --rdzv-endpoint or a private "
                        "embedded etcd for one node; without --rdzv-endpoint a fixed --nnodes N>1 or an explicit "
                        "--master-port uses torchrun's static rendezvous). An explicit c10d, static, ... runs "
                        "torch's backend as asked, without fast re-formation.",
        "rdzv_endpoint": "etcd endpoint(s) of the job, host:port[,host:port...] (for etcd-v3; any URL scheme, "
                         "http or https). Every node of one job must pass the same endpoint and --rdzv-id. "
                         "Leave it out for one node: a private etcd is started for it.",
        "rdzv_id": "The job's run id; all nodes of one job pass the same one, and a finished job's id is closed. "
                   "Default: derived from TORCHELASTIC_RUN_ID, SLURM_JOB_ID or JOB_UID (a Kubernetes Job uid); "
                   "random for one node; required for several nodes on an external etcd.",
        "master_port": "Port of the static rendezvous store on the node of rank 0 (default 29500); workers get it "
                       "as MASTER_PORT. Used without --rdzv-endpoint, as torchrun does.",
    }
    for action in parser._actions:  # noqa: SLF001 - torchrun's parser, our words for our behaviour
        if action.dest in helps:
            action.help = helps[action.dest]
        if action.dest == "rdzv_backend":
            # None: not given, so _plan decides (see the module docstring). torchrun's flags default to their PET_*
            # variable (what Kubeflow's PyTorchJob sets); this one still does.
            action.default = os.environ.get("PET_RDZV_BACKEND") or None
    ours = parser.add_argument_group("elastic-train")
    ours.add_argument(
        "--node-id",
        default=None,
        help="This agent's id in the run (default: <hostname>-<pid>-<random>). Same as --rdzv-conf node_id=...",
    )
    ours.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Kill a worker that reported progress (trainer steps) but none for this long, so the group restarts "
        "(a stopped worker, SIGSTOP: after half of it). Off by default.",
    )
    ours.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics on PORT: the agent's (members, restarts, recoveries, degraded) and its "
        "workers' (steps, throughput, checkpoints, goodput; README, Observability); 0 picks one.",
    )
    ours.add_argument(
        "--reform",
        choices=("in-process", "restart"),
        default="in-process",
        help="On a membership change, keep workers that can re-form their process group in place (trainer's "
        "Resumable with replicated state) and restart only the others (in-process, the default), or restart "
        "every worker (restart). Needs the etcd-v3 backend; other backends always restart.",
    )
    ours.add_argument(
        "--warm-spare",
        action=argparse.BooleanOptionalAction,
        default=prestart.warm_spare_default(),
        help="With --reform in-process: keep one worker process per node started ahead of need (Python, torch "
        "and the script's imports loaded) that takes a crashed worker's place, so only the crashed process "
        "restarts and the group waits about a re-formation, not a process start. Default: on "
        f"(${ENV_WARM_SPARE}=0 turns the default off); --no-warm-spare starts a replacement when it is needed.",
    )
    return parser


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How this node meets the others, decided from the flags before anything starts."""

    backend: str
    """The torch rendezvous backend to use (`etcd-v3`, `static`, `c10d`, ...)."""
    embedded_etcd: bool
    """Start a private etcd for this node (etcd-v3 without --rdzv-endpoint)."""
    run_id: str
    """The run id every node of the job agrees on."""
    notes: tuple[str, ...] = ()
    """One-line notes for the user, logged once at start."""

    def __post_init__(self) -> None:
        if self.embedded_etcd and self.backend != rendezvous.BACKEND_NAME:
            raise ValueError(
                f"an embedded etcd serves only the {rendezvous.BACKEND_NAME} backend, not {self.backend!r}"
            )


def scheduler_run_id(env: Mapping[str, str]) -> str | None:
    """A run id all nodes of one scheduler job agree on and no other job has, or None outside one.

    TORCHELASTIC_RUN_ID as set by an outer launcher or operator; Slurm's job id plus its requeue count
    (a requeued job is a new run: the old run id may be closed); the uid of a Kubernetes Job, exposed
    to the pod through the downward API as JOB_UID (deploy/k8s/job.yaml sets it from the label
    batch.kubernetes.io/controller-uid).
    """
    if env.get("TORCHELASTIC_RUN_ID"):
        return env["TORCHELASTIC_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_RESTART_COUNT') or 0}"
    if env.get("JOB_UID"):
        return f"k8s-{env['JOB_UID']}"
    return None


def _plan(args: Namespace, env: Mapping[str, str]) -> Plan:
    """Pick the rendezvous for these flags; ValueError names the flag when they cannot work."""
    min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    given_id = args.rdzv_id if args.rdzv_id != TORCHRUN_DEFAULT_RUN_ID else None
    derived = given_id or scheduler_run_id(env)
    if args.node_id is not None and not args.node_id.strip():
        raise ValueError("--node-id: must not be empty (leave it out for the host name and pid)")
    if args.node_id is not None and "/" in args.node_id:  # a part of etcd keys (named --rdzv-conf before)
        raise ValueError(f"--node-id {args.node_id!r}: must contain no '/'")
    backend = args.rdzv_backend
    known = _registered_backends()
    if backend is not None and known and backend not in known:  # torch's "not registered. Did you forget..."
        raise ValueError(f"--rdzv-backend {backend!r}: no such rendezvous backend; known: {', '.join(known)} "
                         f"(leave it out for {rendezvous.BACKEND_NAME}, or {STATIC} with --master-addr)")
    if backend is None:
        fixed_multi_node = min_nodes == max_nodes > 1
        if not args.rdzv_endpoint and not args.standalone and (fixed_multi_node or args.master_port is not None):
            backend = STATIC  # torchrun's rule for these flags (torch.distributed.run.run)
        else:
            backend = rendezvous.BACKEND_NAME
    if backend == STATIC:
        if not 0 <= args.node_rank < max_nodes:
            raise ValueError(f"--node-rank {args.node_rank}: must be 0..{max_nodes - 1} for --nnodes {args.nnodes}")
        # torch's static handler takes --rdzv-endpoint where one is given, else --master-addr:--master-port
        where = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or TORCHRUN_DEFAULT_MASTER_PORT}"
        note = (f"static rendezvous at {where}, "
                f"node rank {args.node_rank} of {max_nodes} (torchrun's non-elastic mode: a lost node ends the job); "
                "for elastic membership and fast re-formation pass --rdzv-endpoint <etcd host:port>")
        return Plan(backend=STATIC, embedded_etcd=False, run_id=derived or TORCHRUN_DEFAULT_RUN_ID, notes=(note,))
    if backend != rendezvous.BACKEND_NAME:
        note = (f"--rdzv-backend {backend}: torch's {backend} rendezvous as asked; a lost node is then noticed "
                f"only by a collective's timeout. Fast re-formation needs {rendezvous.BACKEND_NAME}: leave out "
                "--rdzv-backend and pass --rdzv-endpoint <etcd host:port> (or no endpoint for one node on a "
                "private etcd)")
        if args.standalone:  # torchrun's --standalone: a c10d store on a free local port
            args.rdzv_endpoint, derived = "localhost:0", None
        # Without --rdzv-id, torchrun's id ("none") where other nodes are to meet this one on that backend's store:
        # a random id per node would keep them apart until the join timeout. One node alone gets its own id.
        shared = max_nodes > 1 and not args.standalone
        run_id = derived or (TORCHRUN_DEFAULT_RUN_ID if shared else str(uuid.uuid4()))
        return Plan(backend=backend, embedded_etcd=False, run_id=run_id, notes=(note,))
    if derived is not None and "/" in derived:  # a part of etcd keys: named here, with where it came from
        source = "--rdzv-id" if given_id else "the scheduler's job id (TORCHELASTIC_RUN_ID, SLURM_JOB_ID or JOB_UID)"
        raise ValueError(f"{source}: run id {derived!r} must contain no '/'; pass --rdzv-id with another")
    if env.get(SHARE_STORE_ENV) == "1":
        raise ValueError(
            f"{SHARE_STORE_ENV}=1 is not supported by {rendezvous.BACKEND_NAME}: the rank-0 agent hosts each "
            "round's TCPStore and publishes it in etcd under its lease, so the store outlives worker restarts, "
            "dies with its node (which the other nodes then see at once) and is fresh in every round; a store "
            "hosted by worker rank 0 would die with that worker. Unset it, or pass --rdzv-backend c10d"
        )
    if args.standalone or not args.rdzv_endpoint:
        if max_nodes > 1 and min_nodes == max_nodes:
            asked = "--standalone" if args.standalone else f"--rdzv-backend {backend}"
            raise ValueError(
                f"{asked} with --nnodes {args.nnodes} needs --rdzv-endpoint: every node must reach the same etcd. "
                "Leave out --rdzv-backend and --standalone for torchrun's static rendezvous at "
                "--master-addr:--master-port"
            )
        if args.node_rank > 0:  # torchrun would wait for the others at --master-addr; here no other node can join
            raise ValueError(
                f"--node-rank {args.node_rank} with --nnodes {args.nnodes} and no --rdzv-endpoint: each node would run "
                "alone on a private etcd. Pass --rdzv-endpoint <etcd host:port> (the same on every node), or a fixed "
                "--nnodes N with --master-addr and --master-port for torchrun's static rendezvous"
            )
        notes: tuple[str, ...] = ()
        if max_nodes > 1:
            notes = (f"no --rdzv-endpoint: a private etcd for this node only, so no other node can join "
                     f"(--nnodes {args.nnodes}); pass --rdzv-endpoint <etcd host:port> for several nodes",)
        run_id = str(uuid.uuid4()) if args.standalone else (derived or str(uuid.uuid4()))
        return Plan(backend=backend, embedded_etcd=True, run_id=run_id, notes=notes)
    notes = ()
    if args.master_port is not None:
        notes = ("--master-port is not used with --rdzv-endpoint (as with torchrun's c10d): workers find the "
                 "round's store in MASTER_ADDR and MASTER_PORT",)
    if derived is None:
        if max_nodes > 1:
            raise ValueError(
                f"--rdzv-id is required with --rdzv-endpoint and --nnodes {args.nnodes}: every node of one job must "
                "pass the same id, and a finished job's id is closed for good (torchrun's default 'none' would "
                "collide with the previous job). Pass e.g. --rdzv-id job-42, or run under Slurm (SLURM_JOB_ID), "
                "or set TORCHELASTIC_RUN_ID or JOB_UID. Without --rdzv-backend, elastic-run takes --rdzv-endpoint for "
                "etcd; for torchrun's static rendezvous at that address (torchrun's default backend), pass "
                "--rdzv-backend static"
            )
        derived = str(uuid.uuid4())  # one node: nobody else needs to agree on it
    return Plan(backend=backend, embedded_etcd=False, run_id=derived, notes=notes)


def _registered_backends() -> list[str]:
    """The rendezvous backends torch knows here (ours included), or [] where its registry is not readable."""
    try:
        from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    except ImportError:
        return []
    return sorted(getattr(rendezvous_handler_registry, "_registry", {}))


def _validate(args: Namespace, env: Mapping[str, str]) -> Plan:
    """Reject bad or contradictory flags before anything starts; ValueError names the flag."""
    if args.standalone and args.rdzv_endpoint:
        raise ValueError("--standalone starts a private etcd and contradicts --rdzv-endpoint; pass one of them")
    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX, e.g. --nnodes 1:4") from exc
    if not 0 < min_nodes <= max_nodes:
        raise ValueError(f"--nnodes {args.nnodes!r}: need 0 < MIN <= MAX")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if not 0 < args.monitor_interval <= _MAX_MONITOR_INTERVAL:  # nan fails too
        raise ValueError(f"--monitor-interval {args.monitor_interval}: must be a number of seconds in "
                         f"(0, {_MAX_MONITOR_INTERVAL:g}] (the agent sleeps this long between checks of its workers)")
    nproc_hint = f"must be a count from 1 to {_MAX_WORKERS} or auto/cpu/gpu/xpu"
    try:
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as exc:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node!r}: {exc}; {nproc_hint}") from exc
    if not 0 < nproc <= _MAX_WORKERS:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node!r}: {nproc_hint}")
    for flag in ("redirects", "tee"):
        value = getattr(args, flag, None)
        if value is not None and not re.fullmatch(r"[0-3]|(\d+:[0-3],)*\d+:[0-3]", str(value)):
            raise ValueError(f"--{flag} {value!r}: must be 0-3 (0 none, 1 stdout, 2 stderr, 3 both) for every local "
                             "rank, or per local rank as 0:3,1:1")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port {args.master_port}: must be 1..65535")
    try:
        conf = torchrun._parse_rendezvous_config(args.rdzv_conf)  # noqa: SLF001 - torchrun's own parser
    except ValueError as exc:
        raise ValueError(f"--rdzv-conf {mask_conf(args.rdzv_conf)!r}: {exc}") from exc
    plan = _plan(args, env)
    validate_conf = getattr(rendezvous, "validate_conf", None)
    if validate_conf is not None and plan.backend == rendezvous.BACKEND_NAME:
        try:
            validate_conf(conf)
        except ValueError as exc:
            raise ValueError(f"--rdzv-conf: {exc}") from exc
    if args.node_id is not None:
        if "node_id" in conf and conf["node_id"] != args.node_id:
            raise ValueError("--node-id and --rdzv-conf node_id=... disagree; pass one of them")
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"node_id={args.node_id}"]))
    if plan.backend == rendezvous.BACKEND_NAME and args.rdzv_endpoint:
        from elastic.etcd_client import parse_endpoints

        try:
            parse_endpoints(args.rdzv_endpoint)
        except ValueError as exc:
            raise ValueError(f"--rdzv-endpoint: {exc}") from exc
    if args.hang_timeout is not None and not _MIN_HANG_TIMEOUT <= args.hang_timeout <= MAX_SECONDS:  # nan too
        raise ValueError(f"--hang-timeout {args.hang_timeout}: must be a number of seconds from "
                         f"{_MIN_HANG_TIMEOUT:g} to {MAX_SECONDS:g}")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise ValueError(f"--metrics-port {args.metrics_port}: must be 0..65535")
    if args.module and args.no_python:  # before the script's checks, which would name the wrong cause
        raise ValueError("--no-python and -m/--module contradict each other: -m runs `python -m`; pass one of them")
    needs_file = not args.module and not args.no_python
    # What `python X` runs: a file, or a directory (or zip) with a __main__.py
    runnable = os.path.isfile(args.training_script) or os.path.isfile(os.path.join(args.training_script, "__main__.py"))
    if needs_file and not runnable:
        what = "is a directory without a __main__.py" if os.path.isdir(args.training_script) else "does not exist"
        raise ValueError(f"training script {args.training_script!r} {what}")
    if args.no_python and shutil.which(args.training_script) is None:
        raise ValueError(f"--no-python: command {args.training_script!r} is not found or not executable")
    events.route_to_torch(args.event_log_handler)  # raises ValueError naming an unknown handler
    _check_sockets(args)
    log_dir = getattr(args, "log_dir", None)
    if log_dir:
        try:  # torchrun makes it later, with a traceback for a file or /proc path
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--log-dir {log_dir}: cannot make that directory ({exc.strerror})") from exc
    return plan


def _check_sockets(args: Namespace) -> None:
    """--local-addr must be this host's and --metrics-port free on it: the agent binds them once running, where
    a failure was a socket traceback."""
    addr = getattr(args, "local_addr", None)
    port = args.metrics_port or 0
    if addr is None and not port:
        return
    try:
        family = socket.getaddrinfo(addr or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except OSError as exc:
        raise ValueError(f"--local-addr {addr}: not an address of this host ({exc})") from exc
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server does (TIME_WAIT)
            probe.bind((addr or "0.0.0.0", port))
    except OSError as exc:
        flag = f"--metrics-port {port}" if port else f"--local-addr {addr}"
        raise ValueError(f"{flag}: cannot listen there ({exc.strerror}); "
                         f"{'pick a free port, or 0 for any' if port else 'pass an address of this host'}") from exc


def run(args: Namespace, plan: Plan) -> dict[int, Any]:
    """Run this node's agent for a validated plan; raises ChildFailedError when the job fails."""
    for note in plan.notes:
        log.info("%s", note)
    args.rdzv_backend, args.rdzv_id = plan.backend, plan.run_id
    args.standalone = False  # handled by the plan; torchrun's meaning (a c10d store) does not apply
    if args.master_port is None:
        args.master_port = TORCHRUN_DEFAULT_MASTER_PORT  # only the static backend reads it
    etcd: EtcdServer | None = None
    try:
        if plan.backend == rendezvous.BACKEND_NAME:
            rendezvous.register()
        if plan.embedded_etcd:
            etcd = EtcdServer().start()
            args.rdzv_endpoint = etcd.endpoint
            log.info("embedded etcd at %s; run id %s", etcd.endpoint, plan.run_id)
        config, cmd, cmd_args = torchrun.config_from_args(args)
        agent_config = AgentConfig(
            hang_timeout=timedelta(seconds=args.hang_timeout) if args.hang_timeout else None,
            metrics_port=args.metrics_port,
            reform=args.reform,
            warm_spare=args.warm_spare,
        )
        return launch(config, cmd, cmd_args, agent_config)
    except SignalException as exc:
        exc.embedded_etcd = plan.embedded_etcd  # type: ignore[attr-defined]  # for cli's last line
        raise
    finally:
        if etcd is not None:
            etcd.stop()


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"),
                        format="[elastic-run] %(asctime)s %(levelname)s %(name)s: %(message)s")


@record
def main(argv: list[str] | None = None) -> dict[int, Any]:
    """`elastic-run` for Python callers, like `torch.distributed.run.main`.

    Unknown flags exit through argparse (SystemExit 2) as in torchrun; a bad configuration raises
    ValueError naming the flag; a failed job raises ChildFailedError. `@record` writes a launcher-level
    error file to TORCHELASTIC_ERROR_FILE when one is set, as torchrun does.
    """
    try:
        args = build_parser().parse_args(argv)
        plan = _validate(args, os.environ)
        _setup_logging()
        return run(args, plan)
    finally:
        prestart.dismiss()  # interpreters started ahead that no agent took (bad flags, a failed start)


def _stop_on_signals(argv: list[str]) -> None:
    """From here on, a stop signal ends the agent as once its workers run (torch's handlers, installed only
    then): through the agent's cleanup (its tier-0 and progress directories, helper, spare) to exit 128+N.
    Before, a SIGTERM or SIGHUP during the rendezvous killed it outright and left its directories in /dev/shm,
    and a Ctrl-C printed a traceback (elastic/stop_signals.py covers the console script's imports before this)."""
    def stop(signum: int, _frame: object) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    for sig in stop_signals.signals_to_handle(argv):
        signal.signal(sig, stop)


def cli(argv: list[str] | None = None) -> int:
    """The `elastic-run` console script: exit 2 for bad flags, 1 for a failed job, 128+N for signal N, 75
    (EXIT_BELOW_MIN) when fewer nodes than --nnodes MIN are left (the survivors persisted their state)."""
    fast_exit.install()
    _stop_on_signals(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
        return 0
    except ValueError as exc:
        build_parser().error(str(exc))  # usage and "elastic-run: error: ...", exit status 2
    except ChildFailedError as exc:
        print(f"elastic-run: the job failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        # A run on its own embedded etcd ends with it; one on a shared etcd can be continued.
        rest = "" if getattr(exc, "embedded_etcd", False) else ("; the run is left open, so a requeued job with the "
                                                                "same --rdzv-id can continue it")
        print(f"elastic-run: stopped by {name}: workers stopped{rest}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except BelowMinimumError as exc:
        print(f"elastic-run: {exc}", file=sys.stderr)
        return EXIT_BELOW_MIN
    except (ElasticError, RendezvousError) as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        return 1
    return 2  # not reached: parser.error exits
