"""A consumer's exit push, on the real Pushgateway, matches the alert rules.

A real ``outboxkit consume`` process builds a backlog (so it measures a lag),
is forced to exit past its shutdown timeout, and pushes. Then:

* its Pushgateway group follows the one push convention of every process
  (job ``outboxkit_<component>``, grouped by ``instance`` = node id, and the
  consumer's by ``consumer_group``) and holds
  exit metrics only: no ``worker_consumer_lag`` or other live gauge that would
  go stale and keep a lag alert firing after the process is gone;
* a real Prometheus with ``deploy/prometheus/rules`` scraping that Pushgateway
  (``honor_labels``, as in ``deploy/prometheus/prometheus.yml``) fires
  ``OutboxForcedShutdown`` for this consumer's instance, and the lag rule's
  selector finds no pushed series.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from support.prometheus import http_get, prom_query
from support.services import free_port
from support.waiting import wait_for

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[1] / "deploy" / "prometheus" / "rules" / "outboxkit.rules.yml"
#: What a consumer may push: how it ended, nothing that describes live state.
EXIT_METRICS = {
    "service_forced_shutdowns_total",
    "service_forced_shutdowns_created",
    "service_shutdown_duration_seconds",
    "worker_shutdown_released_messages",
    "worker_shutdown_committed_messages",
    # Added by the Pushgateway itself.
    "push_time_seconds",
    "push_failure_time_seconds",
}


def _pushed_groups(url: str) -> list[dict[str, Any]]:
    body = http_get(f"{url}/api/v1/metrics")
    assert body is not None, "Pushgateway API unreachable"
    groups: list[dict[str, Any]] = json.loads(body)["data"]
    return groups


def _groups_of(url: str, node_id: str) -> list[dict[str, Any]]:
    return [
        g
        for g in _pushed_groups(url)
        if node_id in json.dumps(g["labels"])  # any label carrying the node id
    ]


def _families(group: dict[str, Any]) -> dict[str, Any]:
    return {
        name: value
        for name, value in group.items()
        if isinstance(value, dict) and "metrics" in value
    }


def _scraped_lag(health: str) -> float:
    body = http_get(f"{health}/metrics") or b""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("worker_consumer_lag{")
    ]
    return max(values, default=0.0)


def _firing(prom: str, alertname: str, instance: str) -> bool:
    body = http_get(f"{prom}/api/v1/alerts")
    if body is None:
        return False
    return any(
        a["labels"].get("alertname") == alertname
        and a["labels"].get("instance") == instance
        and a["state"] == "firing"
        for a in json.loads(body)["data"]["alerts"]
    )


def _lag_rule_selector() -> str:
    """The series selector inside ConsumerLagHigh, as the rules file has it."""
    text = RULES.read_text()
    block = text[text.index("alert: ConsumerLagHigh") :]
    match = re.search(r"worker_consumer_lag\{[^}]*\}", block)
    assert match, "ConsumerLagHigh no longer selects worker_consumer_lag{...}"
    return match.group(0)


@pytest.fixture
def consumer_process(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], pushgateway_url: str
) -> Iterator[Callable[[], tuple[subprocess.Popen[str], str, str]]]:
    procs: list[subprocess.Popen[str]] = []
    node_ids: list[str] = []

    def start() -> tuple[subprocess.Popen[str], str, str]:
        topic = kafka_topics(1)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for i in range(200):
            producer.produce(topic, key=b"k", value=str(i).encode())
        assert producer.flush(30) == 0
        node_id = f"consumer-push-{uuid.uuid4().hex[:8]}"
        node_ids.append(node_id)
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")},
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_TOPICS": topic,
            "OUTBOXKIT_GROUP_ID": f"g-{topic}",
            "OUTBOXKIT_NODE_ID": node_id,
            "OUTBOXKIT_SERVICE": "push-test",
            "OUTBOXKIT_HEALTH_PORT": str(port),
            "OUTBOXKIT_PUSHGATEWAY_URL": pushgateway_url,
            "OUTBOXKIT_STATS_INTERVAL": "0.5",
            "OUTBOXKIT_WORKER_DRAIN_TIMEOUT": "1",
            "OUTBOXKIT_CLOSE_TIMEOUT": "1",
            "OUTBOXKIT_SHUTDOWN_TIMEOUT": "4",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "outboxkit", "consume", "push_apps:StuckOnStop"],
            env=env,
            cwd=HERE,  # not the repository root: its outboxkit/ folder would shadow the package
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc, node_id, f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    for node_id in node_ids:
        for group in _groups_of(pushgateway_url, node_id):
            path = "".join(
                f"/{k}/{urllib.parse.quote(v, safe='')}"
                for k, v in group["labels"].items()
                if k != "job"
            )
            job = group["labels"]["job"]
            req = urllib.request.Request(  # noqa: S310 - loopback test URL
                f"{pushgateway_url}/metrics/job/{job}{path}", method="DELETE"
            )
            urllib.request.urlopen(req, timeout=5).close()  # noqa: S310 - loopback test URL


def test_a_forced_consumer_exit_pushes_exit_metrics_under_the_rules_convention(
    consumer_process: Callable[[], tuple[subprocess.Popen[str], str, str]],
    pushgateway_url: str,
    prometheus: str,
) -> None:
    proc, node_id, health = consumer_process()
    wait_for(
        lambda: _scraped_lag(health) > 0,
        timeout=60,
        interval=0.25,
        what="a consumer lag > 0 on /metrics",
    )

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 4, err[-3000:]  # forced: on_stop hangs past shutdown_timeout

    groups = _groups_of(pushgateway_url, node_id)
    (labels,) = [g["labels"] for g in groups]
    group_id = labels.get("consumer_group", "")
    assert group_id.startswith("g-"), labels  # the consumer group (OUTBOXKIT_GROUP_ID)
    assert labels == {"job": "outboxkit_consumer", "instance": node_id, "consumer_group": group_id}
    families = _families(groups[0])
    assert set(families) <= EXIT_METRICS, sorted(set(families) - EXIT_METRICS)
    forced = families["service_forced_shutdowns_total"]["metrics"][0]["value"]
    assert float(forced) == 1.0

    # The real rules on a real Prometheus scraping this Pushgateway.
    wait_for(
        lambda: _firing(prometheus, "OutboxForcedShutdown", node_id),
        timeout=60,
        interval=0.25,
        what="OutboxForcedShutdown firing for the consumer",
    )
    selector = _lag_rule_selector()
    assert prom_query(prometheus, f'{selector[:-1]},instance="{node_id}"}}') == []
    assert prom_query(prometheus, f'worker_consumer_lag{{instance="{node_id}"}}') == []


def test_a_clean_consumer_exit_pushes_the_drain_duration_it_logged(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], pushgateway_url: str
) -> None:
    """The pushed ``service_shutdown_duration_seconds`` is the drain's real duration
    (the exit record's ``duration_ms``). On main the consumer pushed 0: the push
    came before the gauge was set (the relay pushes the true value)."""
    topic = kafka_topics(1)
    node_id = f"consumer-duration-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")},
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_GROUP_ID": f"g-{topic}",
        "OUTBOXKIT_NODE_ID": node_id,
        "OUTBOXKIT_SERVICE": "push-test",
        "OUTBOXKIT_HEALTH_PORT": str(port),
        "OUTBOXKIT_PUSHGATEWAY_URL": pushgateway_url,
        "OUTBOXKIT_LOG_FORMAT": "json",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "consume", "push_apps:Idle"],
        env=env,
        cwd=HERE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (
                proc.poll() is None
                and http_get(f"http://127.0.0.1:{port}/healthz/ready") is not None
            ),
            timeout=60,
            interval=0.25,
            what="the consumer ready",
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        [record] = [
            json.loads(line)
            for line in err.splitlines()
            if line.startswith("{") and '"consumer-exit"' in line
        ]
        [group] = _groups_of(pushgateway_url, node_id)
        pushed = float(_families(group)["service_shutdown_duration_seconds"]["metrics"][0]["value"])
        # Set just before the push, after the exit record was written: never less.
        assert pushed > 0, group
        assert pushed >= record["duration_ms"] / 1000 - 0.001, (pushed, record)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        for group in _groups_of(pushgateway_url, node_id):
            path = "".join(
                f"/{k}/{urllib.parse.quote(v, safe='')}"
                for k, v in group["labels"].items()
                if k != "job"
            )
            req = urllib.request.Request(  # noqa: S310 - loopback test URL
                f"{pushgateway_url}/metrics/job/{group['labels']['job']}{path}", method="DELETE"
            )
            urllib.request.urlopen(req, timeout=5).close()  # noqa: S310 - loopback test URL
