"""Doing the faults of the catalog to a running cluster, and finding out up front which of them this
machine (and this training script) cannot do, with the reason. A fault that cannot run is reported
as skipped; it never passes silently.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.cluster import Cluster
from chaos.config import ChaosConfig
from chaos.etcd_members import EtcdMembers
from chaos.faults import CATALOG
from chaos.ledger import ProcessLedger
from chaos.network import NetnsNetwork
from chaos.schedule import PlannedFault
from ckpt.layout import COMMIT_FILE, parse_step_dir_name, step_dir_name
from ckpt.tier0 import HostTier
from core import tier0_dir
from core.deadline import Deadline
from core.procfs import alive, cmdline, descendants, environ
from core.tier0_dir import ENV as TIER0_ENV

SHARED_FLAGS = ("--shared-url", "--shared-dir", "--shared")
"""Flags by which a training script takes its shared-tier location, in order of preference."""


@dataclass(frozen=True)
class Capabilities:
    root: bool
    netns: str | None
    """None if `ip netns` works, else why not."""
    tmpfs: str | None
    """None if a size-limited tmpfs can be mounted, else why not."""
    shared_flag: str | None
    """The script's shared-tier flag (default script), or `{shared_dir}` when a custom script uses it."""


def probe(config: ChaosConfig, kinds: set[str]) -> Capabilities:
    """What this machine and script allow. Probes only what the planned faults need."""
    root = os.geteuid() == 0
    netns: str | None = "not probed"
    tmpfs: str | None = "not probed"
    if "partition-node" in kinds:
        netns = _probe_netns() if root else "network namespaces need root"
    if "disk-full" in kinds:
        tmpfs = _probe_tmpfs() if root else "mounting a size-limited tier-1 filesystem needs root"
    help_text = _script_help(config) if config.is_default_script else ""
    if config.is_default_script:
        shared_flag = next((f for f in SHARED_FLAGS if _has_flag(help_text, f)), None)
    else:
        shared_flag = "{shared_dir}" if any("{shared_dir}" in a for a in config.script_args or ()) else None
    return Capabilities(root=root, netns=netns, tmpfs=tmpfs, shared_flag=shared_flag)


def _probe_netns() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` tool is not installed"
    name = f"echaos-{uuid.uuid4().hex[:8]}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
        if made.returncode:
            return f"`ip netns add` failed: {made.stderr.strip()[:200]}"
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` failed: {exc}"
    return None


def _probe_tmpfs() -> str | None:
    import tempfile

    where = tempfile.mkdtemp(prefix="echaos-tmpfs-")
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", where], capture_output=True,
                              text=True, timeout=10)
        if made.returncode:
            return f"mounting a tmpfs failed: {made.stderr.strip()[:200]}"
        subprocess.run(["umount", where], capture_output=True, timeout=10)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mounting a tmpfs failed: {exc}"
    finally:
        os.rmdir(where)


