"""deploy/local/pushgateway.sh keeps pushed groups in memory only.

Debian's prometheus-pushgateway persists to /var/lib/prometheus/pushgateway.data
unless told otherwise, a file shared by every instance on the machine. A
restarted (or a new, named) test Pushgateway would then start with groups that
earlier tests or other instances pushed, and an alert test could see a stale
value. deploy/local/README.md promises "in memory only"; this holds it to that.
"""

from __future__ import annotations

import urllib.request
import uuid

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import push_to_gateway
from support.services import PushgatewayInstance, free_port

pytestmark = pytest.mark.fault


def _groups_text(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:  # noqa: S310 - loopback
        return bytes(resp.read()).decode()


def test_a_restarted_local_pushgateway_starts_empty() -> None:
    instance = f"mem-{uuid.uuid4().hex[:8]}"
    with PushgatewayInstance(f"mem{uuid.uuid4().hex[:6]}", free_port()) as gateway:
        registry = CollectorRegistry()
        Gauge("outbox_shutdown_pending", "rows held at exit", registry=registry).set(7)
        push_to_gateway(
            gateway.url,
            job="outboxkit_relay",
            grouping_key={"instance": instance},
            registry=registry,
        )
        assert f'instance="{instance}"' in _groups_text(gateway.url)

        gateway.stop()
        gateway.start()
        assert f'instance="{instance}"' not in _groups_text(gateway.url), (
            "the group survived a restart: the Pushgateway persisted it to a file"
        )
