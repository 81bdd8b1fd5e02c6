"""`elastic-run --metrics-port`: Prometheus metrics of the agent, read over HTTP while the job runs."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from elastic.etcd_server import free_port
from tests.conftest import REPO, Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_agent_serves_membership_metrics(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    proc = procs.elastic_run("--nproc-per-node", "1", "--metrics-port", str(port),
                             str(REPO / "bench" / "recovery_worker.py"), "--interval", "0.05", "--max-seconds", "60")
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    deadline, body = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            if re.search(r"^elastic_members 1\.0$", body, re.M):
                break
        except OSError:
            pass
        time.sleep(0.2)
    assert re.search(r"^elastic_members 1\.0$", body, re.M), body[-2000:] + "".join(lines[-20:])
    assert re.search(r"^elastic_generation 1\.0$", body, re.M)
    assert re.search(r"^elastic_degraded 0\.0$", body, re.M)
    assert "elastic_restarts_total" in body and "elastic_last_recovery_seconds" in body
