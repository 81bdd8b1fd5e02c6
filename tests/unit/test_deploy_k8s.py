"""deploy/k8s: every manifest validates against the Kubernetes schema (strict, offline, with the
schemas kubernetes-validate bundles), and the manifests agree with each other and with elastic-run:
the arguments the trainer pods pass parse with elastic-run's own parser, point at the etcd Service,
and put tier 1 on the node-local volume."""

from __future__ import annotations

import copy
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from elastic.launcher import build_parser

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# The oldest Kubernetes the manifests support (successPolicy, podFailurePolicy) and the newest
# whose schema the installed kubernetes-validate bundles.
KUBE_VERSIONS = ("1.31", latest_version())

Doc = dict[str, Any]


def _docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))


def _find(kind: str, name: str | None = None, under: Path = K8S) -> Doc:
    hits = [
        d for p in MANIFESTS if under in p.parents for d in _docs(p)
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"expected one {kind} {name or ''} under {under}, found {len(hits)}"
    return hits[0]


def _jobs_in(doc: Doc) -> list[Doc]:
    """The batch/v1 Jobs a manifest describes: itself, or the Job templates of a JobSet."""
    if doc["kind"] == "Job":
        return [doc]
    if doc["kind"] == "JobSet":
        return [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": f"{doc['metadata']['name']}-{rj['name']}"},
                "spec": rj["template"]["spec"],
            }
            for rj in doc["spec"]["replicatedJobs"]
        ]
    return []


def _validate(doc: Doc, version: str) -> None:
    if doc["kind"] == "JobSet":
        # A CRD: no bundled schema. Its Job templates are plain batch/v1 Jobs; validate those.
        assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        for job in _jobs_in(doc):
            kubernetes_validate.validate(job, version, strict=True)
        return
    kubernetes_validate.validate(doc, version, strict=True)


def test_there_are_manifests() -> None:
    names = {p.relative_to(K8S).as_posix() for p in MANIFESTS}
    assert {
        "base/etcd.yaml",
        "base/config.yaml",
        "base/shared-tier-secret.yaml",
        "job.yaml",
        "jobset/jobset.yaml",
    } <= names


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_manifest_validates_strictly(path: Path, version: str) -> None:
    docs = _docs(path)
    assert docs, f"{path} holds no YAML document"
    for doc in docs:
        try:
            _validate(doc, version)
        except kubernetes_validate.SchemaNotFoundError as exc:  # the CLI only warns; we fail
            pytest.fail(f"{path}: no schema for {doc['apiVersion']} {doc['kind']}: {exc.message}")
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            pytest.fail(f"{path}: {name} invalid for Kubernetes {version} at {where}: {exc.message}")


def test_strict_validation_rejects_what_the_api_server_would() -> None:
    """The checks above have teeth: an unknown field, a wrong type and a missing field all fail."""
    job = _find("Job", "elastic-train")
    kubernetes_validate.validate(job, KUBE_VERSIONS[0], strict=True)

    unknown = copy.deepcopy(job)
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["parallelism"] = "four"
    missing = copy.deepcopy(job)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]
    for bad in (unknown, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: p.parent.relative_to(REPO).as_posix())
def test_kustomization_lists_exactly_its_manifests(kustomization: Path) -> None:
    k = yaml.safe_load(kustomization.read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    here = kustomization.parent
    for res in k["resources"]:
        target = (here / res).resolve()
        assert target.exists(), f"{kustomization}: resource {res} does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), (
                f"{kustomization}: {res} is a directory without kustomization.yaml"
            )
        else:
            assert target.parent == here.resolve(), (
                f"{kustomization}: {res} lies outside the kustomization (kustomize refuses that)"
            )
    listed = {(here / r).resolve() for r in k["resources"]}
    for manifest in here.glob("*.yaml"):
        if manifest.name != "kustomization.yaml":
            assert manifest.resolve() in listed, f"{manifest} is not listed in {kustomization}"
    # The `images:` rewrite must name the image the manifests actually use.
    used = {
        c["image"] for r in listed for p in ([r] if r.is_file() else [])
        for d in _docs(p) for job in _jobs_in(d) for c in job["spec"]["template"]["spec"]["containers"]
    }
    for image in k.get("images", []):
        assert f"{image['name']}:{image['newTag']}" in used, (
            f"{kustomization}: images entry {image['name']} matches no container"
        )


