"""The one place that parses Linux `/proc`: a process's state, parent and start time, its command
line and environment, and its tree of descendants (to end "a whole node" by pid).

torch's agent starts every worker in a session of its own, so killing an agent's process group
leaves its workers running as orphans. Killing a node (tests, the chaos harness, benches) therefore
walks the process tree from the agent's pid and signals every process in it. Pids are reused: the
start time (`ProcStat.start`) tells a process from a later one with the same pid.

Every reader returns "nothing" (None, "", {}) for a process that is gone or not readable, since a
process may exit between listing `/proc` and reading its files.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    """The fields of `/proc/<pid>/stat` that callers use."""

    state: str
    """One letter: R running, S sleeping, T stopped, Z zombie (dead, not yet reaped), ..."""
    ppid: int
    start: int
    """Start time after boot, in clock ticks: with the pid, the identity of a process."""


def stat(pid: int) -> ProcStat | None:
    """State, parent and start time of `pid`, or None if it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: the fields after it follow the last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return ProcStat(state=fields[0], ppid=int(fields[1]), start=int(fields[19]))


def alive(pid: int, start: int | None = None) -> bool:
    """Whether `pid` runs (a zombie does not), and, with `start`, is still the same process."""
    st = stat(pid)
    return st is not None and st.state != "Z" and (start is None or st.start == start)


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" if gone)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with ({} if gone or not ours to read)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def pids() -> list[int]:
    """Every pid in `/proc` now."""
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid in pids():
        st = stat(pid)
        if st is not None:
            children.setdefault(st.ppid, []).append(pid)
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (children first, then theirs), not including `pid`."""
    tree = _children_map()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for child in tree.get(p, []):
                if child not in found:
                    found.append(child)
                    nxt.append(child)
        frontier = nxt
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal `pid` and every descendant. The tree is read first, so children re-parented to init
    by the parent's death are still reached. Returns the pids signalled."""
    targets = [pid, *descendants(pid)]
    signalled = []
    for p in targets:
        try:
            os.kill(p, sig)
            signalled.append(p)
        except ProcessLookupError:
            pass
    return signalled
