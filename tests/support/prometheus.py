"""Reading a local Prometheus (or any loopback HTTP endpoint) from a test."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any


def http_get(url: str) -> bytes | None:
    """The body at ``url``, or None while nothing answers there."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback test URL
            return bytes(resp.read())
    except OSError:
        return None


def prom_query(prom: str, expr: str) -> list[dict[str, Any]]:
    """The result vector of the instant query ``expr`` at Prometheus ``prom``."""
    body = http_get(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert body is not None, "Prometheus does not answer"
    result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
    return result


def delete_pushed_groups(url: str, *, job: str, instance: str) -> None:
    """Delete every Pushgateway group of ``job`` whose ``instance`` is ``instance``,
    whatever other grouping labels it has (the relay adds ``outbox``)."""
    from prometheus_client.exposition import delete_from_gateway

    listing = f"{url.rstrip('/')}/api/v1/metrics"
    with urllib.request.urlopen(listing, timeout=5) as resp:  # noqa: S310 - loopback test URL
        groups = json.loads(resp.read().decode())["data"]
    for group in groups:
        labels = dict(group.get("labels", {}))
        if labels.pop("job", None) != job or labels.get("instance") != instance:
            continue
        delete_from_gateway(url, job=job, grouping_key=labels, timeout=5)