def _args(container: Doc) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def test_etcd_cluster_is_three_members_that_find_each_other() -> None:
    sts = _find("StatefulSet", "etcd")
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()

    headless = _find("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= labels.items()
    client = _find("Service", "etcd-client")
    assert client["spec"]["selector"].items() <= labels.items()
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]

    (container,) = spec["template"]["spec"]["containers"]
    assert re.fullmatch(
        r"(quay\.io/coreos|gcr\.io/etcd-development)/etcd:v3\.5\.(1[1-9]|[2-9]\d)", container["image"]
    ), "etcd 3.5.11+ is needed for the /livez and /readyz probes"
    flags = dict(a.split("=", 1) for a in _args(container) if a.startswith("--"))
    svc = spec["serviceName"]
    peer = "http://{name}." + svc + ".$(POD_NAMESPACE).svc:2380"
    members = [m.split("=", 1) for m in flags["--initial-cluster"].split(",")]
    assert members == [[f"etcd-{i}", peer.format(name=f"etcd-{i}")] for i in range(spec["replicas"])]
    assert flags["--initial-advertise-peer-urls"] == peer.format(name="$(POD_NAME)")
    assert flags["--name"] == "$(POD_NAME)"
    assert flags["--listen-client-urls"].endswith(":2379")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}

    # Probes hit the plain-HTTP metrics listener: liveness must not need a leader, readiness must.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert flags["--listen-metrics-urls"].endswith(f":{ports['metrics']}")
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}

    # Data on a PersistentVolume per member, mounted where --data-dir points.
    (claim,) = spec["volumeClaimTemplates"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"]
    assert flags["--data-dir"].startswith(mount["mountPath"] + "/")
    assert spec["template"]["spec"]["enableServiceLinks"] is False  # etcd would read ETCD_SERVICE_HOST etc. as flags

    pdb = _find("PodDisruptionBudget", "etcd")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    quorum = spec["replicas"] // 2 + 1
    assert spec["replicas"] - pdb["spec"]["maxUnavailable"] >= quorum


def _config() -> dict[str, str]:
    return _find("ConfigMap", "elastic-train-config")["data"]


FAKE_FIELDS = {
    "metadata.name": "elastic-train-2-x7k2p",
    "metadata.namespace": "elastic-train",
    "status.podIP": "10.1.2.3",
    "metadata.labels['batch.kubernetes.io/job-name']": "elastic-train",
    "metadata.labels['batch.kubernetes.io/controller-uid']": "0b7c7c2e-uid",
    "metadata.labels['jobset.sigs.k8s.io/jobset-name']": "elastic-train",
    "metadata.labels['jobset.sigs.k8s.io/jobset-uid']": "5d1e-uid",
    "metadata.labels['jobset.sigs.k8s.io/restart-attempt']": "0",
}


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, unknown ones stay as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _container_env(container: Doc, secrets: dict[str, Doc]) -> dict[str, str]:
    """The environment the kubelet would give this container, with fake downward-API values."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(_find("ConfigMap", src["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env)
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = FAKE_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            secret = secrets.get(ref["name"])
            if secret is None or ref["key"] not in secret.get("stringData", secret.get("data", {})):
                assert ref.get("optional") is True, (
                    f"env {e['name']} reads {ref['name']}/{ref['key']}, which no Secret defines"
                )
                continue
            env[e["name"]] = "<secret>"
    return env


TRAINERS = [("job.yaml", "Job"), ("jobset/jobset.yaml", "JobSet")]


@pytest.mark.parametrize(("path", "kind"), TRAINERS)
def test_trainer_pods_run_elastic_run_against_the_etcd_service(path: str, kind: str) -> None:
    (doc,) = [d for d in _docs(K8S / path) if d["kind"] == kind]
    (job,) = _jobs_in(doc)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secrets = {d["metadata"]["name"]: d for p in MANIFESTS for d in _docs(p) if d["kind"] == "Secret"}
    env = _container_env(container, secrets)
    assert "command" not in container, "the image's ENTRYPOINT (elastic-run) must stay the command"
    argv = [_expand(a, env) for a in container["args"]]
    assert not [a for a in argv if "$(" in a], f"unexpanded variables in {argv}"

    args = build_parser().parse_args(argv)  # elastic-run's own parser: every flag must exist
    config = _config()
    assert args.nnodes == config["NNODES"] == "2:4"
    min_nodes, max_nodes = (int(n) for n in args.nnodes.split(":"))
    assert args.rdzv_backend == "etcd-v3"

    # The endpoint is the etcd client Service, on its port.
    client = _find("Service", "etcd-client")
    assert args.rdzv_endpoint == f"{client['metadata']['name']}:{client['spec']['ports'][0]['port']}"

    # Run id from the Job (plus its uid: a closed run cannot be reused); node id from the pod name.
    assert args.rdzv_id.startswith("elastic-train-") and "uid" in args.rdzv_id
    assert args.node_id == FAKE_FIELDS["metadata.name"]
    assert args.local_addr == FAKE_FIELDS["status.podIP"]
    assert "node_id" not in args.rdzv_conf
    assert args.max_restarts > 0

    # One worker per GPU, and GPUs requested (extended resources need requests == limits).
    res = container["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == int(res["requests"]["nvidia.com/gpu"]) >= 1
    assert args.nproc_per_node in ("gpu", str(res["limits"]["nvidia.com/gpu"]))

    # The script ships in the image's working dir (the repository, see the Dockerfile).
    assert container["workingDir"] == "/workspace/elastic-train"
    assert (REPO / args.training_script).is_file()
    script_args = dict(a.split("=", 1) for a in args.training_script_args)

    # Tier 1 on the node-local volume; tier 2 under the shared URL, per run.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    tier1 = volumes[mounts[script_args["--ckpt-dir"]]]
    assert "emptyDir" in tier1 or "hostPath" in tier1
    assert script_args["--shared-url"] == f"{config['SHARED_URL']}/elastic-train"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env.keys()
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"

    # Elastic semantics of the Job: node loss by drain is not a failure; no two pods per node.
    assert pod["restartPolicy"] == "Never"
    assert pod["enableServiceLinks"] is False
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    if kind == "Job":
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["parallelism"] == job["spec"]["completions"] == max_nodes
        assert job["spec"]["successPolicy"]["rules"] == [{"succeededCount": 1}]
    else:
        assert doc["spec"]["replicatedJobs"][0]["replicas"] == max_nodes

    # Drains may not push the run below MIN.
    pdb = [d for d in _docs(K8S / path) if d["kind"] == "PodDisruptionBudget"][0]
    assert pdb["spec"]["minAvailable"] == min_nodes
    assert pdb["spec"]["selector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()

    # Liveness only; nothing routes to trainers, so no readiness.
    assert "exec" in container["livenessProbe"] and "readinessProbe" not in container


def _liveness_command() -> list[str]:
    job = _find("Job", "elastic-train")
    return list(job["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"])


def test_liveness_probe_passes_for_a_waiting_agent_and_fails_for_a_frozen_one() -> None:
    """Run the probe's real command against a real process standing in for PID 1: sleeping (as an
    agent blocked in a rendezvous is) passes, SIGSTOPped fails, resumed passes again."""
    command = _liveness_command()
    assert command[-1] == "/proc/1/status"
    proc = subprocess.Popen(["sleep", "60"])
    try:
        probe = [*command[:-1], f"/proc/{proc.pid}/status"]
        deadline = time.monotonic() + 5
        while "S (sleeping)" not in Path(f"/proc/{proc.pid}/status").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subprocess.run(probe, timeout=5).returncode == 0
        proc.send_signal(signal.SIGSTOP)
        while "T (stopped)" not in Path(f"/proc/{proc.pid}/status").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subprocess.run(probe, timeout=5).returncode != 0
        proc.send_signal(signal.SIGCONT)
        while "T (stopped)" in Path(f"/proc/{proc.pid}/status").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subprocess.run(probe, timeout=5).returncode == 0
    finally:
        proc.kill()
        proc.wait(timeout=5)


@pytest.mark.parametrize(
    ("state", "alive"),
    [("R (running)", True), ("D (disk sleep)", True), ("Z (zombie)", False), ("t (tracing stop)", False)],
)
def test_liveness_probe_states(tmp_path: Path, state: str, alive: bool) -> None:
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nUmask:\t0022\nState:\t{state}\nTgid:\t1\n")
    rc = subprocess.run([*_liveness_command()[:-1], str(status)], timeout=5).returncode
    assert (rc == 0) is alive
