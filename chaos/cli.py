"""`elastic-chaos`: prove that a training job survives failure before it meets a real one.

    elastic-chaos run --scenario smoke --report out/
    elastic-chaos run --nodes 3 --faults kill-node,kill-worker,hang-worker,corrupt-checkpoint --seed 7 --report out/
    elastic-chaos run --scenario soak --runs 50 --report soak/
    elastic-chaos run --nodes 2 --faults kill-worker --report out/ -- my_train.py --ckpt-dir {local_dir} \\
        --steps {steps} --ckpt-every {ckpt_every}
    elastic-chaos faults            # the fault catalog

Exit status: 0 every invariant held; 1 an invariant broke or the run could not be judged; 2 bad input
(reported before anything starts).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos.config import PLACEHOLDERS, ChaosConfig
from chaos.faults import CATALOG, parse_faults
from chaos.ledger import become_subreaper
from chaos.report import Report, goodput_line
from chaos.scenarios import SCENARIOS

if TYPE_CHECKING:
    from chaos.judge import Reference  # imports torch: not at start-up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job under faults and check the invariants",
                         description="Run a job twice on simulated nodes (fault-free, then under the fault plan) and "
                                     "check the invariants. Anything after `--` is the training script and its "
                                     f"arguments, with placeholders {', '.join('{' + p + '}' for p in PLACEHOLDERS)}.")
    run.add_argument("--scenario", choices=sorted(SCENARIOS), help="a preset; flags given explicitly override it")
    run.add_argument("--nodes", type=int, help="simulated nodes at the start (default 2)")
    run.add_argument("--nproc-per-node", type=int, help="workers per node (default 1)")
    run.add_argument("--steps", type=int, help="training steps (default 40)")
    run.add_argument("--faults", help=f"comma-separated kind[@target], in order; kinds: {', '.join(CATALOG)}")
    run.add_argument("--seed", type=int, help="seed of the fault plan (default 0)")
    run.add_argument("--report", type=Path, default=Path("chaos-report"), metavar="DIR",
                     help="where report.json, report.md, timeline.png and logs/ go (default ./chaos-report)")
    run.add_argument("--etcd-members", type=int, choices=(1, 3), help="etcd cluster size (default 1)")
    run.add_argument("--ckpt-every", type=int, help="checkpoint interval in steps (default 5)")
    run.add_argument("--snapshot-every", type=int,
                     help="tier-0 (host memory) snapshot interval of the default script (default 1; 0: off)")
    run.add_argument("--hang-timeout", type=float, metavar="SECONDS", help="the agents' --hang-timeout (default 5)")
    run.add_argument("--reform", choices=("in-process", "restart"),
                     help="the agents' --reform: survivors re-form in place (default) or every worker restarts")
    run.add_argument("--warm-spare", action=argparse.BooleanOptionalAction, default=None,
                     help="the agents' --warm-spare / --no-warm-spare (default: elastic-run's)")
    run.add_argument("--train-seed", type=int, help="the training script's --seed (default 0)")
    run.add_argument("--global-batch", type=int, help="samples per step (default: fits every reachable world size)")
    run.add_argument("--runs", type=int, help="repeat with seeds seed, seed+1, ... (soak; default 1, soak 50)")
    run.add_argument("--timeout", type=float, metavar="SECONDS", help="deadline of one job (default 600)")
    run.add_argument("--work-dir", type=Path,
                     help="keep local tiers, shared tier and etcd data here (default: temporary)")
    run.add_argument("--reference", type=Path, metavar="DIR",
                     help="reuse the fault-free reference run that an earlier run of the same job recorded in its "
                          "--report DIR (reference.json) instead of running it again")
    run.add_argument("--verbose", "-v", action="store_true", help="log each fault as it fires")
    sub.add_parser("faults", help="list the fault catalog")
    parser.set_defaults(run_parser=run)
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str] | None]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     script: list[str] | None) -> tuple[ChaosConfig, int]:
    """Parse once into a ChaosConfig (and the number of runs). Bad input exits 2 via parser.error."""
    settings: dict[str, Any] = {}
    runs = 1
    if args.scenario:
        scenario = SCENARIOS[args.scenario]
        settings.update(scenario.settings)
        settings["scenario"] = scenario.name
        runs = scenario.runs
    explicit = {"nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "steps": args.steps, "seed": args.seed,
                "etcd_members": args.etcd_members, "ckpt_every": args.ckpt_every,
                "snapshot_every": args.snapshot_every, "hang_timeout_s": args.hang_timeout,
                "train_seed": args.train_seed, "global_batch": args.global_batch, "timeout_s": args.timeout,
                "work_dir": args.work_dir, "reform": args.reform, "warm_spare": args.warm_spare}
    settings.update({k: v for k, v in explicit.items() if v is not None})
    if args.runs is not None:
        if args.runs < 1:
            parser.error(f"--runs must be at least 1, got {args.runs}")
        runs = args.runs
    if args.faults is not None:
        try:
            settings["faults"] = parse_faults(args.faults)
        except ValueError as exc:
            parser.error(f"--faults {args.faults!r}: {exc}")
    if script is not None:
        if not script:
            parser.error("`--` must be followed by the training script")
        settings["script"] = Path(script[0])
        settings["script_args"] = tuple(script[1:])
    try:
        config = ChaosConfig(report_dir=args.report, **settings)
    except ValueError as exc:
        parser.error(str(exc))
    if config.script_args is not None and not any("{ckpt_every}" in a for a in config.script_args):
        # Steps lost are judged against --ckpt-every: a script saving on its own interval (train_tiny's 10 against
        # the default 5) was judged BROKEN for losing what it was bound to lose.
        print(f"elastic-chaos: warning: the script's arguments have no {{ckpt_every}}: steps lost are judged against "
              f"--ckpt-every {config.ckpt_every}; pass it on (e.g. --ckpt-every {{ckpt_every}}) or set --ckpt-every "
              "to the script's own checkpoint interval", file=sys.stderr)
    return config, runs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, script = _split(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    if args.command == "faults":
        for kind in CATALOG.values():
            print(f"{kind.name:24} {kind.summary}")
        return 0
    config, runs = config_from_args(args.run_parser, args, script)
    reference = None
    if args.reference is not None:
        from chaos.judge import load_reference

        try:
            reference = load_reference(args.reference, config)
        except ValueError as exc:
            args.run_parser.error(str(exc))
    for flag, where in (("--report", config.report_dir), ("--work-dir", config.work_dir)):
        try:  # made now, once the flags are known good: a file or /proc/... there was a traceback from the runner
            if where is not None:
                where.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            args.run_parser.error(f"{flag} {where}: cannot make that directory ({exc.strerror})")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="[elastic-chaos] %(asctime)s %(message)s")
    become_subreaper()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # clean up every process, as on Ctrl-C (SIGHUP: a closed terminal)
        if signal.getsignal(sig) is not signal.SIG_IGN:  # under nohup, SIGHUP stays ignored
            signal.signal(sig, _interrupt)
    from chaos.runner import run  # imports torch: keep `--help` and bad input fast

    try:
        if runs == 1:
            report, _ = run(config, reference=reference)
            _print_summary(report, config.report_dir)
            return 0 if report.passed else 1
        return _soak(config, runs, reference)
    except KeyboardInterrupt as exc:
        print("elastic-chaos: interrupted; every process it started has been ended", file=sys.stderr)
        return interrupted_status(exc)


def interrupted_status(exc: KeyboardInterrupt) -> int:
    """128 + the signal's number, as elastic-run and a shell report it: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + int(exc.args[0] if isinstance(exc, _Signalled) else signal.SIGINT)


