"""Recovery after a fault, side by side: elastic-run in-process, elastic-run restart and torchrun (c10d).

N simulated nodes on loopback, one agent + 1 worker each, every agent in a session of its own. Once the
group has trained 20 steps at world size N (and a random 0-200 ms more, so the kill lands anywhere in a
step), the bench injects one fault into the node that holds the last rank and times until the re-formed
group's first step:
- `node`: SIGKILL the node's agent and worker (`--nnodes 1:N`); the survivors go on at world size N-1;
- `worker`: SIGKILL only its worker (`--nnodes N`); its agent starts a new one; the group goes on at N.
- `join`: no fault: another node's agent starts (`--nnodes N:N+1`) and the group goes on at N+1. Timed from
  that agent's start to its first step (recovery_s); also the survivors' longest pause between two steps,
  and where the newcomer's state came from (its `restored` event: a peer's over the group, not a disk).

Modes:
- `in-process`: elastic-run (etcd-v3) `--reform in-process` with examples/train_tiny.py (trainer.Resumable,
  replicated state): survivors re-form their process group in place; a crashed worker's place is taken by
  its node's warm spare (elastic/spare.py; the bench kills once every node's spare is warm);
- `no-spare`: the same with `--no-warm-spare`: the crashed worker's replacement starts when it is needed;
- `restart`: the same job with `--reform restart`: every worker restarts and restores its tier-0 snapshot
  (train_tiny snapshots every step, so both modes can lose at most the step in flight);
- `torchrun`: torch.distributed.run, c10d rendezvous, bench/recovery_worker.py (a plain torch.distributed
  loop, no checkpoint: a restarted worker starts again at step 1). c10d's store lives in the first node's
  agent, so torchrun's victim is never the first node (killing the store host ends a c10d job).

Measured per run, from each worker's record of each completed step (elastic-run: the workers' `step`
events, `ts` in ELASTIC_EVENTS_DIR, one directory per node; torchrun: the `t=` the workers print), all
on one machine's wall clock:
- recovery_s: from the kill to the first step the re-formed group completes (its earliest rank's record);
- survivor_pids_changed: the survivors' worker pids in that step against those before the kill;
- continued_from, last_completed, recomputed: that step - 1, the last step the survivors had completed
  before it, and how many of those the group did again;
- detect_s (elastic-run): from the kill to the first `reform` or `restart` event of a surviving agent;
  worker_reform_s (in-process): the survivors' own time in Resumable.reform (the `reformed` event).

    python bench/recovery_bench.py --json out.json [--repeats 3] [--nodes 2 3] [--modes in-process restart torchrun]
        [--faults node worker] [--skip-torchrun]

Targets (issue K, 2-core CPU, gloo): node loss, 2 and 3 nodes, in-process: median <= 0.5 s, survivors'
pids unchanged, 0 steps recomputed. A single worker SIGKILL: the group's next step <= 1 s, <= 1 recomputed.
A node joining: its first step <= 3 s after its agent starts, state from peers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.events import EVENTS_DIR_ENV  # noqa: E402
from core.procfs import descendants, kill_tree  # noqa: E402
from elastic.etcd_server import EtcdServer, free_port  # noqa: E402

WORKER = REPO / "bench" / "recovery_worker.py"
TINY = REPO / "examples" / "train_tiny.py"
# The elastic-run modes' job: `tiny` (CPU, gloo, short steps) or `gpt`, issue K's GPU case (one H200 per node:
# the GPT example at 124M parameters, bf16, as in bench/goodput_bench.py).
SCRIPTS = {
    "tiny": (TINY, ["--step-sleep", "0.02"]),
    # FSDP2 over the nodes (examples/train_fsdp.py; trainer.run_elastic re-enters main() in place), a tier-0
    # snapshot and a peer replica every step: a lost node's shard comes back from its replica, resharded.
    "fsdp": (REPO / "examples" / "train_fsdp.py",
             ["--layers", "1", "--heads", "4", "--d-model", "32", "--seq-len", "8", "--vocab", "64",
              "--global-batch", "12", "--max-micro-batch", "6", "--dropout", "0", "--replica-every", "1"]),
    "gpt": (REPO / "examples" / "train_gpt.py",
            ["--layers", "12", "--heads", "12", "--d-model", "768", "--seq-len", "1024", "--vocab", "8192",
             "--global-batch", "64", "--max-micro-batch", "16", "--dtype", "bf16"]),
}
LINE = re.compile(r"step=(\d+) world=(\d+) t=([\d.]+) rank=(\d+) pid=(\d+)")
MODES = ("in-process", "no-spare", "restart", "torchrun")
FAULTS = ("node", "worker", "join")
STEP_SLEEP_S = 0.02  # short steps: "the first step after" is precise to a few tens of ms
WARMUP_STEPS = 20
KILL_PHASE_S = 0.2  # the kill lands up to this long after the 20th step was seen
AGENT_EVENTS = ("reform", "restart")


@dataclass(frozen=True)
class Step:
    """One worker's record of one completed step."""

    step: int
    world: int
    rank: int
    pid: int
    ts: float
    node: int


