"""Every Kubernetes folder the docs tell users to apply renders a complete set.

docs/operations.md offers ``kubectl apply -k deploy/k8s`` and, as alternatives,
``deploy/k8s/relay-sidecar``, ``relay-deployment`` and ``consumer``. Each is
rendered here by the real kustomize (``deploy/local/kustomize.sh`` installs it,
as ``deploy/local/up.sh`` does) and the result is checked as an API server and
a kubelet would see it:

* every namespaced object lands in the namespace the docs create the Secrets in
  (a folder without ``namespace:`` renders into whatever the kubectl context
  has, away from its Secret: the pods then fail with CreateContainerConfigError);
* every ConfigMap and ServiceAccount a pod refers to is in the set, every Secret
  it refers to is one the docs tell users to create;
* probes name a container port, and the scrape annotation names the port the
  process listens on.

The Prometheus Operator's PodMonitor (``deploy/k8s/monitoring``, applied on its
own as docs/operations.md says) lives in that namespace too: without a
``namespaceSelector`` the operator selects pods of the PodMonitor's own
namespace only, so one created in the kubectl context's namespace scraped nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OPERATIONS = REPO / "docs" / "operations.md"
LOCAL_BIN = REPO / "deploy" / "local" / ".state" / "bin"
#: The health port each process listens on by default (the ConfigMap sets none).
DEFAULT_PORT = {"relay": 8080, "consume": 8081}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}

Doc = dict[str, Any]


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def kustomize() -> str:
    path = shutil.which("kustomize") or shutil.which("kustomize", path=str(LOCAL_BIN))
    if path is None:
        _missing("kustomize not found; run deploy/local/kustomize.sh (or deploy/local/up.sh)")
        raise AssertionError("unreachable")
    return path


def documented_folders() -> list[str]:
    """The folders docs/operations.md tells users to apply, relative to the repo."""
    text = OPERATIONS.read_text()
    start = text.index("Apply with kustomize")
    paragraph = text[start : text.index("\n\n", start)]
    folders = sorted(set(re.findall(r"`(?:kubectl apply -k )?(deploy/k8s[\w/-]*)`", paragraph)))
    return [f.rstrip("/") for f in folders]


def documented_secrets() -> tuple[str, set[str]]:
    """The namespace and names of the Secrets docs/operations.md has users create."""
    found = re.findall(r"kubectl -n (\S+) create secret generic (\S+)", OPERATIONS.read_text())
    assert found, "docs/operations.md no longer shows how to create the Secrets"
    namespaces = {ns for ns, _ in found}
    assert len(namespaces) == 1, namespaces
    return namespaces.pop(), {name for _, name in found}


def render(kustomize: str, yaml: ModuleType, folder: str) -> list[Doc]:
    res = subprocess.run(
        [kustomize, "build", str(REPO / folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, f"kustomize build {folder}:\n{res.stderr}"
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def _role(container: Doc) -> str | None:
    args = [*container.get("command", []), *container.get("args", [])]
    return next((r for r in ("relay", "consume") if r in args), None)


def problems_of(docs: list[Doc], namespace: str, secrets: set[str]) -> list[str]:
    problems: list[str] = []
    present = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] not in CLUSTER_SCOPED and doc["metadata"].get("namespace") != namespace:
            problems.append(
                f"{where}: namespace {doc['metadata'].get('namespace')!r}, but the Secrets "
                f"live in {namespace!r}"
            )
        if doc["kind"] not in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            continue
        template = doc["spec"]["template"]
        spec = template["spec"]
        account = spec.get("serviceAccountName")
        if account and ("ServiceAccount", account) not in present:
            problems.append(f"{where}: ServiceAccount {account} is not in the set")
        for volume in spec.get("volumes", []):
            if "configMap" in volume and ("ConfigMap", volume["configMap"]["name"]) not in present:
                problems.append(f"{where}: volume ConfigMap {volume['configMap']['name']} missing")
            if "secret" in volume and volume["secret"]["secretName"] not in secrets:
                problems.append(f"{where}: volume Secret {volume['secret']['secretName']} unknown")
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        for c in containers:
            cwhere = f"{where} container {c['name']}"
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    name = source["configMapRef"]["name"]
                    if ("ConfigMap", name) not in present:
                        problems.append(f"{cwhere}: ConfigMap {name} is not in the set")
                if "secretRef" in source and source["secretRef"]["name"] not in secrets:
                    problems.append(f"{cwhere}: Secret {source['secretRef']['name']} unknown")
            for entry in c.get("env", []):
                ref = entry.get("valueFrom", {})
                keyed = ref.get("configMapKeyRef", {}).get("name")
                if keyed and ("ConfigMap", keyed) not in present:
                    problems.append(f"{cwhere}: ConfigMap {keyed} is not in the set")
                if "secretKeyRef" in ref and ref["secretKeyRef"]["name"] not in secrets:
                    problems.append(
                        f"{cwhere}: Secret {ref['secretKeyRef']['name']} is not one the docs create"
                    )
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = c.get(probe_name, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    problems.append(f"{cwhere}: {probe_name} names port {port}, not declared")
            role = _role(c)
            if role and c in spec["containers"]:
                if ports.get("health") != DEFAULT_PORT[role]:
                    problems.append(
                        f"{cwhere}: health port {ports.get('health')} is not the {role} "
                        f"default {DEFAULT_PORT[role]}"
                    )
                scrape = template["metadata"].get("annotations", {}).get("prometheus.io/port")
                if scrape is not None and int(scrape) not in ports.values():
                    problems.append(f"{cwhere}: prometheus.io/port {scrape} is no container port")
    return problems


def test_the_docs_name_the_folders_to_apply() -> None:
    assert documented_folders() == [
        "deploy/k8s",
        "deploy/k8s/consumer",
        "deploy/k8s/relay-deployment",
        "deploy/k8s/relay-sidecar",
    ]


@pytest.mark.parametrize("folder", documented_folders())
def test_a_documented_folder_renders_a_complete_set(
    kustomize: str, yaml_module: ModuleType, folder: str
) -> None:
    namespace, secrets = documented_secrets()
    docs = render(kustomize, yaml_module, folder)
    assert any(d["kind"] == "Deployment" for d in docs), folder
    assert problems_of(docs, namespace, secrets) == []


def test_the_check_catches_a_folder_without_namespace(
    kustomize: str, yaml_module: ModuleType
) -> None:
    namespace, secrets = documented_secrets()
    docs = render(kustomize, yaml_module, "deploy/k8s/consumer")
    for doc in docs:
        doc["metadata"].pop("namespace", None)
    assert any("namespace None" in p for p in problems_of(docs, namespace, secrets))


def documented_monitoring_files() -> list[str]:
    """The monitoring manifests docs/operations.md tells users to apply."""
    found = re.findall(r"`(deploy/k8s/monitoring/[\w.-]+\.ya?ml)`", OPERATIONS.read_text())
    return sorted(set(found))


def test_the_docs_name_every_monitoring_manifest() -> None:
    shipped = sorted(
        str(p.relative_to(REPO))
        for p in (K8S / "monitoring").iterdir()
        if p.suffix in (".yaml", ".yml")
    )
    assert shipped and documented_monitoring_files() == shipped


@pytest.mark.parametrize("path", documented_monitoring_files())
def test_a_pod_monitor_scrapes_the_pods_of_the_outboxkit_namespace(
    kustomize: str, yaml_module: ModuleType, path: str
) -> None:
    namespace, secrets = documented_secrets()
    monitors = [d for d in yaml_module.safe_load_all((REPO / path).read_text()) if d]
    assert problems_of(monitors, namespace, secrets) == []
    pods = [
        d["spec"]["template"]
        for d in render(kustomize, yaml_module, "deploy/k8s")
        if d["kind"] in ("Deployment", "StatefulSet")
    ]
    for monitor in (m for m in monitors if m["kind"] == "PodMonitor"):
        spec = monitor["spec"]
        selector = spec.get("namespaceSelector", {})
        assert selector.get("any") or selector.get("matchNames", [namespace]) == [namespace]
        scraped = [p for p in pods if _selects(spec["selector"], p["metadata"]["labels"])]
        jobs = {p["metadata"]["labels"][spec["jobLabel"]] for p in scraped}
        assert jobs == {"outboxkit-relay", "outboxkit-consumer"}, jobs
        for endpoint in spec["podMetricsEndpoints"]:
            for pod in scraped:
                names = {
                    port.get("name")
                    for c in pod["spec"]["containers"]
                    for port in c.get("ports", [])
                }
                assert endpoint["port"] in names, (endpoint, names)


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None:
            return False
        if op == "DoesNotExist" and value is not None:
            return False
    return True
