"""Find and end a process together with all its descendants, by pid.

torch's agent starts every worker in a session of its own, so killing an agent's process group
leaves its workers running as orphans. "Kill a whole node" (tests, the chaos harness, benches)
therefore walks the process tree from the agent's pid via /proc and signals every process in it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: the ppid follows the last ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
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
