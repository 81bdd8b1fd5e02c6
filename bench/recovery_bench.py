"""Recovery after losing a whole node: elastic-run (etcd-v3) against torchrun (c10d), side by side.

For each launcher and node count: start N simulated nodes on loopback (one agent + 1 worker each,
`--nnodes 1:N`, each node in its own session), wait until the group trains at world size N, then
SIGKILL every process of one node (agent and worker) and time until the surviving group's first
step at world size N-1. The script is the same plain torch.distributed loop for both
(bench/recovery_worker.py). torchrun's c10d store lives in the first node's agent, so the bench
kills the last node for both launchers (killing the store host would end a c10d job outright).

    python bench/recovery_bench.py --json recovery.json [--repeats 3] [--nodes 2 3] [--skip-torchrun]

Prints one JSON object: per scenario the recovery seconds of each repeat, the median, and the
ratio torchrun / elastic-run. Targets (issue D): 2 nodes: >= 8x faster than torchrun and <= 5 s;
3 nodes: <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.procfs import descendants, kill_tree  # noqa: E402
from elastic.etcd_server import EtcdServer, free_port  # noqa: E402

WORKER = REPO / "bench" / "recovery_worker.py"
STEP = re.compile(r"step=(\d+) world=(\d+) t=([\d.]+)")


class Node:
    """One simulated node: an agent process (own session) and its output, read by a thread."""

    def __init__(self, cmd: list[str], name: str, env_extra: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING", **(env_extra or {})}
        self.name = name
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.steps: list[tuple[int, int, float]] = []  # (step, world, unix time)
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := STEP.search(line):
                self.steps.append((int(m[1]), int(m[2]), float(m[3])))

    def kill(self) -> None:
        """SIGKILL the agent and every worker (torch puts workers in sessions of their own)."""
        kill_tree(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        workers = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for pid in [self.proc.pid, *workers]:
            kill_tree(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def launcher_cmd(
    kind: str, nodes: int, endpoint: str, run_id: str, index: int, backend: str = "gloo"
) -> list[str]:
    common = [
        "--nnodes",
        f"1:{nodes}",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "10",
        "--rdzv-id",
        run_id,
        "--monitor-interval",
        "0.1",
    ]
    script = [str(WORKER), "--backend", backend]
    if kind == "elastic-run":
        return [
            sys.executable,
            "-m",
            "elastic.launcher",
            *common,
            "--rdzv-endpoint",
            endpoint,
            "--node-id",
            f"node{index}",
            *script,
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *common,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        *script,
    ]


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def one_recovery(
    kind: str, nodes: int, etcd: EtcdServer | None, timeout: float, backend: str = "gloo"
) -> float:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    endpoint = etcd.endpoint if kind == "elastic-run" else f"127.0.0.1:{free_port()}"
    started: list[Node] = []
    try:
        for i in range(nodes):
            # With NCCL each simulated node owns one GPU, as a real node would own its own.
            gpu = {"CUDA_VISIBLE_DEVICES": str(i)} if backend == "nccl" else None
            started.append(
                Node(launcher_cmd(kind, nodes, endpoint, run_id, i, backend), f"{kind}-{i}", gpu)
            )
            if i == 0 and kind == "torchrun":
                time.sleep(1.0)  # let the first agent bind the c10d store port
        victim = started[-1]  # never the c10d store host (the first agent)

        def steps() -> list[tuple[int, int, float]]:
            # Whichever node holds global rank 0 prints the steps; ranks move when the group re-forms.
            return [s for node in started for s in node.steps]

        wait_for(
            lambda: sum(1 for _, w, _ in steps() if w == nodes) >= 20,
            120,
            f"{kind}: {nodes} nodes training together",
        )
        killed_at = time.time()
        victim.kill()
        wait_for(
            lambda: any(w == nodes - 1 and t > killed_at for _, w, t in steps()),
            timeout,
            f"{kind}: first step at world size {nodes - 1} after the kill",
        )
        first = min(t for _, w, t in steps() if w == nodes - 1 and t > killed_at)
        return round(first - killed_at, 3)
    except TimeoutError as exc:
        tail = "".join(line for node in started for line in node.lines[-10:])
        raise TimeoutError(f"{exc}\n--- survivor output tail ---\n{tail}") from exc
    finally:
        for node in started:
            node.stop()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-torchrun", action="store_true", help="measure elastic-run only")
    p.add_argument(
        "--torchrun-nodes", type=int, nargs="+", default=[2], help="node counts to run torchrun at"
    )
    p.add_argument(
        "--timeout", type=float, default=180, help="give up on one recovery after this many seconds"
    )
    p.add_argument(
        "--backend",
        default="gloo",
        choices=["gloo", "nccl"],
        help="nccl: one GPU per simulated node (needs as many GPUs as nodes)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    results: dict[str, object] = {
        "machine": {"cpus": os.cpu_count()},
        "backend": args.backend,
        "scenarios": {},
    }
    scenarios: dict[str, dict[str, object]] = results["scenarios"]  # type: ignore[assignment]
    with EtcdServer() as etcd:
        for nodes in args.nodes:
            for kind in ("elastic-run", "torchrun"):
                if kind == "torchrun" and (args.skip_torchrun or nodes not in args.torchrun_nodes):
                    continue
                runs = []
                for _ in range(args.repeats):
                    try:
                        runs.append(one_recovery(kind, nodes, etcd, args.timeout, args.backend))
                    except TimeoutError as exc:
                        print(f"# {kind} {nodes} nodes: {exc}", file=sys.stderr)
                        runs.append(None)
                ok = [r for r in runs if r is not None]
                scenarios[f"{kind}_{nodes}_nodes"] = {
                    "recovery_s": runs,
                    "median_s": statistics.median(ok) if ok else None,
                }
                print(f"# {kind} {nodes} nodes: {runs}", file=sys.stderr)
    for nodes in args.nodes:
        ours = scenarios.get(f"elastic-run_{nodes}_nodes", {}).get("median_s")
        theirs = scenarios.get(f"torchrun_{nodes}_nodes", {}).get("median_s")
        entry: dict[str, object] = {
            "elastic_run_median_s": ours,
            "target_s": 5.0,
            "meets_5s": ours is not None and ours <= 5.0,
        }  # type: ignore[operator]
        if ours and theirs:
            entry["torchrun_c10d_median_s"] = theirs
            entry["speedup_vs_torchrun"] = round(theirs / ours, 2)  # type: ignore[operator]
            entry["meets_8x"] = theirs / ours >= 8  # type: ignore[operator]
        results[f"summary_{nodes}_nodes"] = entry
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
