"""Static checks of the deployment artefacts: Kubernetes, compose, Dockerfile.

They hold the properties a zero-loss redeploy depends on: the orchestrator
sends SIGTERM and waits long enough for the drain (grace >= preStop +
OUTBOXKIT_SHUTDOWN_TIMEOUT + 10 s), probes use the right endpoints
(readiness drops on SIGTERM, liveness stays up while draining), and secrets
never appear inline.

Each check is a function returning a list of problems, so the same function
is also run against a deliberately broken copy to prove it can fail.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
COMPOSE_DIR = REPO_ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"

DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # the library default
# Library defaults of the settings whose start-up rules the checks repeat.
DEFAULT_WORKER_DRAIN = 30.0
DEFAULT_CLOSE = 10.0
DEFAULT_LEASE_TTL = 60.0
DEFAULT_FLUSH = 10.0
DEFAULT_BATCH_DEADLINE = 32.0  # message.timeout.ms (30 s) + 2 s
DEFAULT_K8S_GRACE = 30.0  # Kubernetes' default terminationGracePeriodSeconds
DEFAULT_COMPOSE_GRACE = 10.0  # Docker's default stop timeout
MARGIN = 10.0
# Each process's default health port (outboxkit/runtime/settings.py): they differ
# so a relay and a consumer run side by side on one machine or in one pod.
HEALTH_PORT = {"relay": 8080, "consume": 8081}
# In a container the health server must listen beyond loopback for probes.
ALL_INTERFACES = "0.0.0.0"  # noqa: S104
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}

Doc = dict[str, Any]

# --- secrets -----------------------------------------------------------------

DSN_WITH_PASSWORD = re.compile(r"://[^/\s:@]+:[^/\s@]+@")
SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|PRIVATE_KEY|API_KEY", re.I)
SECRET_IN_VALUE = re.compile(r"(sasl\.password|ssl\.key\.password|password)\s*=", re.I)
# Settings that carry secrets and therefore must never be literal values.
SECRET_SETTINGS = {"OUTBOXKIT_DB_URL", "OUTBOXKIT_KAFKA_CONFIG"}


def secret_problems(where: str, key: str, value: Any) -> list[str]:
    """A literal (inline) setting that looks like a secret."""
    if value is None:
        return []
    text = str(value)
    problems = []
    if DSN_WITH_PASSWORD.search(text):
        problems.append(f"{where}: {key} holds a URL with a password inline")
    if SECRET_IN_VALUE.search(text):
        problems.append(f"{where}: {key} holds a password inline")
    if SECRET_KEY.search(key) and text:
        problems.append(f"{where}: {key} looks like a secret and has a literal value")
    if key in SECRET_SETTINGS:
        problems.append(f"{where}: {key} must come from a Secret, not a literal value")
    return problems


# --- loading -----------------------------------------------------------------


def k8s_yaml_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.rglob("*") if p.suffix in {".yaml", ".yml"})


@pytest.fixture(scope="module")
def k8s_docs(yaml_module: ModuleType) -> list[Doc]:
    docs: list[Doc] = []
    for path in k8s_yaml_files():
        for doc in yaml_module.safe_load_all(path.read_text()):
            if doc:
                doc.setdefault("metadata", {})["__file__"] = str(path.relative_to(REPO_ROOT))
                docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def compose(yaml_module: ModuleType) -> Doc:
    data: Doc = yaml_module.safe_load(COMPOSE_FILE.read_text())
    return data


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    return (d for d in docs if d.get("kind") in WORKLOAD_KINDS)


def name_of(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']} ({doc['metadata'].get('__file__')})"


def is_outboxkit_image(image: str) -> bool:
    repo = image.rsplit("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    return last.split(":", 1)[0] == "outboxkit"


def container_role(container: Doc) -> str:
    args = [*container.get("command", []), *container.get("args", [])]
    for role in ("relay", "consume", "schema", "admin"):
        if role in args:
            return role
    return "relay"  # the image's default CMD


def config_maps(docs: list[Doc]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}


def container_setting(
    container: Doc, setting: str, docs: list[Doc]
) -> tuple[str | None, Doc | None]:
    """(literal value, valueFrom) of a setting: env wins over envFrom ConfigMaps."""
    for entry in container.get("env", []):
        if entry["name"] == setting:
            return entry.get("value"), entry.get("valueFrom")
    maps = config_maps(docs)
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref and setting in maps.get(ref["name"], {}):
            return maps[ref["name"]][setting], None
    return None, None


def shutdown_timeout(container: Doc, docs: list[Doc]) -> float:
    value, _ = container_setting(container, "OUTBOXKIT_SHUTDOWN_TIMEOUT", docs)
    return float(value) if value is not None else DEFAULT_SHUTDOWN_TIMEOUT


def prestop_seconds(container: Doc) -> float | None:
    """Seconds the preStop hook waits, or None when there is none we understand."""
    hook = container.get("lifecycle", {}).get("preStop")
    if not hook:
        return None
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = " ".join(hook.get("exec", {}).get("command", []))
    match = re.search(r"sleep\(\s*(\d+(?:\.\d+)?)\s*\)", command) or re.fullmatch(
        r"(?:/bin/)?sleep (\d+(?:\.\d+)?)", command
    )
    return float(match.group(1)) if match else None


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


# --- Kubernetes checks -------------------------------------------------------


def check_k8s_workload(workload: Doc, docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    where = name_of(workload)
    spec = pod_spec(workload)
    template_meta = workload["spec"]["template"].get("metadata", {})
    containers: list[Doc] = spec.get("containers", [])
    init_containers: list[Doc] = spec.get("initContainers", [])
    grace = float(spec.get("terminationGracePeriodSeconds", DEFAULT_K8S_GRACE))
    replicas = int(workload["spec"].get("replicas", 1))

    if not spec.get("securityContext", {}).get("runAsNonRoot"):
        problems.append(f"{where}: pod securityContext.runAsNonRoot is not true")

    for container in init_containers + containers:
        cwhere = f"{where} container {container['name']}"
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                if resource not in resources.get(kind, {}):
                    problems.append(f"{cwhere}: resources.{kind}.{resource} not set")
        for entry in container.get("env", []):
            problems += secret_problems(cwhere, entry["name"], entry.get("value"))

    outboxkit = [c for c in containers if is_outboxkit_image(c.get("image", ""))]
    if not outboxkit:
        problems.append(f"{where}: no outboxkit container")

    for container in containers:
        cwhere = f"{where} container {container['name']}"
        prestop = prestop_seconds(container)
        if prestop is None:
            problems.append(f"{cwhere}: no preStop sleep (LB drain window)")
            prestop = 0.0
        if container in outboxkit:
            timeout = shutdown_timeout(container, docs)
            needed = prestop + timeout + MARGIN
            if grace < needed:
                problems.append(
                    f"{where}: terminationGracePeriodSeconds {grace:g} < preStop {prestop:g}"
                    f" + OUTBOXKIT_SHUTDOWN_TIMEOUT {timeout:g} + {MARGIN:g}"
                )

    for container in init_containers + outboxkit:
        if not is_outboxkit_image(container.get("image", "")):
            continue
        cwhere = f"{where} container {container['name']}"
        literal, value_from = container_setting(container, "OUTBOXKIT_DB_URL", docs)
        if literal is not None or not (value_from and "secretKeyRef" in value_from):
            problems.append(f"{cwhere}: OUTBOXKIT_DB_URL must come from a secretKeyRef")
        literal, value_from = container_setting(container, "OUTBOXKIT_KAFKA_CONFIG", docs)
        if literal is not None or (value_from and "secretKeyRef" not in value_from):
            problems.append(f"{cwhere}: OUTBOXKIT_KAFKA_CONFIG must come from a secretKeyRef")

    for container in outboxkit:
        cwhere = f"{where} container {container['name']}"
        role = container_role(container)
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        health_port, _ = container_setting(container, "OUTBOXKIT_HEALTH_PORT", docs)
        host, _ = container_setting(container, "OUTBOXKIT_HEALTH_HOST", docs)
        if host not in (None, ALL_INTERFACES):  # None: the image sets it
            problems.append(f"{cwhere}: OUTBOXKIT_HEALTH_HOST {host} is unreachable by probes")
        expected_port = int(health_port or HEALTH_PORT.get(role, HEALTH_PORT["relay"]))
        probes = (("readinessProbe", "/healthz/ready"), ("livenessProbe", "/healthz/live"))
        for probe_name, path in probes:
            probe = container.get(probe_name, {}).get("httpGet")
            if not probe:
                problems.append(f"{cwhere}: no HTTP {probe_name}")
                continue
            if probe.get("path") != path:
                problems.append(f"{cwhere}: {probe_name} path {probe.get('path')} != {path}")
            port = probe.get("port")
            if ports.get(port, port) != expected_port:
                problems.append(f"{cwhere}: {probe_name} port {port} is not the health port")
        _, node_id = container_setting(container, "OUTBOXKIT_NODE_ID", docs)
        if (node_id or {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
            problems.append(f"{cwhere}: OUTBOXKIT_NODE_ID must be the pod name (downward API)")
        if role == "relay" and replicas >= 2:
            literal, value_from = container_setting(container, "OUTBOXKIT_REDIS_URL", docs)
            if literal is None and value_from is None:
                problems.append(
                    f"{cwhere}: {replicas} relay replicas without OUTBOXKIT_REDIS_URL"
                    " lose per-key order"
                )
        if role == "consume":
            # The consumer's own start-up rule (docs/operations.md#timing-rules).
            drain, _ = container_setting(container, "OUTBOXKIT_WORKER_DRAIN_TIMEOUT", docs)
            close, _ = container_setting(container, "OUTBOXKIT_CLOSE_TIMEOUT", docs)
            budget = float(drain or DEFAULT_WORKER_DRAIN) + float(close or DEFAULT_CLOSE)
            if budget >= shutdown_timeout(container, docs):
                problems.append(
                    f"{cwhere}: worker drain timeout + close timeout must be below shutdown timeout"
                )
        if role == "relay":
            # The relay's own start-up rule with the default message.timeout.ms.
            ttl, _ = container_setting(container, "OUTBOXKIT_LEASE_TTL", docs)
            flush, _ = container_setting(container, "OUTBOXKIT_FLUSH_TIMEOUT", docs)
            deadline, _ = container_setting(container, "OUTBOXKIT_BATCH_DEADLINE", docs)
            needed = float(deadline or DEFAULT_BATCH_DEADLINE) + float(flush or DEFAULT_FLUSH)
            if float(ttl or DEFAULT_LEASE_TTL) <= needed:
                problems.append(
                    f"{cwhere}: lease TTL must exceed the batch deadline + flush timeout"
                )
        job = {"relay": "outboxkit-relay", "consume": "outboxkit-consumer"}.get(role)
        if job:
            if template_meta.get("labels", {}).get("outboxkit.io/scrape-job") != job:
                problems.append(f"{where}: pod label outboxkit.io/scrape-job must be {job}")
            annotations = template_meta.get("annotations", {})
            if (
                annotations.get("prometheus.io/scrape") != "true"
                or int(annotations.get("prometheus.io/port", 0)) != expected_port
            ):
                problems.append(f"{where}: prometheus.io scrape annotations missing or wrong port")
    return problems


def check_pdbs(docs: list[Doc]) -> list[str]:
    pdbs = [d for d in docs if d.get("kind") == "PodDisruptionBudget"]
    problems = []
    for workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        covered = any(
            p["spec"]["selector"].get("matchLabels", {}).items() <= labels.items() for p in pdbs
        )
        if not covered:
            problems.append(f"{name_of(workload)}: no PodDisruptionBudget selects its pods")
    return problems


def check_config_maps(docs: list[Doc]) -> list[str]:
    problems = []
    for doc in docs:
        if doc.get("kind") == "Secret":
            problems.append(f"{name_of(doc)}: do not commit Secrets; create them in the cluster")
        if doc.get("kind") == "ConfigMap":
            for key, value in doc.get("data", {}).items():
                problems += secret_problems(name_of(doc), key, value)
    return problems


def test_k8s_yaml_parses_and_has_the_three_patterns(k8s_docs: list[Doc]) -> None:
    names = {d["metadata"]["name"] for d in workloads(k8s_docs)}
    assert k8s_yaml_files()
    # (a) relay as sidecar of "orders", (b) relay Deployment, (c) consumer.
    assert {"orders", "outboxkit-relay", "order-consumer"} <= names
    sidecar = next(d for d in workloads(k8s_docs) if d["metadata"]["name"] == "orders")
    images = [c["image"] for c in pod_spec(sidecar)["containers"]]
    assert len(images) == 2 and sum(map(is_outboxkit_image, images)) == 1
    relay = next(d for d in workloads(k8s_docs) if d["metadata"]["name"] == "outboxkit-relay")
    assert relay["spec"]["replicas"] == 2


def test_k8s_workloads(k8s_docs: list[Doc]) -> None:
    problems = [p for w in workloads(k8s_docs) for p in check_k8s_workload(w, k8s_docs)]
    assert problems == []


def test_k8s_pdbs(k8s_docs: list[Doc]) -> None:
    assert check_pdbs(k8s_docs) == []


def test_k8s_config_maps_hold_no_secrets(k8s_docs: list[Doc]) -> None:
    assert check_config_maps(k8s_docs) == []


#: A relay's peak resident set, measured (tests/relay/test_claim_bytes.py,
#: test_the_largest_rows_of_the_shipped_settings_fit_the_manifests_memory_limit;
#: docs/operations.md, "Memory") with the settings the manifests ship: 64 rows
#: of the largest payload enqueue accepts for the producer's default
#: message.max.bytes (999,912 bytes, in the payload table), four times the
#: default claim budget (--batch-max-bytes, 16 MiB), pipelined on PostgreSQL:
#: 137 MiB (117 MiB on MariaDB), of which about 85 MiB before any row. Rows over
#: message.max.bytes are never loaded, so no row raises it.
RELAY_PEAK_MIB = 137
#: Room above the measured peak for what one run does not show (a heap
#: fragmented over weeks, a trace exporter's buffers).
RELAY_HEADROOM = 1.5
#: Settings the measured peak depends on: a manifest that sets them needs a
#: new measurement, not this figure.
RELAY_MEMORY_SETTINGS = ("OUTBOXKIT_BATCH_MAX_BYTES",)


def mebibytes(quantity: str) -> float:
    """A Kubernetes memory quantity (``256Mi``, ``1Gi``, ``300M``, bytes) in MiB."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"([0-9.]+)([KMG]i?)?", str(quantity))
    assert match, quantity
    return float(match.group(1)) * units.get(match.group(2) or "", 1) / 2**20


