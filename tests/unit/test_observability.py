"""deploy/observability: the Grafana dashboard parses and asks only for series the project exports (those a
real agent serves, with a worker file that has every series); the alert rules pass `promtool check rules`
and their unit tests (`promtool test rules`: each alert fires on a sick job, none on a healthy one); the
Kubernetes trainer pods are scraped on the agent's port; the Slurm scrape config passes promtool (node.sh's
target files are read by a real Prometheus in tests/integration/test_metrics_prometheus.py)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic.job_metrics import JobMetrics
from elastic.metrics import AgentMetrics
from elastic.worker_metrics import SPECS, WorkerMetrics, file_path
from tests.prometheus_fixtures import prometheus_bins

pytestmark = pytest.mark.timeout(300)  # a first run installs Debian's prometheus package

OBS = Path(__file__).resolve().parents[2] / "deploy" / "observability"
K8S = OBS.parent / "k8s"
_NAME = re.compile(r"\b(elastic_[a-z0-9_]+)\b")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """The sample names a real agent serves, its workers' series included."""
    directory = tmp_path_factory.mktemp("progress")
    worker = WorkerMetrics(file_path(directory, 0), rank=0, local_rank=0, restart=0)
    for name, spec in SPECS.items():
        if spec.kind == "histogram":
            worker.observe(name, 0.1)
        else:
            worker.set(name, 1.0, "x" if spec.label else "")
    worker.flush()
    metrics = AgentMetrics.start(0, "127.0.0.1")
    try:
        JobMetrics(directory, metrics)
        text = generate_latest(metrics._registry).decode()
        yield {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    finally:
        metrics.stop()


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((OBS / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def test_dashboard_queries_only_exported_series(exported: set[str]) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10
    used = {name for e in exprs for name in _NAME.findall(e)}
    assert used - exported == set(), f"dashboard.json asks for series no agent serves: {sorted(used - exported)}"
    for wanted in ("elastic_goodput_ratio", "elastic_train_tokens_per_second", "elastic_ckpt_upload_lag_steps",
                   "elastic_members", "elastic_restarts_total", "elastic_train_step_seconds_bucket"):
        assert wanted in used, wanted


def test_alert_rules_use_exported_series_and_pass_promtool(exported: set[str]) -> None:
    rules = [r for g in yaml.safe_load((OBS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    used = {name for r in rules for name in _NAME.findall(r["expr"])}
    assert used - exported == set(), f"alerts.yml asks for series no agent serves: {sorted(used - exported)}"
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert alerts == {"ElasticGoodputLow", "ElasticStragglerRank", "ElasticUploadLagGrowing", "ElasticNoProgress",
                      "ElasticSavesFailing", "ElasticDegraded"}
    tested = set(re.findall(r"alertname: (\w+)", (OBS / "alerts_test.yml").read_text()))
    assert tested == alerts, f"alerts without a promtool unit test: {sorted(alerts - tested)}"
    _, promtool = prometheus_bins()
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *args], cwd=OBS, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def _trainer_pod_templates() -> list[dict[str, object]]:
    job = next(d for d in yaml.safe_load_all((K8S / "job.yaml").read_text()) if d and d["kind"] == "Job")
    jobset = next(d for d in yaml.safe_load_all((K8S / "jobset" / "jobset.yaml").read_text())
                  if d and d["kind"] == "JobSet")
    return [job["spec"]["template"], *(r["template"]["spec"]["template"] for r in jobset["spec"]["replicatedJobs"])]


def test_kubernetes_trainer_pods_are_scraped_on_the_agents_metrics_port() -> None:
    monitor = yaml.safe_load((OBS / "podmonitor.yaml").read_text())
    templates = _trainer_pod_templates()
    assert len(templates) >= 2
    for template in templates:
        meta, spec = template["metadata"], template["spec"]  # type: ignore[index]
        container = next(c for c in spec["containers"] if c["name"] == "elastic-run")
        flag = next(a for a in container["args"] if a.startswith("--metrics-port="))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        annotations = meta["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(flag.split("=")[1]) == ports["metrics"] == int(annotations["prometheus.io/port"])
        wanted = monitor["spec"]["selector"]["matchLabels"]
        assert wanted.items() <= meta["labels"].items(), "the PodMonitor does not select the trainer pods"
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    relabel = yaml.safe_load((OBS / "prometheus-kubernetes.yml").read_text())["scrape_configs"][0]["relabel_configs"]
    sources = {s for r in relabel for s in r.get("source_labels", [])}
    assert {"__meta_kubernetes_pod_annotation_prometheus_io_scrape",
            "__meta_kubernetes_pod_annotation_prometheus_io_port"} <= sources


def test_slurm_scrape_config_passes_promtool() -> None:
    # (Debian's prometheus is built without Kubernetes discovery: prometheus-kubernetes.yml is checked above.)
    _, promtool = prometheus_bins()
    done = subprocess.run([promtool, "check", "config", "prometheus-slurm.yml"], cwd=OBS, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
