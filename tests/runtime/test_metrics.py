from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
import uuid

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import delete_from_gateway
from support.services import free_port

from outboxkit.runtime import ServiceMetrics, push_metrics
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.unit

PUSHGATEWAY = os.environ.get("OUTBOXKIT_TEST_PUSHGATEWAY", "http://127.0.0.1:9091")


def test_service_metrics_names() -> None:
    registry = CollectorRegistry()
    m = ServiceMetrics(registry, service="relay")
    m.worker_restarts.labels(worker="claimer").inc()
    m.forced_shutdowns.inc()
    assert registry.get_sample_value("service_info", {"service": "relay"}) == 1
    assert registry.get_sample_value("service_state", {"service_state": "starting"}) == 1
    assert registry.get_sample_value("service_draining") == 0
    assert registry.get_sample_value("service_forced_shutdowns_total") == 1
    assert registry.get_sample_value("service_worker_restarts_total", {"worker": "claimer"}) == 1
    assert registry.get_sample_value("service_shutdown_duration_seconds") == 0


def test_push_to_unreachable_gateway_returns_false_and_logs_redacted_url() -> None:
    registry = CollectorRegistry()
    ServiceMetrics(registry, service="relay")
    url = f"http://user:pushpw@127.0.0.1:{free_port()}"
    start = time.monotonic()
    with capture_json_logs() as cap:
        ok = push_metrics(
            url, job="outboxkit", grouping_key={"node": "n"}, registry=registry, timeout=2
        )
    assert ok is False
    assert time.monotonic() - start < 5
    (rec,) = cap.events("metrics-push-failed")
    assert rec["url"] == f"http://user:***@127.0.0.1:{url.rsplit(':', 1)[1]}"
    assert "pushpw" not in cap.text


def test_push_to_garbage_url_never_raises() -> None:
    assert (
        push_metrics(
            "not a url at all", job="j", grouping_key={}, registry=CollectorRegistry(), timeout=1
        )
        is False
    )


def _gateway_ready() -> bool:
    try:
        with urllib.request.urlopen(f"{PUSHGATEWAY}/-/ready", timeout=2) as resp:  # noqa: S310
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_push_reaches_a_real_pushgateway() -> None:
    if not _gateway_ready():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Pushgateway at {PUSHGATEWAY} (CI=true)")
        pytest.skip(f"no Pushgateway at {PUSHGATEWAY}")
    registry = CollectorRegistry()
    ServiceMetrics(registry, service="relay")
    marker = Gauge("outboxkit_test_marker", "test", registry=registry)
    marker.set(42)
    node = f"test-{uuid.uuid4().hex[:8]}"
    key = {"node_id": node}
    try:
        assert (
            push_metrics(PUSHGATEWAY, job="outboxkit-test", grouping_key=key, registry=registry)
            is True
        )
        with urllib.request.urlopen(f"{PUSHGATEWAY}/metrics", timeout=5) as resp:  # noqa: S310
            text = resp.read().decode()
        line = next(
            ln for ln in text.splitlines() if ln.startswith("outboxkit_test_marker{") and node in ln
        )
        assert line.endswith(" 42")
        assert 'job="outboxkit-test"' in line
    finally:
        delete_from_gateway(PUSHGATEWAY, job="outboxkit-test", grouping_key=key, timeout=5)
