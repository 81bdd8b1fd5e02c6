"""A finished worker exits cleanly: destroy_process_group stops gloo's threads even when the script
builds its optimizer after creating the group (torch's dynamo import would otherwise keep the group
alive, and a gloo thread freeing a tensor during interpreter shutdown aborts the process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import os, socket, torch, torch.distributed as dist
import trainer  # the user's import, before the group exists
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
opt = torch.optim.Adam(model.parameters(), lr=0.1)  # imports dynamo, after the group exists
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print("threads", [n for n in names if "gloo" in n])
"""


@pytest.mark.timeout(120)
def test_destroy_process_group_stops_gloos_threads_after_the_optimizer_is_built() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=str(REPO), capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "threads []" in out.stdout, out.stdout + out.stderr