def test_k8s_relay_memory_limits_hold_the_measured_worst_case(k8s_docs: list[Doc]) -> None:
    """Every relay container's memory limit holds its measured peak with headroom:
    a limit below it is a pod killed at each claim of big rows, forever."""
    relays = [
        (name_of(w), c)
        for w in workloads(k8s_docs)
        for c in pod_spec(w)["containers"]
        if is_outboxkit_image(c.get("image", "")) and container_role(c) == "relay"
    ]
    assert len(relays) >= 2, "the sidecar and the Deployment"
    for where, container in relays:
        limit = mebibytes(container["resources"]["limits"]["memory"])
        assert limit >= RELAY_PEAK_MIB * RELAY_HEADROOM, (where, limit)
        for setting in RELAY_MEMORY_SETTINGS:
            value, _ = container_setting(container, setting, k8s_docs)
            assert value is None, f"{where}: {setting} set; measure the peak again"
        value, _ = container_setting(container, "OUTBOXKIT_KAFKA_CONFIG", k8s_docs)
        assert "message.max.bytes" not in (value or ""), where


def test_k8s_kustomizations_list_existing_files(yaml_module: ModuleType) -> None:
    for path in K8S_DIR.rglob("kustomization.yaml"):
        for resource in yaml_module.safe_load(path.read_text()).get("resources", []):
            assert (path.parent / resource).exists(), f"{path}: {resource} does not exist"


