"""Pruning the Pushgateway groups of processes that are gone and alert on nothing.

Every process pushes its exit metrics into a group of its own (job
``outboxkit_<component>``, ``instance=<node id>``; see
:mod:`outboxkit.runtime.metrics`). Where node ids are pod names, as in the
shipped Kubernetes manifests, no later exit ever replaces such a group, and the
Pushgateway keeps every one of them forever: one more per pod, without bound.

So each process, once running, deletes the groups of its own job (and, for a
relay, of its own outbox) that

* were pushed more than ``pushgateway_prune_after`` seconds ago, and
* keep no alert firing: ``outbox_shutdown_pending`` is absent or 0 everywhere in
  the group (``OutboxShutdownPending`` fires on any other value, until an
  operator deletes the group), and ``service_forced_shutdowns_total`` is 0 or
  was pushed more than :data:`FORCED_ALERT_WINDOW_S` ago (``OutboxForcedShutdown``
  looks at the last hour of pushes only).

What stays is bounded: the exits of the last ``pushgateway_prune_after``
seconds, plus one group per unacknowledged incident, each of which alerts.
Pruning never fails a start: any error is logged and the process runs on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from outboxkit.runtime.logs import log_event, redact, redact_url, register_secret

__all__ = ["FORCED_ALERT_WINDOW_S", "prunable", "prune_pushed_groups", "start_pruning"]

_log = logging.getLogger("outboxkit.runtime.metrics")

#: How far back ``OutboxForcedShutdown`` looks at pushed forced exits
#: (deploy/prometheus/rules: ``time() - push_time_seconds < 3600``).
FORCED_ALERT_WINDOW_S = 3600.0


def _values(group: Mapping[str, Any], name: str) -> list[float]:
    family = group.get(name)
    if not isinstance(family, dict):
        return []
    out = []
    for metric in family.get("metrics", []):
        try:
            out.append(float(metric.get("value")))
        except (TypeError, ValueError):
            continue
    return out


def prunable(group: Mapping[str, Any], *, now: float, older_than: float) -> bool:
    """Does the Pushgateway ``group`` (one entry of ``/api/v1/metrics``) keep no
    alert firing and date from more than ``older_than`` seconds before ``now``?"""
    pushed = _values(group, "push_time_seconds")
    if not pushed:
        return False
    age = now - max(pushed)
    if age <= older_than:
        return False
    if any(v != 0 for v in _values(group, "outbox_shutdown_pending")):
        return False
    forced = any(v > 0 for v in _values(group, "service_forced_shutdowns_total"))
    return not (forced and age <= FORCED_ALERT_WINDOW_S)


def _split(url: str) -> tuple[str, dict[str, str]]:
    """The base URL without credentials, and an Authorization header if it had some."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    headers: dict[str, str] = {}
    if parts.username is not None or parts.password is not None:
        import base64

        register_secret(parts.password or "")
        token = f"{parts.username or ''}:{parts.password or ''}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(token).decode("ascii")
        parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
    return parts.geturl().rstrip("/"), headers


def _group_path(labels: Mapping[str, str]) -> str:
    """``/metrics/job/<job>/<label>/<value>...``, every value base64url-encoded
    (the Pushgateway's ``@base64`` form: values may hold ``/`` or be empty)."""
    import base64

    def enc(value: str) -> str:
        return base64.urlsafe_b64encode(value.encode()).decode("ascii") or "="

    path = f"/metrics/job@base64/{enc(labels['job'])}"
    for key in sorted(k for k in labels if k != "job"):
        path += f"/{key}@base64/{enc(labels[key])}"
    return path


def prune_pushed_groups(
    url: str,
    *,
    job: str,
    match: Mapping[str, str] | None = None,
    older_than: float,
    timeout: float = 5.0,
    now: Callable[[], float] = time.time,
) -> int:
    """Delete the groups of ``job`` (whose labels include ``match``) that
    :func:`prunable` allows; return how many. Never raises: a failure is logged
    (``pushgateway-prune-failed``, URL redacted) and counts 0."""
    try:
        base, headers = _split(url)
        # http(s) only: the setting is validated at start (valid_http_url).
        request = urllib.request.Request(f"{base}/api/v1/metrics", headers=headers)  # noqa: S310
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310
            groups = json.loads(resp.read()).get("data") or []
        at = now()
        deleted = 0
        for group in groups:
            labels = group.get("labels") or {}
            if labels.get("job") != job:
                continue
            if any(labels.get(k) != v for k, v in (match or {}).items()):
                continue
            if not prunable(group, now=at, older_than=older_than):
                continue
            path = base + _group_path(labels)
            delete = urllib.request.Request(path, method="DELETE", headers=headers)  # noqa: S310
            with urllib.request.urlopen(delete, timeout=timeout):  # noqa: S310
                deleted += 1
    except Exception as exc:
        log_event(
            _log,
            "pushgateway-prune-failed",
            level=logging.WARNING,
            url=redact_url(url),
            job=job,
            error=redact(f"{type(exc).__name__}: {exc}"),
        )
        return 0
    if deleted:
        log_event(
            _log,
            "pushgateway-pruned",
            job=job,
            groups=deleted,
            older_than_s=older_than,
            note="exit groups of processes gone, alerting on nothing",
        )
    return deleted


def start_pruning(
    url: str | None, *, job: str, match: Mapping[str, str] | None = None, older_than: float
) -> threading.Thread | None:
    """Prune once, on a daemon thread so a slow Pushgateway never delays a start;
    nothing when no Pushgateway is configured or ``older_than`` is 0 (off)."""
    if not url or older_than <= 0:
        return None
    thread = threading.Thread(
        target=prune_pushed_groups,
        kwargs={"url": url, "job": job, "match": dict(match or {}), "older_than": older_than},
        name="pushgateway-prune",
        daemon=True,
    )
    thread.start()
    return thread
