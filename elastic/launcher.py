"""`elastic-run`: torchrun's command line on the `etcd-v3` rendezvous.

It reuses `torch.distributed.run`'s argument parser and launch config, and torch's
`LocalElasticAgent` (through `elastic_launch`) for process supervision, restarts and error files.
What it adds: the `etcd-v3` backend by default, a private embedded etcd when no
`--rdzv-endpoint` is given (or with `--standalone`), the agent extensions of `elastic/agent.py`
(hang detection, membership-aware restart accounting, events, metrics), flag validation up front,
and clean errors.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from argparse import ArgumentParser, Namespace
from datetime import timedelta

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError

from elastic import rendezvous
from elastic.agent import AgentConfig, launch
from elastic.errors import ElasticError
from elastic.etcd_server import EtcdServer

log = logging.getLogger("elastic.launcher")


def build_parser() -> ArgumentParser:
    parser = torchrun.get_args_parser()
    parser.prog = "elastic-run"
    parser.description = (
        "Launch an elastic, fault-tolerant PyTorch job. Accepts torchrun's flags; the rendezvous is "
        "etcd v3 (`etcd-v3`). Without --rdzv-endpoint, a private etcd is started for this node."
    )
    parser.set_defaults(rdzv_backend=rendezvous.BACKEND_NAME)
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
        help="Kill a worker that reported progress (trainer steps) but none for this long, so the group restarts. Off by default.",
    )
    ours.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics (members, generation, restarts, last recovery, degraded) on PORT; 0 picks one.",
    )
    return parser


def _validate(parser: ArgumentParser, args: Namespace) -> None:
    """Reject bad or contradictory flags before anything starts, argparse-style (exit code 2)."""
    if args.standalone and args.rdzv_endpoint:
        parser.error("--standalone starts a private etcd and contradicts --rdzv-endpoint; pass one of them")
    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        parser.error(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX, e.g. --nnodes 1:4")
    if not 0 < min_nodes <= max_nodes:
        parser.error(f"--nnodes {args.nnodes!r}: need 0 < MIN <= MAX")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.monitor_interval <= 0:
        parser.error(f"--monitor-interval {args.monitor_interval}: must be positive")
    try:
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as exc:
        parser.error(f"--nproc-per-node {args.nproc_per_node!r}: {exc}")
    if nproc <= 0:
        parser.error(f"--nproc-per-node {args.nproc_per_node!r}: must be a positive count or auto/cpu/gpu/xpu")
    try:
        conf = torchrun._parse_rendezvous_config(args.rdzv_conf)  # noqa: SLF001 - torchrun's own parser
    except ValueError as exc:
        parser.error(f"--rdzv-conf {args.rdzv_conf!r}: {exc}")
    validate_conf = getattr(rendezvous, "validate_conf", None)
    if validate_conf is not None:
        try:
            validate_conf(conf)
        except ValueError as exc:
            parser.error(f"--rdzv-conf: {exc}")
    if args.node_id is not None:
        if "node_id" in conf and conf["node_id"] != args.node_id:
            parser.error("--node-id and --rdzv-conf node_id=... disagree; pass one of them")
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"node_id={args.node_id}"]))
    if args.rdzv_backend == rendezvous.BACKEND_NAME and args.rdzv_endpoint:
        from elastic.etcd_client import parse_endpoints

        try:
            parse_endpoints(args.rdzv_endpoint)
        except ValueError as exc:
            parser.error(f"--rdzv-endpoint: {exc}")
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        parser.error(f"--hang-timeout {args.hang_timeout}: must be a positive number of seconds")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port {args.metrics_port}: must be 0..65535")
    needs_file = not args.module and not args.no_python
    if needs_file and not os.path.isfile(args.training_script):
        parser.error(f"training script {args.training_script!r} does not exist")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="[elastic-run] %(asctime)s %(levelname)s %(name)s: %(message)s")

    etcd: EtcdServer | None = None
    try:
        if args.rdzv_backend == rendezvous.BACKEND_NAME:
            rendezvous.register()
            if args.standalone or not args.rdzv_endpoint:
                etcd = EtcdServer().start()
                args.rdzv_endpoint = etcd.endpoint
                if args.standalone or args.rdzv_id == "none":
                    args.rdzv_id = str(uuid.uuid4())
                log.info("embedded etcd at %s; run id %s", etcd.endpoint, args.rdzv_id)
            args.standalone = False  # torchrun's --standalone means a c10d store; ours is handled above
        if args.master_port is None:
            args.master_port = 29500  # torchrun's default; only the static backend reads it
        config, cmd, cmd_args = torchrun.config_from_args(args)
        if not config.run_id:
            config.run_id = str(uuid.uuid4())
        agent_config = AgentConfig(
            hang_timeout=timedelta(seconds=args.hang_timeout) if args.hang_timeout else None,
            metrics_port=args.metrics_port,
        )
        launch(config, cmd, cmd_args, agent_config)
        return 0
    except ChildFailedError as exc:
        print(f"elastic-run: the job failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    except (ElasticError, RendezvousError) as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if etcd is not None:
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
