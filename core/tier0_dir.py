"""The node's tier-0 directory: host shared memory that belongs to the node, not to a worker.

elastic-run's agent makes one private directory in tmpfs (/dev/shm) when it starts, hands it to its
workers in `$ELASTIC_TIER0_DIR`, and removes it when it exits. A worker's checkpointer keeps its
newest snapshots there (ckpt/tier0.py), so they outlive a worker that is killed: its replacement
restores from memory instead of disk. The directory is private to the node (mode 0700, named after
the agent's pid), so simulated nodes on one machine never see each other's. An agent killed with
SIGKILL cannot remove its directory: each new agent first removes those of agents that no longer
exist (core/owned_dir.py), as elastic/progress.py does for its beat files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from core import owned_dir

ENV = "ELASTIC_TIER0_DIR"
"""The variable that names the node's tier-0 directory for its workers."""

_PREFIX = "elastic-tier0-"


def shm_root() -> Path:
    """Where tier 0 lives: /dev/shm where it is a directory (Linux), else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def make_node_dir(root: Path | None = None) -> str:
    """A fresh tier-0 directory for this agent (0700), after removing those of dead agents (core/owned_dir.py)."""
    return owned_dir.make(root if root is not None else shm_root(), _PREFIX)


def node_dirs_of(agent_pid: int, root: Path | None = None) -> list[Path]:
    """The tier-0 directories the agent with this pid made (the chaos harness: a worker forked from a warm spare
    got its environment over a pipe, so its /proc/<pid>/environ does not name the directory)."""
    return sorted((root if root is not None else shm_root()).glob(f"{_PREFIX}{agent_pid}-*"))


def remove_node_dir(directory: str | Path) -> None:
    """Free the node's tier-0 memory (at the agent's exit)."""
    shutil.rmtree(directory, ignore_errors=True)
