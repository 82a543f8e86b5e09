"""Pushgateway exit groups do not pile up when node ids are pod names.

Each relay pushes its exit metrics into a group of its own (``instance=<node
id>``, ``outbox=<identity>``). With pod names as node ids no later exit replaces
that group; so a relay, once running, deletes the groups of its outbox's relays
that were pushed more than ``pushgateway_prune_after`` ago and alert on nothing
(outboxkit/runtime/pushgroups.py). A group with ``outbox_shutdown_pending`` > 0
stays: it keeps OutboxShutdownPending firing until an operator deletes it.

On the real Pushgateway; every group here has node ids of this test only.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge
from relay_support import Pushgateway, RelayProcess, cli_args, fast_settings, wait_for

from outboxkit.relay import PUSH_JOB
from outboxkit.runtime.metrics import push_metrics
from outboxkit.runtime.pushgroups import FORCED_ALERT_WINDOW_S, prunable

pytestmark = pytest.mark.integration


def _groups(url: str) -> dict[str, dict[str, Any]]:
    """This job's groups by instance."""
    with urllib.request.urlopen(f"{url}/api/v1/metrics", timeout=5) as resp:  # noqa: S310
        data = json.loads(resp.read())["data"]
    return {g["labels"]["instance"]: g for g in data if g["labels"].get("job") == PUSH_JOB}


def _push_pending(url: str, *, node_id: str, outbox: str, pending: float) -> None:
    registry = CollectorRegistry()
    Gauge("outbox_shutdown_pending", "rows held at exit", registry=registry).set(pending)
    assert push_metrics(
        url, job=PUSH_JOB, grouping_key={"instance": node_id, "outbox": outbox}, registry=registry
    )


def _pushed_at(group: dict[str, Any]) -> float:
    return float(group["push_time_seconds"]["metrics"][0]["value"])


def _run_relay(
    relay_process: Callable[..., RelayProcess], args: list[str], *, until: Callable[[], bool]
) -> RelayProcess:
    relay = relay_process(args)
    relay.wait_event("relay-started", timeout=30)
    wait_for(until, timeout=30, what="the relay's effect on the Pushgateway")
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0
    return relay


def test_a_running_relay_prunes_its_outboxs_old_clean_groups_and_keeps_alerting_ones(
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    relay_process: Callable[..., RelayProcess],
    pushgateway: Pushgateway,
) -> None:
    tag = uuid.uuid4().hex[:8]
    pod_a, pod_b, crashed, elsewhere = (
        pushgateway.track(f"relay-{tag}-{name}") for name in ("a", "b", "crashed", "elsewhere")
    )

    def args(node_id: str) -> list[str]:
        return cli_args(
            fast_settings(
                db_url,
                kafka_bootstrap,
                node_id=node_id,
                pushgateway_url=pushgateway.url,
                pushgateway_prune_after=1.0,
            )
        )

    # A first pod comes and goes: its group (0 rows held) is left behind.
    _run_relay(relay_process, args(pod_a), until=lambda: True)
    first = _groups(pushgateway.url)[pod_a]
    identity = first["labels"]["outbox"]
    assert [m["value"] for m in first["outbox_shutdown_pending"]["metrics"]] == ["0"]
    # A pod that was killed holding rows (alerting), and a clean group of another outbox.
    _push_pending(pushgateway.url, node_id=crashed, outbox=identity, pending=2)
    _push_pending(pushgateway.url, node_id=elsewhere, outbox=f"other-{tag}", pending=0)
    wait_for(
        lambda: all(
            time.time() - _pushed_at(_groups(pushgateway.url)[n]) > 1.5
            for n in (pod_a, crashed, elsewhere)
        ),
        timeout=10,
        what="the groups to age past pushgateway_prune_after",
    )

    # The next pod of the same outbox deletes the first one's group once running.
    _run_relay(relay_process, args(pod_b), until=lambda: pod_a not in _groups(pushgateway.url))

    groups = _groups(pushgateway.url)
    assert pod_b in groups, "the new pod's own exit group"
    assert crashed in groups, "an alerting group stays until it is acknowledged"
    assert elsewhere in groups, "another outbox's groups are not this relay's to prune"


def test_prunable_keeps_what_an_alert_fires_on() -> None:
    def group(age: float, **values: float) -> dict[str, Any]:
        g: dict[str, Any] = {
            "push_time_seconds": {"metrics": [{"value": str(1_000_000.0 - age)}]},
        }
        for name, value in values.items():
            g[name] = {"metrics": [{"value": str(value)}]}
        return g

    now = 1_000_000.0
    assert prunable(group(7200, outbox_shutdown_pending=0), now=now, older_than=3600)
    assert not prunable(group(60, outbox_shutdown_pending=0), now=now, older_than=3600)
    assert not prunable(group(7200, outbox_shutdown_pending=3), now=now, older_than=3600)
    # A forced exit alerts for an hour after its push, then no longer.
    young = FORCED_ALERT_WINDOW_S - 60
    assert not prunable(group(young, service_forced_shutdowns_total=1), now=now, older_than=60)
    old = FORCED_ALERT_WINDOW_S + 60
    assert prunable(group(old, service_forced_shutdowns_total=1), now=now, older_than=60)
    assert prunable(group(7200, worker_shutdown_released_messages=4), now=now, older_than=3600)
