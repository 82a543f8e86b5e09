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