def relay_workload(docs: list[Doc]) -> Doc:
    return next(d for d in workloads(docs) if d["metadata"]["name"] == "outboxkit-relay")


def relay_container(workload: Doc) -> Doc:
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == "relay")


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("short-grace", "terminationGracePeriodSeconds 40 < preStop 5"),
        ("no-prestop", "no preStop"),
        ("ready-on-live", "readinessProbe path /healthz/live"),
        ("inline-dsn", "URL with a password inline"),
        ("inline-sasl", "holds a password inline"),
        ("no-redis", "without OUTBOXKIT_REDIS_URL"),
        ("no-limits", "resources.limits.memory not set"),
        ("long-timeout", "OUTBOXKIT_SHUTDOWN_TIMEOUT 60"),
        ("short-lease", "lease TTL must exceed"),
    ],
)
def test_k8s_checks_catch_a_broken_relay(k8s_docs: list[Doc], breakage: str, expected: str) -> None:
    docs = copy.deepcopy(k8s_docs)
    workload = relay_workload(docs)
    relay = relay_container(workload)
    env = relay["env"]
    if breakage == "short-grace":
        pod_spec(workload)["terminationGracePeriodSeconds"] = 40
    elif breakage == "no-prestop":
        del relay["lifecycle"]
    elif breakage == "ready-on-live":
        relay["readinessProbe"]["httpGet"]["path"] = "/healthz/live"
    elif breakage == "inline-dsn":
        entry = next(e for e in env if e["name"] == "OUTBOXKIT_DB_URL")
        entry.pop("valueFrom")
        entry["value"] = "mysql+pymysql://outbox:hunter2@mysql:3306/outbox"
    elif breakage == "inline-sasl":
        env.append({"name": "OUTBOXKIT_KAFKA_CONFIG", "value": "sasl.password=hunter2"})
    elif breakage == "no-redis":
        relay["env"] = [e for e in env if e["name"] != "OUTBOXKIT_REDIS_URL"]
    elif breakage == "no-limits":
        del relay["resources"]["limits"]
    elif breakage == "long-timeout":
        env.append({"name": "OUTBOXKIT_SHUTDOWN_TIMEOUT", "value": "60"})
    elif breakage == "short-lease":
        env.append({"name": "OUTBOXKIT_LEASE_TTL", "value": "30"})
    problems = check_k8s_workload(workload, docs)
    assert any(expected in p for p in problems), problems