def _script_help(config: ChaosConfig) -> str:
    try:
        return subprocess.run([sys.executable, str(config.script), "--help"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def skip_reason(kind: str, caps: Capabilities) -> str | None:
    """Why `kind` cannot run here, or None if it can."""
    if CATALOG[kind].needs_shared_tier and caps.shared_flag is None:
        return ("the training script has no shared tier (no --shared-url/--shared-dir flag, or no {shared_dir} "
                "in its arguments), so there is nothing for this fault to hit; it needs the two-tier checkpointer")
    if kind == "disk-full" and caps.tmpfs is not None:
        return f"needs a size-limited tier-1 filesystem: {caps.tmpfs}"
    if kind == "partition-node" and caps.netns is not None:
        return f"needs network namespaces: {caps.netns}"
    return None


# -- injection ------------------------------------------------------------------------------------


@dataclass
class Injection:
    node: str | None
    """The node hit (or the etcd member), by name."""
    target: str
    """Whom, in words: 'global rank 1 (pid 4242)'."""
    details: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    corrupted_step: int | None = None
    """The newest committed step whose tier-1 files a corruption damaged."""
    damaged_steps: tuple[int, ...] = ()
    """Every step a corruption damaged a copy of on the node: that one and its tier-0 snapshots'."""


@dataclass
class Target:
    cluster: Cluster
    etcd: EtcdMembers
    ledger: ProcessLedger
    tmpfs_mb: int | None = None
    """Size of each node's tier-1 tmpfs when disk-full is planned; None: plain directories."""
    sleep: Callable[[float], None] = time.sleep
    """How a lasting fault waits out its `hold_s` (tests pass their own)."""
    network: NetnsNetwork | None = None
    """The nodes' network namespaces, when partition-node is planned."""


def inject(fault: PlannedFault, to: Target) -> Injection:
    """Do `fault` now. Faults that last (`hold_s`) return once they are over and healed."""
    return _INJECTORS[fault.kind](fault, to)


def _no_node(fault: PlannedFault) -> Injection:
    return Injection(None, f"group rank {fault.target}", skipped="no node held that group rank when the fault fired")


def _kill_worker(fault: PlannedFault, to: Target, sig: int = signal.SIGKILL) -> Injection:
    assert isinstance(fault.target, int)
    found = to.cluster.worker_by_rank(fault.target)
    if found is None:
        return Injection(None, f"global rank {fault.target}", skipped="no worker was running when the fault fired")
    node, worker = found
    to.ledger.record(worker.pid, f"worker rank {worker.rank} of {node.name}")
    os.kill(worker.pid, sig)
    return Injection(node.name, f"global rank {worker.rank} (pid {worker.pid})", {"pid": worker.pid})


def _hang_worker(fault: PlannedFault, to: Target) -> Injection:
    return _kill_worker(fault, to, signal.SIGSTOP)


def _kill_node(fault: PlannedFault, to: Target) -> Injection:
    assert fault.target is not None
    node = to.cluster.node_by_group_rank(fault.target)
    if node is None:
        return _no_node(fault)
    tree = to.ledger.record_tree(node.pid)
    node.kill()
    deadline = time.monotonic() + 5
    left = [p for p in tree if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return Injection(node.name, f"group rank {fault.target} ({len(tree)} processes)",
                     {"pids": tree, "left_alive": left})


def _helpers(agent_pid: int) -> list[int]:
    """The checkpoint helper processes of a node's agent (elastic/node_helper.py)."""
    return [p for p in descendants(agent_pid) if "ckpt.helper_process" in cmdline(p)]


def _kill_ckpt_helper(fault: PlannedFault, to: Target) -> Injection:
    assert fault.target is not None
    node = to.cluster.node_by_group_rank(fault.target)
    if node is None:
        return _no_node(fault)
    helpers = _helpers(node.pid)
    if not helpers:
        return Injection(node.name, f"group rank {fault.target}",
                         skipped="the node runs no checkpoint helper (ELASTIC_CKPT_HELPER=0, or no tier 0)")
    to.ledger.record(helpers[0], f"checkpoint helper of {node.name}")
    os.kill(helpers[0], signal.SIGKILL)
    return Injection(node.name, f"group rank {fault.target}'s checkpoint helper (pid {helpers[0]})",
                     {"pid": helpers[0]})


def _kill_etcd_member(fault: PlannedFault, to: Target) -> Injection:
    live = to.etcd.live
    member = fault.target if fault.target in live else live[0]
    assert isinstance(member, int)
    pid = to.etcd.kill(member)
    return Injection(f"etcd m{member}", f"etcd member m{member} (pid {pid})", {"pid": pid})


def _restart_etcd(fault: PlannedFault, to: Target) -> Injection:
    members = to.etcd.restart(fault.hold_s)
    return Injection("etcd", f"etcd members {[f'm{m}' for m in members]}", {"down_s": fault.hold_s})


def _corrupt_checkpoint(fault: PlannedFault, to: Target) -> Injection:
    assert fault.target is not None
    node = to.cluster.node_by_group_rank(fault.target)
    if node is None:
        return _no_node(fault)
    if newest_committed(node.local_dir)[1] is None:
        return Injection(node.name, f"group rank {fault.target}",
                         skipped=f"{node.local_dir} holds no committed checkpoint yet")
    # Nobody reads a checkpoint until the group restores: make it restore, from this node's side. The
    # workers are stopped first, so that no newer save commits between choosing the step and the restore.
    workers = node.workers()
    killed = None
    # The node's tier 0 (host memory, ckpt/tier0.py) holds newer snapshots than its disk: damage them too,
    # so that the restore has to reject them and the disk's newest step, and go back past both.
    tier0 = _tier0_dir(node.pid, workers)
    # Every node's workers die, after the damage: a survivor that re-forms in place (elastic/reform.py) would
    # hand its live state to the replacement, so no restore would read a checkpoint; and a warm spare restores
    # within a fraction of a second, before bytes flipped after the kill. Stopped first, they save nothing more.
    # The nodes' checkpoint helpers (ckpt/helper.py) finish snapshots and tier-1 writes for their workers: stopped
    # and killed with them, so that none publishes or commits a step after the damage (let go, one stopped
    # between a rank directory's rename and the COMMIT would commit a newer intact step); the agents start new
    # ones.
    everyone = [(n, w) for n in to.cluster.live_nodes for w in n.workers()]
    helpers = [p for n in to.cluster.live_nodes for p in _helpers(n.pid)]
    for pid in [w.pid for _, w in everyone] + helpers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        step, step_dir = newest_committed(node.local_dir)
        flipped = {} if step_dir is None else {str(f): flip_bytes(f)
                                                for f in sorted(step_dir.glob("rank_*/*.safetensors"))}
        damaged = {step} if step is not None else set()
        if tier0 and step_dir is not None:
            for f in sorted(Path(tier0).glob("rank_*/slot_*/*.safetensors")):
                slot_step = _slot_step(f.parent / "manifest.json")
                if slot_step is not None:
                    flipped[str(f)] = flip_bytes(f)
                    damaged.add(slot_step)
    finally:
        for n, w in everyone:
            to.ledger.record(w.pid, f"worker rank {w.rank} of {n.name}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
        for pid in helpers:
            to.ledger.record(pid, "a checkpoint helper")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in [w.pid for _, w in everyone] + helpers:
            _wait_gone(pid)
    killed = workers[0].pid if workers else None
    if step_dir is None:  # retention took it since the check above: a restart with nothing to corrupt
        return Injection(node.name, f"group rank {fault.target}", details={"killed_worker_pid": killed},
                         skipped=f"{node.local_dir} holds no committed checkpoint any more")
    if not flipped:
        return Injection(node.name, f"group rank {fault.target}", skipped=f"{step_dir} holds no safetensors file",
                         details={"killed_worker_pid": killed})
    return Injection(node.name, f"group rank {fault.target}: step {step}",
                     {"files": flipped, "killed_worker_pid": killed}, corrupted_step=step,
                     damaged_steps=tuple(sorted(damaged)))


def _tier0_dir(agent_pid: int, workers: list[Any]) -> str | None:
    """The node's tier-0 directory: named in a worker's environment, else (workers forked from a warm spare get
    theirs over a pipe: /proc shows the spare's) the one the agent made, found by its pid."""
    named = next((d for w in workers if (d := environ(w.pid).get(TIER0_ENV))), None)
    if named:
        return named
    made = tier0_dir.node_dirs_of(agent_pid)
    return str(made[0]) if made else None


def _slot_step(manifest: Path) -> int | None:
    """The step of a published tier-0 slot (its manifest's), None for a slot not published or unreadable."""
    try:
        step = json.loads(manifest.read_bytes()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    deadline = Deadline.after(timeout_s)
    while alive(pid) and not deadline.expired():
        time.sleep(0.01)


def newest_committed(local_dir: Path) -> tuple[int | None, Path | None]:
    """The newest step committed in tier-1 directory `local_dir` and its directory ((None, None): none)."""
    newest = max(committed_steps(local_dir), default=None)
    return (None, None) if newest is None else (newest, local_dir / step_dir_name(newest))


def steps_held(node: Any, nproc: int) -> set[int]:
    """The steps `node` holds whole: committed in its tier 1, or published in its tier 0 by each of its `nproc`
    ranks (their own snapshots: the replicas it keeps for other nodes do not stand in for a rank of its own)."""
    held = committed_steps(node.local_dir)
    root = _tier0_dir(node.pid, node.workers())
    if root is not None:
        tier0 = HostTier(Path(root), read_timeout=2.0, local_world_size=nproc)
        tier0.with_replicas = False
        held.update(tier0.committed_steps())
    return held


def committed_steps(local_dir: Path) -> set[int]:
    """The steps committed in tier-1 directory `local_dir`."""
    if not local_dir.is_dir():
        return set()
    return {step for d in local_dir.iterdir()
            if (step := parse_step_dir_name(d.name)) is not None and (d / COMMIT_FILE).is_file()}


def flip_bytes(path: Path, count: int = 16) -> list[int]:
    """XOR `count` bytes spread over the tensor data of a safetensors file (past its header) with 0xFF.
    Returns the offsets flipped."""
    data = bytearray(path.read_bytes())
    start = 0
    if len(data) >= 8:
        header = int.from_bytes(data[:8], "little")
        if 8 + header < len(data):
            start = 8 + header
    span = len(data) - start
    if span <= 0:
        return []
    offsets = sorted({start + (i * span) // count for i in range(count)})
    for off in offsets:
        data[off] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return offsets


def _shared_storage_outage(fault: PlannedFault, to: Target) -> Injection:
    shared = to.cluster.shared_dir
    offline = shared.with_name(shared.name + ".offline")
    os.rename(shared, offline)
    shared.write_text("shared tier taken offline by elastic-chaos\n")  # every path below it now fails: ENOTDIR
    try:
        to.sleep(fault.hold_s)
    finally:
        shared.unlink()
        os.rename(offline, shared)
    return Injection("shared", f"shared tier {shared}", {"down_s": fault.hold_s})


def _disk_full(fault: PlannedFault, to: Target) -> Injection:
    assert fault.target is not None
    node = to.cluster.node_by_group_rank(fault.target)
    if node is None:
        return _no_node(fault)
    filler = node.local_dir / ".elastic-chaos-fill"
    written = 0
    chunk = b"\0" * (1 << 20)
    try:
        with open(filler, "wb") as f:
            while True:
                try:
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        to.sleep(fault.hold_s)
    finally:
        filler.unlink(missing_ok=True)
    return Injection(node.name, f"group rank {fault.target}: tier 1 full",
                     {"filled_bytes": written, "full_s": fault.hold_s})


def _add_node(fault: PlannedFault, to: Target) -> Injection:
    node = to.cluster.add_node(tmpfs_mb=to.tmpfs_mb)
    return Injection(node.name, f"new node {node.name}", {"pid": node.pid})


def _partition_node(fault: PlannedFault, to: Target) -> Injection:
    assert fault.target is not None
    node = to.cluster.node_by_group_rank(fault.target)
    if node is None:
        return _no_node(fault)
    if to.network is None or node.net is None:
        return Injection(node.name, f"group rank {fault.target}",
                         skipped="the node was not started in a network namespace")
    to.network.cut(node.net)
    node.partitioned = True
    return Injection(node.name, f"group rank {fault.target} ({node.net.address} cut off)",
                     {"namespace": node.net.namespace, "address": node.net.address})


_INJECTORS = {
    "kill-worker": _kill_worker,
    "kill-node": _kill_node,
    "hang-worker": _hang_worker,
    "kill-etcd-member": _kill_etcd_member,
    "restart-etcd": _restart_etcd,
    "corrupt-checkpoint": _corrupt_checkpoint,
    "shared-storage-outage": _shared_storage_outage,
    "disk-full": _disk_full,
    "kill-ckpt-helper": _kill_ckpt_helper,
    "add-node": _add_node,
    "partition-node": _partition_node,
}
assert set(_INJECTORS) == set(CATALOG), "every catalog entry needs an injector"
