"""A real Prometheus for the observability tests: Debian's `prometheus` package, installed on first use.

`prometheus_bins()` finds `prometheus` and `promtool` on PATH, else runs `apt-get update` once and
`apt-get install -y prometheus` (as root; the package's service is not started in a container without
an init system, and the tests never use it), else skips with the reason. `PrometheusServer` runs one
server on a free loopback port with a config of the test's making, and ends it by its pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic.etcd_server import free_port

_INSTALL_TIMEOUT_S = 300
_tried: list[str] = []  # the first failure's reason, so that later tests skip at once


def prometheus_bins() -> tuple[str, str]:
    """(prometheus, promtool) paths; installs the Debian package if they are missing."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    if _tried:
        pytest.skip(_tried[0])
    reason = _install()
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    _tried.append(reason or "apt-get install prometheus did not put prometheus and promtool on PATH")
    pytest.skip(_tried[0])


def _install() -> str | None:
    if shutil.which("apt-get") is None:
        return "prometheus is not on PATH and there is no apt-get to install Debian's package"
    if os.geteuid() != 0:
        return "prometheus is not on PATH; installing Debian's package needs root (apt-get install prometheus)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                 "prometheus"]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"{' '.join(cmd[:2])} took more than {_INSTALL_TIMEOUT_S}s (no network?)"
        if done.returncode != 0:
            return f"{' '.join(cmd[:3])} failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    return None


class PrometheusServer:
    """One Prometheus with the scrape configs `scrape_configs` (job names and discovery; it scrapes every
    second) that evaluates `rule_files` every second."""

    def __init__(self, work: Path, scrape_configs: list[dict[str, Any]], rule_files: list[Path]) -> None:
        binary, _ = prometheus_bins()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": scrape_configs,
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (work / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(work / "prometheus.log")

    def _wait_ready(self, log: Path, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}): {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus was not ready within {timeout}s: {log.read_text()[-2000:]}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` now: [{"metric": labels, "value": float}, ...]."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return [{"metric": r["metric"], "value": float(r["value"][1])} for r in body["data"]["result"]]

    def values(self, expr: str, by: str = "rank") -> dict[str, float]:
        """`expr` now, keyed by the label `by`."""
        return {r["metric"].get(by, ""): r["value"] for r in self.query(expr)}

    def names(self) -> set[str]:
        body = json.loads(urllib.request.urlopen(f"{self.url}/api/v1/label/__name__/values", timeout=10).read())
        return set(body["data"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
