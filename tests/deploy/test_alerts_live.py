"""The shutdown-pending alert on a real Prometheus fed by a real Pushgateway.

promtool's unit tests prove the rule's logic on synthetic series; this proves the
whole path an operator relies on: a relay's exit push reaches the Pushgateway,
Prometheus scrapes it (honor_labels, as in deploy/prometheus/prometheus.yml), the
alert fires, and it resolves once a later clean exit pushes zero.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from support.prometheus import http_get, prom_query
from support.waiting import wait_for

from outboxkit.runtime import push_metrics

pytestmark = pytest.mark.integration

RULES = (
    Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules" / "outboxkit.rules.yml"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _last_evaluation(prom: str, alertname: str) -> str:
    """When the rule ``alertname`` was last evaluated (Prometheus' own timestamp)."""
    body = http_get(f"{prom}/api/v1/rules")
    assert body is not None, "Prometheus does not answer"
    for group in json.loads(body)["data"]["groups"]:
        for rule in group["rules"]:
            if rule.get("name") == alertname:
                return str(rule["lastEvaluation"])
    raise AssertionError(f"no rule {alertname} loaded")


def _wait_for_evaluations(prom: str, alertname: str, count: int) -> None:
    """Return after ``count`` evaluations of the rule that began from now on
    (the first change may be one already running)."""
    seen = [_last_evaluation(prom, alertname)]

    def evaluated() -> bool:
        last = _last_evaluation(prom, alertname)
        if last != seen[-1]:
            seen.append(last)
        return len(seen) > count

    wait_for(evaluated, timeout=30, interval=0.1, what=f"{count} evaluations of {alertname}")


def _alert_states(prom: str, instance: str) -> list[str]:
    body = http_get(prom + "/api/v1/alerts")
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
        # No alert once the rules were evaluated over the scraped clean value.
        wait_for(
            lambda: prom_query(prometheus, f'outbox_shutdown_pending{{instance="{instance}"}}'),
            timeout=30,
            interval=0.25,
            what="the clean value scraped",
        )
        _wait_for_evaluations(prometheus, "OutboxShutdownPending", count=2)
        assert _alert_states(prometheus, instance) == []

        _push(pushgateway_url, instance, 7)  # an exit that left 7 rows leased
        wait_for(
            lambda: _alert_states(prometheus, instance) == ["firing"],
            timeout=30,
            interval=0.25,
            what="firing",
        )

        _push(pushgateway_url, instance, 0)  # the next clean exit
        wait_for(
            lambda: _alert_states(prometheus, instance) == [],
            timeout=30,
            interval=0.25,
            what="resolved",
        )
    finally:
        req = urllib.request.Request(  # noqa: S310 - loopback test URL
            f"{pushgateway_url}/metrics/job/outboxkit_relay/instance/{instance}", method="DELETE"
        )
        urllib.request.urlopen(req, timeout=5).close()  # noqa: S310 - loopback test URL