# --- compose -----------------------------------------------------------------


def parse_duration(text: str | int | float) -> float:
    """Compose durations: '45s', '1m30s', '1h', or a plain number of seconds."""
    if isinstance(text, int | float):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 0.000001}
    return sum(float(n) * scale[u] for n, u in parts)


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def env_files(service: Doc) -> list[str]:
    files = service.get("env_file", [])
    files = [files] if isinstance(files, str | dict) else files
    return [f["path"] if isinstance(f, dict) else f for f in files]


def service_env(service: Doc, base: Path) -> dict[str, str]:
    """Settings from committed env files, then `environment:` (which wins)."""
    values: dict[str, str] = {}
    for name in env_files(service):
        path = base / name
        if path.exists():
            values.update(read_env_file(path))
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    values.update({k: str(v) for k, v in environment.items() if v is not None})
    return values


def is_outboxkit_service(service: Doc) -> bool:
    build = service.get("build", {})
    dockerfile = build.get("dockerfile", "") if isinstance(build, dict) else ""
    return is_outboxkit_image(service.get("image", "")) or dockerfile.endswith(
        "deploy/docker/Dockerfile"
    )


def is_one_shot(service: Doc) -> bool:
    """A job that runs to completion (restart explicitly "no"); it needs no healthcheck."""
    return service.get("restart") in {"no", False}


