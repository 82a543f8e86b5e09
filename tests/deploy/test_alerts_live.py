"""The shutdown-pending alert on a real Prometheus fed by a real Pushgateway.

promtool's unit tests prove the rule's logic on synthetic series; this proves the
whole path an operator relies on: a relay's exit push reaches the Pushgateway,
Prometheus scrapes it (honor_labels, as in deploy/prometheus/prometheus.yml), the
alert fires, and it resolves once a later clean exit pushes zero.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from outboxkit.runtime import push_metrics

pytestmark = pytest.mark.integration

RULES = (
    Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules" / "outboxkit.rules.yml"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback test URL
            return bytes(resp.read())
    except OSError:
        return None


def _wait(predicate: object, timeout: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.25)


def _alert_states(prom: str, instance: str) -> list[str]:
    body = _get(prom + "/api/v1/alerts")
    if body is None:
        return []
    alerts = json.loads(body)["data"]["alerts"]
    return [
        a["state"]
        for a in alerts
        if a["labels"].get("alertname") == "OutboxShutdownPending"
        and a["labels"].get("instance") == instance
    ]


def _push(url: str, instance: str, value: float) -> None:
    registry = CollectorRegistry()
    Gauge("outbox_shutdown_pending", "rows held at exit", registry=registry).set(value)
    assert push_metrics(
        url, job="outboxkit_relay", grouping_key={"instance": instance}, registry=registry
    )


def test_shutdown_pending_alert_fires_on_a_pushed_value_and_resolves_on_zero(
    prometheus: str, pushgateway_url: str
) -> None:
    instance = f"relay-test-{uuid.uuid4().hex[:8]}"
    try:
        _push(pushgateway_url, instance, 0)
        time.sleep(3)  # a few scrapes and evaluations of the clean value
        assert _alert_states(prometheus, instance) == []

        _push(pushgateway_url, instance, 7)  # an exit that left 7 rows leased
        _wait(lambda: _alert_states(prometheus, instance) == ["firing"], 30, "firing")

        _push(pushgateway_url, instance, 0)  # the next clean exit
        _wait(lambda: _alert_states(prometheus, instance) == [], 30, "resolved")
    finally:
        req = urllib.request.Request(  # noqa: S310 - loopback test URL
            f"{pushgateway_url}/metrics/job/outboxkit_relay/instance/{instance}", method="DELETE"
        )
        urllib.request.urlopen(req, timeout=5).close()  # noqa: S310 - loopback test URL
