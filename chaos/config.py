"""The configuration of one chaos run: a frozen, keyword-only dataclass, checked once up front.

Everything that can be wrong with the input (an unknown fault, too few nodes for a fault, a script
that does not exist, a global batch that some world size cannot divide) raises ValueError here,
before any process starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from chaos.faults import FaultSpec, check_feasible, max_nodes
from chaos.schedule import LASTING, MAX_HOLD_S, plan

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "train_tiny.py"
"""The default training script."""

PLACEHOLDERS = ("local_dir", "shared_dir", "node", "steps", "ckpt_every", "seed", "global_batch", "dataset_size")
"""`{name}` in a custom script's arguments is replaced per node by the harness."""


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    report_dir: Path
    """Where report.json, report.md, timeline.png and the node logs go."""
    nodes: int = 2
    """Simulated nodes at the start, each one `elastic-run` agent with its workers."""
    nproc_per_node: int = 1
    """Workers per node."""
    steps: int = 40
    """Optimizer steps of the job (passed to the default script; `{steps}` for a custom one)."""
    faults: tuple[FaultSpec, ...] = ()
    """Faults to inject, in this order."""
    seed: int = 0
    """Seed of the fault plan: steps and targets. The training itself uses `train_seed`."""
    etcd_members: int = 1
    """Members of the etcd cluster: 1 or 3."""
    ckpt_every: int = 5
    """Checkpoint interval in steps (tier 1); bounds the steps a fault may cost."""
    snapshot_every: int = 1
    """Tier-0 snapshot interval of the default script (--snapshot-every; 0: only at checkpoint steps): a
    worker's replacement resumes from the node's memory, so a resume may be at any multiple of it."""
    hang_timeout_s: float = 5.0
    """The agents' --hang-timeout, set when hang-worker is planned: a worker without progress this long is killed."""
    reform: str = "in-process"
    """The agents' --reform: survivors re-form in place (in-process, elastic-run's default) or restart (restart)."""
    warm_spare: bool | None = None
    """The agents' --warm-spare / --no-warm-spare; None: elastic-run's default (on, unless ELASTIC_WARM_SPARE=0)."""
    train_seed: int = 0
    """The training script's --seed (model init, data order); the same for the reference run."""
    global_batch: int | None = None
    """Samples per step; None: the smallest multiple of every possible world size that is >= 12."""
    dataset_size: int | None = None
    """Samples in the dataset; None: 20 global batches plus a partial tail, so a run spans epochs."""
    step_sleep_s: float | None = None
    """The default script's --step-sleep, so faults land between steps on a fast machine. None: 0.05 s,
    or more when a fault that lasts seconds (etcd down, an outage, a full disk) needs training time to
    play out before the next fault is due."""
    script: Path = TINY
    """The training script, run by every node's agent."""
    script_args: tuple[str, ...] | None = None
    """The script's arguments with `{placeholders}`; None: the default script's own, from this config."""
    timeout_s: float = 600.0
    """Deadline of one job (the reference run or the chaos run), start to finish."""
    recovery_timeout_s: float = 120.0
    """Deadline for the job to make progress again after a fault."""
    scenario: str | None = None
    """The preset this config came from, for the report."""
    work_dir: Path | None = None
    """Scratch space for local tiers, the shared tier and etcd data; None: a temporary dir, removed after."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {self.nodes}")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.ckpt_every < 1:
            raise ValueError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if self.snapshot_every < 0:
            raise ValueError(f"--snapshot-every must be at least 0, got {self.snapshot_every}")
        if self.etcd_members not in (1, 3):
            raise ValueError(f"--etcd-members must be 1 or 3, got {self.etcd_members}")
        if self.reform not in ("in-process", "restart"):
            raise ValueError(f"--reform must be in-process or restart, got {self.reform!r}")
        for flag, seconds in (("--hang-timeout", self.hang_timeout_s), ("--timeout", self.timeout_s),
                              ("the recovery timeout", self.recovery_timeout_s)):
            if not 0 < seconds < math.inf:  # nan fails too
                raise ValueError(f"{flag} must be a positive, finite number of seconds, got {seconds}")
        if not self.script.is_file():
            raise ValueError(f"training script {str(self.script)!r} does not exist")
        problems = check_feasible(self.faults, nodes=self.nodes, nproc_per_node=self.nproc_per_node,
                                  etcd_members=self.etcd_members)
        if problems:
            raise ValueError("; ".join(problems))
        if self.script_args is not None:
            for arg in self.script_args:
                for name in _placeholders_in(arg):
                    if name not in PLACEHOLDERS:
                        raise ValueError(f"script argument {arg!r} uses unknown placeholder {{{name}}}; "
                                         f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
        batch = self.effective_global_batch
        if batch < 1:  # 0 divides every world size; each worker then refused it, restarted until --timeout
            raise ValueError(f"--global-batch must be at least 1, got {batch}")
        bad = [w for w in self.world_sizes if batch % w]
        if bad:
            raise ValueError(f"global batch {batch} does not divide world size(s) {bad} that this run can reach "
                             f"(worlds {self.world_sizes}); pick a multiple of {math.lcm(*self.world_sizes)}")
        plan(self.faults, steps=self.steps, ckpt_every=self.ckpt_every, seed=self.seed, nodes=self.nodes,
             nproc_per_node=self.nproc_per_node, etcd_members=self.etcd_members)  # raises if the steps are too few
        if self.dataset_size is not None and self.dataset_size < batch:
            raise ValueError(f"dataset size {self.dataset_size} is smaller than the global batch {batch}")

    @property
    def max_nodes(self) -> int:
        """The agents' --nnodes maximum: the start nodes plus every add-node."""
        return max_nodes(self.faults, self.nodes)

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the job can run at (min 1 node .. max nodes)."""
        return [k * self.nproc_per_node for k in range(1, self.max_nodes + 1)]

    @property
    def effective_global_batch(self) -> int:
        if self.global_batch is not None:
            return self.global_batch
        unit = math.lcm(*self.world_sizes)
        return unit * max(1, math.ceil(12 / unit))

    @property
    def effective_dataset_size(self) -> int:
        return self.dataset_size if self.dataset_size is not None else 20 * self.effective_global_batch + 7

    @property
    def effective_step_sleep(self) -> float:
        if self.step_sleep_s is not None:
            return self.step_sleep_s
        lasting = sum(1 for f in self.faults if f.kind in LASTING)
        if not lasting:
            return 0.05
        slot = max(1, (self.steps - self.ckpt_every - 2) // len(self.faults))
        return round(max(0.05, (MAX_HOLD_S + 4.0) / slot), 3)

    @property
    def detects_hangs(self) -> bool:
        """The agents run with --hang-timeout only when a hang is planned (the brief's hang-worker needs it)."""
        return any(f.kind == "hang-worker" for f in self.faults)

    @property
    def resume_every(self) -> int:
        """The steps a resume may be at are multiples of this (tier-0 snapshots or checkpoints)."""
        return self.snapshot_every if self.is_default_script and self.snapshot_every else self.ckpt_every

    @property
    def is_default_script(self) -> bool:
        return self.script_args is None

    def script_argv(self, *, local_dir: Path, shared_dir: Path, node: str) -> list[str]:
        """The script's arguments for one node."""
        values = {
            "local_dir": str(local_dir), "shared_dir": str(shared_dir), "node": node, "steps": str(self.steps),
            "ckpt_every": str(self.ckpt_every), "seed": str(self.train_seed),
            "global_batch": str(self.effective_global_batch), "dataset_size": str(self.effective_dataset_size),
        }
        if self.script_args is None:
            return ["--steps", values["steps"], "--ckpt-dir", values["local_dir"], "--ckpt-every", values["ckpt_every"],
                    "--snapshot-every", str(self.snapshot_every), "--seed", values["seed"],
                    "--global-batch", values["global_batch"], "--dataset-size", values["dataset_size"],
                    "--step-sleep", str(self.effective_step_sleep)]
        return [_substitute(arg, values) for arg in self.script_args]


def _placeholders_in(arg: str) -> list[str]:
    return re.findall(r"\{([A-Za-z_]+)\}", arg)


def _substitute(arg: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        arg = arg.replace("{" + name + "}", value)
    return arg

