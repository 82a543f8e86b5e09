"""The shipped deployment settings start the relay and the consumer, and drain in time.

Each case takes the environment one shipped artefact gives a process, PARSED from
the file (deploy/compose/outboxkit.env + the service's ``environment:`` in
compose.yaml, or a Kubernetes container's ``envFrom`` ConfigMap + ``env``), never
copied into this test. Only the addresses are overridden so the processes reach the
local services instead of the cluster's, and only when the artefact sets them:

* ``OUTBOXKIT_DB_URL`` (a Secret / the git-ignored secrets file): a fresh test database;
* ``OUTBOXKIT_KAFKA_BOOTSTRAP``, ``OUTBOXKIT_REDIS_URL``, ``OUTBOXKIT_PUSHGATEWAY_URL``:
  the local Kafka, Redis and Pushgateway;
* ``OUTBOXKIT_HEALTH_PORT``: a free port, set whether or not the artefact sets it
  (the artefacts leave each process its default, 8080 or 8081, which other
  processes on a shared test machine may hold);
* ``OUTBOXKIT_KAFKA_CONFIG`` (an optional Secret with SASL properties): left unset;
* ``OUTBOXKIT_NODE_ID`` from the downward API (``metadata.name``): a pod-like name.

Then the schema one-shot of the same artefact runs, the process must reach
``/healthz/ready`` 200, and after SIGTERM it must exit 0 with a clean exit record
within the grace period the same artefact gives (compose ``stop_grace_period``;
Kubernetes ``terminationGracePeriodSeconds`` minus the preStop sleep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from support.prometheus import delete_pushed_groups
from support.services import free_port
from support.waiting import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"
K8S_DIR = REPO / "deploy" / "k8s"

#: The process-level result each exit record must carry after a clean drain.
CLEAN_RESULT = {"relay": ("relay-exit", "clean"), "consume": ("consumer-exit", "clean")}


@dataclass
class Shipped:
    """What one artefact gives one process: its environment, arguments and grace."""

    source: str
    role: str  # "relay" or "consume"
    args: list[str]
    env: dict[str, str]
    grace: float
    schema_args: list[str] | None  # the artefact's schema one-shot, if it has one


# --- parsing ------------------------------------------------------------------


def parse_env_file(path: Path) -> dict[str, str]:
    """A compose ``env_file``: KEY=VALUE lines, ``#`` comments, no quoting used."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {raw!r}"
        env[key.strip()] = value.strip()
    return env


def compose_duration(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text):
        total += float(number) * units[unit]
    return total


def compose_cases(yaml: ModuleType) -> list[Shipped]:
    compose = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    services: dict[str, Any] = compose["services"]
    cases = []
    schema = services["schema-apply"]["command"]
    for name, svc in services.items():
        command = svc.get("command") or []
        if not command or command[0] not in ("relay", "consume"):
            continue
        env: dict[str, str] = {}
        for env_file in svc["env_file"]:
            path = COMPOSE_DIR / env_file
            if not path.exists():  # the git-ignored secrets file: its committed example
                path = COMPOSE_DIR / f"{env_file.removesuffix('.env')}.env.example"
            env.update(parse_env_file(path))
        env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
        cases.append(
            Shipped(
                source=f"compose:{name}",
                role=command[0],
                args=list(command),
                env=env,
                grace=compose_duration(svc["stop_grace_period"]),
                schema_args=list(schema),
            )
        )
    return cases


def _prestop_seconds(container: dict[str, Any]) -> float:
    command = " ".join(
        container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    )
    match = re.search(r"sleep\(\s*(\d+(?:\.\d+)?)\s*\)", command)
    return float(match.group(1)) if match else 0.0