def check_compose(compose: Doc, base: Path) -> list[str]:
    problems: list[str] = []
    services: dict[str, Doc] = compose["services"]
    for name, service in services.items():
        where = f"compose service {name}"
        for key, value in (service.get("environment") or {}).items():
            problems += secret_problems(where, key, value)
        healthcheck = service.get("healthcheck") or {}
        if not is_one_shot(service) and (not healthcheck or healthcheck.get("disable")):
            problems.append(f"{where}: no healthcheck")
        if not is_outboxkit_service(service):
            continue
        if service.get("stop_signal") != "SIGTERM":
            problems.append(f"{where}: stop_signal must be SIGTERM")
        env = service_env(service, base)
        timeout = float(env.get("OUTBOXKIT_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT))
        grace = parse_duration(service.get("stop_grace_period", DEFAULT_COMPOSE_GRACE))
        if grace < timeout + MARGIN:
            problems.append(
                f"{where}: stop_grace_period {grace:g}s < OUTBOXKIT_SHUTDOWN_TIMEOUT"
                f" {timeout:g} + {MARGIN:g}"
            )
        if env.get("OUTBOXKIT_HEALTH_HOST", ALL_INTERFACES) != ALL_INTERFACES:
            problems.append(f"{where}: health server must listen on 0.0.0.0")
        command = service.get("command", [])
        if "relay" in command:
            depends = service.get("depends_on", {})
            if depends.get("schema-apply", {}).get("condition") != "service_completed_successfully":
                problems.append(f"{where}: must wait for schema-apply to complete")
            if "OUTBOXKIT_NODE_ID" not in env:
                problems.append(f"{where}: no OUTBOXKIT_NODE_ID")
    relays = [s for s in services.values() if "relay" in s.get("command", [])]
    if len(relays) >= 2:
        node_ids = [service_env(s, base).get("OUTBOXKIT_NODE_ID") for s in relays]
        if len(set(node_ids)) != len(node_ids):
            problems.append("compose relays share an OUTBOXKIT_NODE_ID")
        if any("OUTBOXKIT_REDIS_URL" not in service_env(s, base) for s in relays):
            problems.append("compose runs several relays without OUTBOXKIT_REDIS_URL")
    return problems


def test_compose_services(compose: Doc) -> None:
    expected = {
        "mysql", "kafka", "kafka-init", "redis", "schema-apply",
        "relay-1", "relay-2", "consumer", "prometheus", "pushgateway",
    }  # fmt: skip
    assert expected <= set(compose["services"])
    assert compose["services"]["mysql"]["image"].startswith("mysql:8.4")
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:")
    kafka_env = compose["services"]["kafka"]["environment"]
    assert kafka_env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    assert kafka_env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert check_compose(compose, COMPOSE_DIR) == []


def test_compose_loads_prometheus_rules(compose: Doc) -> None:
    volumes = compose["services"]["prometheus"]["volumes"]
    assert any(v.startswith("../prometheus/rules:") for v in volumes)
    assert any(v.startswith("../prometheus/prometheus.yml:") for v in volumes)


def test_compose_secrets_live_in_ignored_env_files(compose: Doc) -> None:
    ignored = (COMPOSE_DIR / ".gitignore").read_text().split()
    committed = {p.name for p in COMPOSE_DIR.iterdir()}
    for service in compose["services"].values():
        for name in env_files(service):
            path = COMPOSE_DIR / name
            if "secret" in name:
                assert any(fnmatch.fnmatch(name, pattern) for pattern in ignored), name
                assert f"{name}.example" in committed, f"{name}.example missing"
            else:
                assert name in committed, f"{name} missing"
                for key, value in read_env_file(path).items():
                    assert secret_problems(name, key, value) == []


@pytest.mark.parametrize(
    ("service", "field", "value", "expected"),
    [
        ("relay-1", "stop_grace_period", "30s", "stop_grace_period 30s"),
        ("relay-2", "stop_signal", "SIGKILL", "stop_signal must be SIGTERM"),
        ("consumer", "environment", {"OUTBOXKIT_DB_URL": "mysql://u:p@h/db"}, "inline"),
        ("consumer", "environment", {"OUTBOXKIT_SHUTDOWN_TIMEOUT": "60"}, "45s < OUTBOX"),
        ("redis", "healthcheck", None, "no healthcheck"),
    ],
)
def test_compose_checks_catch_a_broken_service(
    compose: Doc, service: str, field: str, value: Any, expected: str
) -> None:
    broken = copy.deepcopy(compose)
    if value is None:
        del broken["services"][service][field]
    else:
        broken["services"][service][field] = value
    problems = check_compose(broken, COMPOSE_DIR)
    assert any(expected in p for p in problems), problems


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    """`docker compose config` needs no engine, only the compose plugin."""
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False, timeout=30
        ).returncode
        != 0
    ):
        pytest.skip("docker compose plugin not installed; the parsing tests above still ran")
    # A copy, so the git-ignored secret env files can be made from the examples.
    workdir = tmp_path / "deploy" / "compose"
    shutil.copytree(COMPOSE_DIR, workdir)
    for example in workdir.glob("*.example"):
        shutil.copy(example, example.with_suffix(""))
    result = subprocess.run(
        [docker, "compose", "-f", str(workdir / "compose.yaml"), "config", "--format", "json"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["relay-1"]["stop_grace_period"] == "45s"
    assert services["relay-1"]["environment"]["OUTBOXKIT_SHUTDOWN_TIMEOUT"] == "30"


# --- Dockerfile --------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    instructions = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def check_dockerfile(text: str) -> list[str]:
    instructions = dockerfile_instructions(text)
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    final = instructions[last_from:]
    found: dict[str, str] = {}
    for word, rest in final:
        found[word] = rest  # the last one of each kind wins, as in Docker
    problems = []
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), final[0][1]).split()[0]
    if not re.fullmatch(r"(docker\.io/(library/)?)?python:3\.11[\w.-]*-slim[\w.-]*", base):
        problems.append(f"final stage base {base} is not a slim Python 3.11 image")
    try:
        entrypoint = json.loads(found.get("ENTRYPOINT", ""))
    except json.JSONDecodeError:
        entrypoint = None
    if not (isinstance(entrypoint, list) and entrypoint[:1] == ["outboxkit"]):
        problems.append('ENTRYPOINT must be exec form ["outboxkit", ...] so SIGTERM reaches it')
    if found.get("STOPSIGNAL") != "SIGTERM":
        problems.append("STOPSIGNAL must be SIGTERM")
    user = found.get("USER", "root").split(":")[0]
    if user in {"root", "0", ""}:
        problems.append("final stage must run as a non-root USER")
    healthcheck = found.get("HEALTHCHECK", "")
    if "/healthz/live" not in healthcheck or "CMD" not in healthcheck:
        problems.append("HEALTHCHECK must probe /healthz/live")
    if "curl" in healthcheck or "wget" in healthcheck:
        problems.append("HEALTHCHECK must not need curl/wget (not in slim)")
    for port in sorted(set(HEALTH_PORT.values())):
        if str(port) not in found.get("EXPOSE", "").split():
            problems.append(f"EXPOSE {port} missing")
    env_lines = " ".join(rest for word, rest in final if word == "ENV")
    if "OUTBOXKIT_HEALTH_HOST=0.0.0.0" not in env_lines:
        problems.append("ENV OUTBOXKIT_HEALTH_HOST=0.0.0.0 missing")
    return problems


def test_dockerfile() -> None:
    assert check_dockerfile(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('ENTRYPOINT ["outboxkit"]', "ENTRYPOINT outboxkit", "exec form"),
        ("STOPSIGNAL SIGTERM", "STOPSIGNAL SIGINT", "STOPSIGNAL"),
        ("USER 10001:10001", "USER root", "non-root"),
        ("HEALTHCHECK", "# HEALTHCHECK", "HEALTHCHECK"),
    ],
)
def test_dockerfile_check_catches_a_broken_file(old: str, new: str, expected: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    problems = check_dockerfile(text.replace(old, new))
    assert any(expected in p for p in problems), problems


def test_dockerignore_keeps_secrets_and_vcs_out() -> None:
    patterns = (REPO_ROOT / ".dockerignore").read_text().split()
    for required in (".git", "**/*secrets.env"):
        assert required in patterns