class _Signalled(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, ended like Ctrl-C; its number gives the exit status (128 + it)."""


def _interrupt(signum: int, frame: object) -> None:
    raise _Signalled(signum)


def _print_summary(report: Report, directory: Path) -> None:
    verdict = "PASSED" if report.passed else "FAILED"
    skipped = sum(1 for f in report.faults if f.skipped)
    also = f" ({skipped} fault(s) skipped, not passed)" if skipped else ""
    print(f"elastic-chaos: {verdict}{also} in {report.duration_s:.1f} s; report in {directory}/report.md")
    if report.error:
        print(f"  error: {report.error}")
    for name, ok in report.invariants.items():
        print(f"  {'ok ' if ok else 'BROKEN'} {name}: {report.invariant_details.get(name, '')}")
    for name, why in report.not_checked.items():
        print(f"  --  {name}: not checked: {why}")
    for f in report.faults:
        if f.skipped:
            print(f"  skipped {f.kind}: {f.skipped}")
        elif f.injected_t is None:  # the job ended (or timed out) before its step: nothing to cost
            print(f"  fault {f.kind}: not fired")
        else:
            print(f"  fault {f.kind} on {f.node} at step {f.at_step}: detect {f.detect_s} s, resume {f.resume_s} s, "
                  f"{f.steps_lost} steps lost")
    print(f"  goodput: {goodput_line(report.goodput, report.reference_goodput)}")


def _soak(config: ChaosConfig, runs: int, reference: Reference | None = None) -> int:
    from chaos.runner import run

    reports: list[Report] = []
    for i in range(runs):
        one = replace(config, seed=config.seed + i, report_dir=config.report_dir / f"run_{config.seed + i:04d}")
        report, reference = run(one, reference=reference)
        reports.append(report)
        broken = [k for k, v in report.invariants.items() if not v]
        print(f"elastic-chaos soak {i + 1}/{runs} seed {one.seed}: {'PASSED' if report.passed else 'FAILED'} "
              f"({report.duration_s:.0f} s){' broken: ' + ', '.join(broken) if broken else ''}"
              f"{' error: ' + report.error if report.error else ''}", flush=True)
    summary = soak_summary(reports)
    config.report_dir.mkdir(parents=True, exist_ok=True)
    (config.report_dir / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    (config.report_dir / "soak.md").write_text(soak_markdown(summary))
    print(f"elastic-chaos soak: {summary['passed']}/{summary['runs']} passed; {config.report_dir}/soak.md")
    return 0 if summary["passed"] == summary["runs"] else 1


def soak_summary(reports: list[Report]) -> dict[str, Any]:
    per_kind: dict[str, dict[str, list[float]]] = {}
    for r in reports:
        for f in r.faults:
            if f.injected_t is None:
                continue
            d = per_kind.setdefault(f.kind, {"detect_s": [], "resume_s": [], "steps_lost": []})
            if f.detect_s is not None:
                d["detect_s"].append(f.detect_s)
            if f.resume_s is not None:
                d["resume_s"].append(f.resume_s)
            d["steps_lost"].append(f.steps_lost)
    broken: dict[str, int] = {}
    for r in reports:
        for k, v in r.invariants.items():
            if not v:
                broken[k] = broken.get(k, 0) + 1
    return {
        "runs": len(reports),
        "passed": sum(r.passed for r in reports),
        "failed_seeds": [r.seed for r in reports if not r.passed],
        "broken_invariants": broken,
        "errors": [r.error for r in reports if r.error],
        "total_s": round(sum(r.duration_s for r in reports), 1),
        "per_fault": {
            kind: {
                "fired": len(v["steps_lost"]),
                "detect_s_median": _median(v["detect_s"]), "detect_s_max": max(v["detect_s"], default=None),
                "resume_s_median": _median(v["resume_s"]), "resume_s_max": max(v["resume_s"], default=None),
                "steps_lost_max": max(v["steps_lost"], default=None),
            }
            for kind, v in per_kind.items()
        },
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def soak_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# elastic-chaos soak: {summary['passed']}/{summary['runs']} runs passed", "",
             f"Total {summary['total_s']} s. Failed seeds: {summary['failed_seeds'] or 'none'}. "
             f"Broken invariants: {summary['broken_invariants'] or 'none'}.", "",
             "| fault | fired | detect s (median / max) | resume s (median / max) | max steps lost |",
             "|---|---|---|---|---|"]
    for kind, v in summary["per_fault"].items():
        lines.append(f"| {kind} | {v['fired']} | {v['detect_s_median']} / {v['detect_s_max']} | "
                     f"{v['resume_s_median']} / {v['resume_s_max']} | {v['steps_lost_max']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