def _container_env(
    container: dict[str, Any], maps: dict[str, dict[str, str]], pod: str
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        value_from = entry["valueFrom"]
        if "fieldRef" in value_from:
            assert value_from["fieldRef"]["fieldPath"] == "metadata.name", entry
            env[entry["name"]] = pod
        elif "secretKeyRef" in value_from:
            # Secrets are addresses with credentials: the override fills them in.
            env[entry["name"]] = f"<secret:{value_from['secretKeyRef']['key']}>"
    return env


def k8s_cases(yaml: ModuleType) -> list[Shipped]:
    docs = [
        doc
        for path in sorted(K8S_DIR.rglob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}
    cases = []
    for doc in docs:
        if doc.get("kind") != "Deployment":
            continue
        spec = doc["spec"]["template"]["spec"]
        name = doc["metadata"]["name"]
        pod = f"{name}-{uuid.uuid4().hex[:5]}"
        schema = next(
            (c for c in spec.get("initContainers", []) if "schema" in c.get("args", [])), None
        )
        for container in spec["containers"]:
            args = container.get("args", [])
            if not args or args[0] not in ("relay", "consume"):
                continue
            cases.append(
                Shipped(
                    source=f"k8s:{name}/{container['name']}",
                    role=args[0],
                    args=list(args),
                    env=_container_env(container, maps, pod),
                    grace=float(spec["terminationGracePeriodSeconds"])
                    - _prestop_seconds(container),
                    schema_args=list(schema["args"]) if schema else None,
                )
            )
    return cases


# --- the local services ---------------------------------------------------------


def _service(var: str) -> str:
    value = os.environ.get(var)
    if not value:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{var} is not set (CI=true: a failure, not a skip)", pytrace=False)
        pytest.skip(f'{var} is not set (eval "$(deploy/local/up.sh)")')
    return value


def local_overrides(env: dict[str, str], db_url: str) -> dict[str, str]:
    """Point the artefact's addresses at the local services; nothing else changes."""
    out = dict(env)
    addresses = {
        "OUTBOXKIT_DB_URL": lambda: db_url,
        "OUTBOXKIT_KAFKA_BOOTSTRAP": lambda: _service("OUTBOXKIT_TEST_KAFKA_BOOTSTRAP"),
        "OUTBOXKIT_REDIS_URL": lambda: _service("OUTBOXKIT_TEST_REDIS_URL"),
        "OUTBOXKIT_PUSHGATEWAY_URL": lambda: _service("OUTBOXKIT_TEST_PUSHGATEWAY_URL"),
    }
    for key, value in addresses.items():
        if key in out:
            out[key] = value()
    out["OUTBOXKIT_HEALTH_PORT"] = str(free_port())
    # The optional Secret with SASL properties does not exist locally.
    if out.get("OUTBOXKIT_KAFKA_CONFIG", "").startswith("<secret:"):
        del out["OUTBOXKIT_KAFKA_CONFIG"]
    leftover = {k: v for k, v in out.items() if v.startswith("<secret:")}
    assert not leftover, f"a Secret this test does not know how to fill: {leftover}"
    return out


# --- running ------------------------------------------------------------------------


def _process_env(env: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return {**base, **env}


def _cli(args: list[str]) -> list[str]:
    # The image's ENTRYPOINT is the `outboxkit` console script.
    return [sys.executable, "-m", "outboxkit", *args]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _records(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


@pytest.fixture
def demo_topics() -> Iterator[None]:
    """The compose stack's kafka-init creates these (auto-create is off)."""
    admin = AdminClient({"bootstrap.servers": _service("OUTBOXKIT_TEST_KAFKA_BOOTSTRAP")})
    existing = admin.list_topics(timeout=10).topics
    wanted = [t for t in ("orders", "orders.dlq") if t not in existing]
    if wanted:
        for future in admin.create_topics([NewTopic(t, 3, 1) for t in wanted]).values():
            try:
                future.result(timeout=30)
            except Exception as exc:  # created meanwhile by someone else
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise
    yield


def _cases(yaml: ModuleType) -> list[Shipped]:
    return compose_cases(yaml) + k8s_cases(yaml)


def test_every_shipped_process_is_covered(yaml_module: ModuleType) -> None:
    sources = {case.source for case in _cases(yaml_module)}
    assert {
        "compose:relay-1",
        "compose:relay-2",
        "compose:consumer",
        "k8s:orders/outbox-relay",
        "k8s:outboxkit-relay/relay",
        "k8s:order-consumer/consumer",
    } <= sources, sources


#: docs/consumer.md (*Async handlers*): an async consumer's exit can take up to this
#: much more than ``worker_drain_timeout + close_timeout`` (cancelled coroutines' cleanup,
#: the inbox's connections closed on the loop, the loop stopped), and asks for that much
#: room below ``shutdown_timeout``.
ASYNC_EXIT_EXTRA_S = 5.0


def _consumer_budget(case: Shipped) -> tuple[float, float, float]:
    from outboxkit.consumer.settings import ConsumerSettings

    defaults = {f.name: f.default for f in dataclasses.fields(ConsumerSettings)}

    def value(name: str) -> float:
        raw = case.env.get(f"OUTBOXKIT_{name.upper()}")
        return float(raw) if raw is not None else float(defaults[name])

    return value("worker_drain_timeout"), value("close_timeout"), value("shutdown_timeout")


def test_shipped_consumer_budgets_leave_the_async_margin(yaml_module: ModuleType) -> None:
    """Sync and async consumers share the artefact's settings, so they must fit the
    async one: drain + close + the async teardown strictly below the forced exit."""
    consumers = [c for c in _cases(yaml_module) if c.role == "consume"]
    assert consumers
    for case in consumers:
        drain, close, shutdown = _consumer_budget(case)
        assert drain + close + ASYNC_EXIT_EXTRA_S < shutdown, (
            f"{case.source}: worker_drain_timeout {drain:g} + close_timeout {close:g} "
            f"+ {ASYNC_EXIT_EXTRA_S:g} s of async teardown must be < shutdown_timeout "
            f"{shutdown:g} (docs/consumer.md, Async handlers)"
        )


#: The shipped consumers again, with the example class swapped for an ``async def
#: handle`` one under the same settings (the async path: event loop thread, cancellation).
ASYNC_APP = "push_apps:IdleAsync"


@pytest.mark.parametrize(
    "source",
    [
        "compose:relay-1",
        "compose:consumer",
        "k8s:orders/outbox-relay",
        "k8s:outboxkit-relay/relay",
        "k8s:order-consumer/consumer",
        "compose:consumer async",
        "k8s:order-consumer/consumer async",
    ],
)
def test_shipped_settings_start_and_drain_within_the_grace_period(
    yaml_module: ModuleType, db_url: str, demo_topics: None, source: str
) -> None:
    base, _, variant = source.partition(" ")
    case = next(c for c in _cases(yaml_module) if c.source == base)
    args = list(case.args)
    env = local_overrides(case.env, db_url)
    if variant == "async":
        args[1] = ASYNC_APP
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent)
    port = int(env.get("OUTBOXKIT_HEALTH_PORT", "0"))
    assert port, f"{source}: no OUTBOXKIT_HEALTH_PORT, the test cannot probe readiness"

    if case.schema_args is not None:
        schema = subprocess.run(
            _cli(case.schema_args),
            env=_process_env(env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert schema.returncode == 0, schema.stderr[-3000:]

    proc = subprocess.Popen(
        _cli(args),
        env=_process_env(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    node_id = env.get("OUTBOXKIT_NODE_ID")
    try:
        try:
            wait_for(
                lambda: proc.poll() is not None or _ready(port),
                timeout=60,
                interval=0.25,
                what=f"{source} ready",
            )
        except AssertionError:
            proc.kill()
            raise
        if proc.poll() is not None:
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"{source} exited {proc.returncode} at start:\n{err[-3000:]}")

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=case.grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"{source} still running {case.grace:g} s after SIGTERM:\n{err[-3000:]}")
        took = time.monotonic() - signalled
        assert proc.returncode == 0, f"{source} exited {proc.returncode}:\n{err[-3000:]}"
        event, result = CLEAN_RESULT[case.role]
        exits = [r for r in _records(err) if r.get("event") == event]
        assert len(exits) == 1, err[-3000:]
        assert exits[0]["result"] == result, exits[0]
        assert exits[0]["exit_code"] == 0, exits[0]
        assert took < case.grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _delete_pushed_groups(env, node_id)


def _delete_pushed_groups(env: dict[str, str], node_id: str | None) -> None:
    url = env.get("OUTBOXKIT_PUSHGATEWAY_URL")
    if not url or not node_id:
        return
    for job in ("outboxkit_relay", "outboxkit_consumer"):
        with contextlib.suppress(OSError):  # every group of the node (the relay's has outbox=)
            delete_pushed_groups(url, job=job, instance=node_id)