class Node:
    """One simulated node: an agent process (own session), its output and its event files, read as they grow."""

    def __init__(self, cmd: list[str], index: int, events_dir: Path | None, env_extra: dict[str, str]) -> None:
        log_level = os.environ.get("BENCH_LOGLEVEL", "WARNING")  # INFO: the agents' timeline in --keep's logs
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": log_level, **env_extra}
        if events_dir is not None:
            env[EVENTS_DIR_ENV] = str(events_dir)
        self.index, self.events_dir = index, events_dir
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.printed: list[Step] = []
        self.recorded: list[Step] = []
        self.events: list[dict[str, Any]] = []  # every event but `step`
        self._offsets: dict[Path, int] = {}
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := LINE.search(line):
                self.printed.append(Step(int(m[1]), int(m[2]), int(m[4]), int(m[5]), float(m[3]), self.index))

    def _poll_events(self) -> None:
        """Parse what the event files gained since the last call (whole lines only)."""
        assert self.events_dir is not None
        for path in sorted(self.events_dir.glob("events-*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for raw in data[:end].splitlines():
                try:
                    e = json.loads(raw)
                except json.JSONDecodeError:
                    continue  # a torn line from a killed process
                if e["event"] == "step":
                    self.recorded.append(Step(e["step"], e["world"], e["rank"], e["pid"], e["ts"], self.index))
                else:
                    self.events.append(e)

    def steps(self) -> list[Step]:
        if self.events_dir is None:
            return list(self.printed)
        self._poll_events()
        return list(self.recorded)

    def kill(self) -> float:
        """SIGKILL the agent and every worker (torch puts workers in sessions of their own); returns when
        (wall clock): the tree is read first, so reading /proc does not count as recovery time."""
        targets = [self.proc.pid, *descendants(self.proc.pid)]
        killed_at = time.time()
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_tree(self.proc.pid, signal.SIGKILL)  # anything forked meanwhile
        self.proc.wait(timeout=10)
        return killed_at


def stop_all(nodes: list[Node]) -> None:
    """SIGTERM every agent, then SIGKILL whatever of theirs is left (workers included)."""
    trees = {node.proc.pid: descendants(node.proc.pid) for node in nodes}
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.terminate()
    for node in nodes:
        try:
            node.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        for pid in [node.proc.pid, *trees[node.proc.pid], *descendants(node.proc.pid)]:
            kill_tree(pid, signal.SIGKILL)
        node.proc.wait(timeout=10)


def command(mode: str, nnodes: str, endpoint: str, run_id: str, index: int, work: Path, backend: str,
            script: str = "tiny") -> list[str]:
    common = ["--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "10", "--rdzv-id", run_id,
              "--monitor-interval", "0.1"]
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, str(WORKER), "--backend", backend, "--interval", str(STEP_SLEEP_S),
                "--every-rank"]
    return [sys.executable, "-m", "elastic.launcher", *common, "--rdzv-endpoint", endpoint, "--node-id",
            f"node{index}", "--reform", "restart" if mode == "restart" else "in-process",
            *(["--no-warm-spare"] if mode == "no-spare" else []), str(SCRIPTS[script][0]), "--steps", "1000000",
            "--ckpt-dir", str(work / "ckpt"), "--ckpt-every", "100", "--snapshot-every", "1", *SCRIPTS[script][1]]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def warm_spares(events: list[dict[str, Any]]) -> set[int]:
    """The pids of a node's kept warm spares that are warm (`spare_ready` also comes from the processes the
    launcher starts ahead for its first workers, elastic/prestart.py)."""
    kept = {e["pid"] for e in events if e["event"] == "spare_started"}
    return {e["pid"] for e in events if e["event"] == "spare_ready" and e["pid"] in kept}


def wait_for_spares(started: list[Node]) -> None:
    def warm() -> bool:
        for n in started:
            n.steps()  # reads the event files
        return all(warm_spares(n.events) for n in started)

    wait_for(warm, 120, "every node's warm spare")


def one_run(mode: str, fault: str, nodes: int, etcd: EtcdServer, timeout: float, backend: str,
            keep: Path | None = None, script: str = "tiny") -> dict[str, Any]:
    """Start the job, inject `fault` into the node holding the last rank, measure; stops everything it started.
    `keep`: a directory to leave each node's output and events in."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    endpoint = etcd.endpoint if mode != "torchrun" else f"127.0.0.1:{free_port()}"
    nnodes = {"node": f"1:{nodes}", "join": f"{nodes}:{nodes + 1}"}.get(fault, str(nodes))
    target = {"node": nodes - 1, "join": nodes + 1}.get(fault, nodes)
    started: list[Node] = []
    with tempfile.TemporaryDirectory(prefix="rbench-") as tmp:
        def start(i: int) -> Node:
            work = Path(tmp) / f"node{i}"
            # With NCCL each simulated node owns one GPU, as a real node would own its own.
            env = {"CUDA_VISIBLE_DEVICES": str(i)} if backend == "nccl" and mode == "torchrun" else {}
            node = Node(command(mode, nnodes, endpoint, run_id, i, work, backend, script), i,
                        None if mode == "torchrun" else work / "events", env)
            started.append(node)
            return node

        try:
            for i in range(nodes):
                start(i)
                if i == 0 and mode == "torchrun":
                    time.sleep(1.0)  # let the first agent bind the c10d store port
            if fault == "join":
                return measure_join(mode, nodes, started, lambda: start(nodes), timeout)
            return measure(mode, fault, nodes, target, started, timeout)
        except TimeoutError as exc:
            tail = "".join(line for node in started for line in node.lines[-10:])
            raise TimeoutError(f"{exc}\n--- output tail ---\n{tail}") from exc
        finally:
            stop_all(started)
            if keep is not None:
                for node in started:
                    (keep / f"node{node.index}").mkdir(parents=True, exist_ok=True)
                    (keep / f"node{node.index}" / "output.log").write_text("".join(node.lines))
                    if node.events_dir is not None and node.events_dir.is_dir():
                        shutil.copytree(node.events_dir, keep / f"node{node.index}" / "events", dirs_exist_ok=True)


def all_steps(started: list[Node]) -> list[Step]:
    return [s for node in started for s in node.steps()]


def wait_together(mode: str, nodes: int, started: list[Node], *, spares: bool) -> None:
    """Until `nodes` nodes have trained WARMUP_STEPS steps together (and, `spares`, every node's spare is warm)."""
    def together() -> bool:
        at_n = [s for s in all_steps(started) if s.world == nodes]
        return len({s.rank for s in at_n}) == nodes and len({s.step for s in at_n}) >= WARMUP_STEPS

    wait_for(together, 180, f"{mode}: {nodes} nodes training together")
    if spares:
        wait_for_spares(started)


def measure(mode: str, fault: str, nodes: int, target: int, started: list[Node], timeout: float) -> dict[str, Any]:
    def steps() -> list[Step]:
        return all_steps(started)

    wait_together(mode, nodes, started, spares=mode == "in-process" and fault == "worker")
    # Not right after a step record (when the bench sees it): at a random phase of the step cycle.
    time.sleep(random.uniform(0, KILL_PHASE_S))
    latest = {s.node: s for s in sorted((s for s in steps() if s.world == nodes), key=lambda s: s.ts)}
    # The last rank's node; c10d's store host (torchrun's first agent) must live.
    victim = max((n for n in started if not (mode == "torchrun" and n.index == 0)), key=lambda n: latest[n.index].rank)
    victim_pid = latest[victim.index].pid
    survivors = {n.index for n in started if n is not victim}
    pids_before = {i: latest[i].pid for i in survivors}

    old_pids = {**pids_before, victim.index: victim_pid}
    load = os.getloadavg()[0]
    if fault == "node":
        killed_at = victim.kill()
    else:
        killed_at = time.time()
        os.kill(victim_pid, signal.SIGKILL)

    def regrouped() -> list[Step]:
        """Records of the re-formed group: at its world size, after the kill, by a new process or by one that
        re-formed in place (a survivor can still finish the old group's step the victim had already sent)."""
        reformed_at = {n.index: min((e["ts"] for e in n.events if e["event"] == "reformed" and e["ts"] > killed_at),
                                    default=None) for n in started if n.events_dir is not None}
        return [s for s in steps() if s.ts > killed_at and s.world == target and (
            s.pid != old_pids[s.node] or (reformed_at.get(s.node) or float("inf")) < s.ts)]

    wait_for(lambda: bool(regrouped()), timeout, f"{mode}: first step at world size {target} after the {fault} kill")
    first = min(regrouped(), key=lambda s: s.ts)
    try:
        wait_for(lambda: survivors <= {s.node for s in regrouped() if s.step == first.step}, 30,
                 "every survivor's record of that step")
    except TimeoutError:
        pass  # pids_after then names only the survivors that recorded it
    new = set(regrouped())
    pids_after = {s.node: s.pid for s in new if s.node in survivors and s.step == first.step}
    # Steps the survivors had completed (one node alone: its own, before the kill).
    old = [s.step for s in steps() if (s.node in survivors or not survivors) and s.world == nodes and s not in new]
    last_completed = max(old, default=0)
    result: dict[str, Any] = {
        "recovery_s": round(first.ts - killed_at, 3),
        "survivor_pids_changed": pids_after != pids_before,
        "continued_from": first.step - 1,
        "last_completed": last_completed,
        "recomputed": max(0, last_completed - (first.step - 1)),
        "victim_rank": latest[victim.index].rank,
        "loadavg_1m": round(load, 2),
    }
    if mode != "torchrun":
        events = [e for n in started if n.index in survivors for e in n.events if e["ts"] > killed_at]
        agents = [e["ts"] for e in events if e["event"] in AGENT_EVENTS]
        worker_reforms = [e["reform_s"] for e in events if e["event"] == "reformed"]
        result["detect_s"] = round(min(agents) - killed_at, 3) if agents else None
        result["worker_reform_s"] = max(worker_reforms) if worker_reforms else None
        result["fallbacks"] = sum(e["event"] == "reform_fallback" for e in events)
        # The replacement process: from the kill to its start in the script (Resumable built), and its restore.
        fresh = {s.pid for s in new} - set(old_pids.values())
        mine = [e for n in started for e in n.events if e.get("pid") in fresh and e["ts"] > killed_at]
        begun = min((e["ts"] for e in mine if e["event"] == "worker_started"), default=None)
        resumed = min((e["ts"] for e in mine if e["event"] == "resumed"), default=None)
        if begun is not None:
            result["replacement_started_s"] = round(begun - killed_at, 3)
        if begun is not None and resumed is not None:
            result["replacement_restore_s"] = round(resumed - begun, 3)
    return result


def measure_join(mode: str, nodes: int, started: list[Node], start_joiner: Callable[[], Node],
                 timeout: float) -> dict[str, Any]:
    """`nodes` nodes train together; another node's agent starts; until the group's first step at nodes + 1."""
    def steps() -> list[Step]:
        return all_steps(started)

    # In-process: a job past its start, its nodes' warm spares warm, not competing for the CPU.
    wait_together(mode, nodes, started, spares=mode == "in-process")
    survivors = {n.index for n in started}
    latest = {s.node: s for s in sorted((s for s in steps() if s.world == nodes), key=lambda s: s.ts)}
    pids_before = {i: latest[i].pid for i in survivors}
    load = os.getloadavg()[0]
    joined_at = time.time()
    joiner = start_joiner()

    def grown() -> list[Step]:
        return [s for s in steps() if s.ts > joined_at and s.world == nodes + 1]

    wait_for(lambda: any(s.node == joiner.index for s in grown()) and survivors <= {s.node for s in grown()},
             timeout, f"{mode}: every node's first step at world size {nodes + 1} after a node joined")
    first = min((s for s in grown() if s.node == joiner.index), key=lambda s: s.ts)
    group_first = min(grown(), key=lambda s: s.ts)
    pids_after = {s.node: s.pid for s in grown() if s.node in survivors and s.step == group_first.step}
    old = [s.step for s in steps() if s.node in survivors and s.world == nodes]
    last_completed = max(old, default=0)
    # The survivors' longest pause: between two of their step records, from the joiner's start to the group's
    # first step at the new size (a restart mode's survivors pause for their own new processes).
    pauses = []
    for i in survivors:
        times = sorted(s.ts for s in steps() if s.node == i and joined_at - 5 <= s.ts <= group_first.ts + 1)
        pauses.extend(b - a for a, b in zip(times, times[1:], strict=False))
    result: dict[str, Any] = {
        "recovery_s": round(first.ts - joined_at, 3),
        "group_first_step_s": round(group_first.ts - joined_at, 3),
        "survivors_longest_pause_s": round(max(pauses), 3) if pauses else None,
        "survivor_pids_changed": pids_after != pids_before,
        "continued_from": group_first.step - 1,
        "last_completed": last_completed,
        "recomputed": max(0, last_completed - (group_first.step - 1)),
        "loadavg_1m": round(load, 2),
    }
    if joiner.events_dir is not None:
        steps()  # reads the event files
        restored = [e for e in joiner.events if e["event"] == "restored"]
        result["joiner_state_from"] = restored[0].get("tier") if restored else None
        result["joiner_prestarted"] = any(e["event"] == "joiner_prestarted" for e in joiner.events)
    return result


def summarize(runs: list[dict[str, Any] | None]) -> dict[str, Any]:
    ok = [r for r in runs if r is not None]
    entry: dict[str, Any] = {"runs": runs, "failed": len(runs) - len(ok)}
    if not ok:
        return entry
    entry["median_s"] = statistics.median(r["recovery_s"] for r in ok)
    entry["survivor_pids_changed"] = any(r["survivor_pids_changed"] for r in ok)
    entry["recomputed_max"] = max(r["recomputed"] for r in ok)
    pauses = [r["survivors_longest_pause_s"] for r in ok if r.get("survivors_longest_pause_s") is not None]
    if pauses:
        entry["survivors_longest_pause_median_s"] = statistics.median(pauses)
    detect = [r["detect_s"] for r in ok if r.get("detect_s") is not None]
    if detect:
        entry["detect_median_s"] = statistics.median(detect)
    return entry


def compare(scenarios: dict[str, dict[str, Any]], fault: str, nodes: int, script: str = "tiny") -> dict[str, Any]:
    """One fault and node count side by side: each mode's median, runs that recovered, survivors' pids,
    steps recomputed; the ratios to in-process; the target (a run that did not recover misses it)."""
    entry: dict[str, Any] = {}
    for m in MODES:
        if (found := scenarios.get(f"{m}_{fault}_{nodes}_nodes")) is None:
            continue
        runs = len(found["runs"])
        entry[m] = {"median_s": found.get("median_s"), "recovered": f"{runs - found['failed']}/{runs}",
                    "survivor_pids_changed": found.get("survivor_pids_changed"),
                    "recomputed_max": found.get("recomputed_max")}
        if "survivors_longest_pause_median_s" in found:
            entry[m]["survivors_longest_pause_median_s"] = found["survivors_longest_pause_median_s"]
    ours = entry.get("in-process", {}).get("median_s")
    for m in ("no-spare", "restart", "torchrun"):
        theirs = entry.get(m, {}).get("median_s")
        if ours and theirs:
            entry[f"{m}_over_in_process"] = round(theirs / ours, 1)
    if "in-process" in entry:
        inproc = scenarios[f"in-process_{fault}_{nodes}_nodes"]
        # Issue K's targets: CPU node loss 0.5 s, CPU worker kill 1 s; the GPT on one H200, worker kill 2 s.
        limit, recompute = {"node": (0.5, 0), "join": (3.0, 0)}.get(fault, (2.0 if script == "gpt" else 1.0, 1))
        entry["target"] = f"in-process median <= {limit} s, pids unchanged, <= {recompute} recomputed" + {
            "node": "", "join": " (from the joining agent's start to its first step)"}.get(
            fault, " (issue K: with a warm spare process)")
        entry["meets_target"] = (ours is not None and ours <= limit and inproc["recomputed_max"] <= recompute
                                 and inproc["failed"] == 0 and not inproc["survivor_pids_changed"])
    return entry


def code_version() -> dict[str, Any]:
    """The commit measured, and the tracked files that differed from it (the bench runs the working tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "uncommitted": changed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3], help="node counts for the node-loss scenario")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--worker-nodes", type=int, nargs="+", default=[2], help="node counts for the worker-kill scenario")
    p.add_argument("--skip-torchrun", action="store_true", help="leave the torchrun mode out")
    p.add_argument("--torchrun-nodes", type=int, nargs="+", default=None,
                   help="node counts to run torchrun at (default: all; it needs ~45 s per node loss)")
    p.add_argument("--timeout", type=float, default=180, help="give up on one recovery after this many seconds")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                   help="torchrun mode's backend; nccl: one GPU per simulated node. elastic-run modes run "
                        "train_tiny on gloo")
    p.add_argument("--script", choices=sorted(SCRIPTS), default="tiny",
                   help="the elastic-run modes' job: tiny (CPU), fsdp (sharded, CPU) or gpt (124M, bf16, one GPU "
                        "per node)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="leave every run's node outputs and events under this dir")
    args = p.parse_args()
    modes = [m for m in args.modes if not (m == "torchrun" and args.skip_torchrun)]

    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
        "code": code_version(),
        "backend": args.backend,
        "step_sleep_s": STEP_SLEEP_S,
        "script": args.script,
        "timing_source": "elastic-run: the workers' `step` events (ts, ms); torchrun: the workers' printed t=",
        "scenarios": {},
    }
    scenarios: dict[str, dict[str, Any]] = results["scenarios"]
    plan = [(f, n) for f in args.faults for n in (args.nodes if f == "node" else args.worker_nodes)]  # join: N + 1
    with EtcdServer() as etcd:
        for fault, nodes in plan:
            for mode in modes:
                if mode == "torchrun" and args.torchrun_nodes is not None and nodes not in args.torchrun_nodes:
                    continue
                runs: list[dict[str, Any] | None] = []
                for repeat in range(args.repeats):
                    keep = args.keep / f"{mode}_{fault}_{nodes}_nodes_{repeat}" if args.keep else None
                    try:
                        runs.append(one_run(mode, fault, nodes, etcd, args.timeout, args.backend, keep, args.script))
                    except TimeoutError as exc:
                        print(f"# {mode} {fault} {nodes} nodes: {exc}", file=sys.stderr)
                        runs.append(None)
                    print(f"# {mode} {fault} {nodes} nodes: {runs[-1]}", file=sys.stderr)
                scenarios[f"{mode}_{fault}_{nodes}_nodes"] = summarize(runs)
                for f, n in plan:
                    results[f"summary_{f}_{n}_nodes"] = compare(scenarios, f, n, args.script)
                results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
                if args.json:  # after every scenario: a run cut short still leaves what it measured
                    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
