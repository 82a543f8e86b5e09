"""Metrics every outboxkit process exposes, and a Pushgateway push that never raises.

A process that is gone cannot be scraped, so the numbers that matter after
exit (rows left leased, forced shutdowns) are pushed to a Prometheus
Pushgateway when one is configured.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client import Enum as EnumMetric
from prometheus_client.exposition import default_handler, push_to_gateway

from outboxkit.runtime.logs import log_event, redact, redact_url, register_secret

__all__ = ["STATES", "ServiceMetrics", "push_metrics"]

STATES = ("starting", "running", "draining", "stopped")

_log = logging.getLogger("outboxkit.runtime.metrics")


class ServiceMetrics:
    """Lifecycle metrics shared by the relay and the consumer.

    ``service_state`` / ``service_draining`` / ``service_shutdown_duration_seconds``
    are kept up to date by a :class:`~outboxkit.runtime.lifecycle.Lifecycle` the
    metrics are attached to; ``service_worker_restarts_total{worker}`` by the
    :class:`~outboxkit.runtime.supervisor.Supervisor`.
    """

    def __init__(self, registry: CollectorRegistry, *, service: str) -> None:
        self.registry = registry
        self.service = service
        self.info = Info("service", "The outboxkit service this process runs", registry=registry)
        self.info.info({"service": service})
        self.draining = Gauge(
            "service_draining", "1 once the process has started draining", registry=registry
        )
        self.state = EnumMetric(
            "service_state",
            "Lifecycle state of the process",
            states=list(STATES),
            registry=registry,
        )
        self.shutdown_duration = Gauge(
            "service_shutdown_duration_seconds",
            "Seconds from the start of the drain to the stopped state",
            registry=registry,
        )
        self.forced_shutdowns = Counter(
            "service_forced_shutdowns_total",
            "Exits forced because shutdown_timeout passed",
            registry=registry,
        )
        self.worker_restarts = Counter(
            "service_worker_restarts_total",
            "Worker loops restarted by the supervisor after an unexpected exception",
            ["worker"],
            registry=registry,
        )
        self.state.state("starting")


def _auth_handler(username: str, password: str) -> Callable[..., Callable[[], None]]:
    token = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")

    def handler(
        url: str, method: str, timeout: float | None, headers: list[tuple[str, str]], data: bytes
    ) -> Callable[[], None]:
        headers = [*headers, ("Authorization", f"Basic {token}")]
        return default_handler(url, method, timeout, headers, data)

    return handler


def push_metrics(
    url: str,
    *,
    job: str,
    grouping_key: dict[str, str],
    registry: CollectorRegistry,
    timeout: float = 5.0,
) -> bool:
    """Push ``registry`` to the Pushgateway at ``url`` (PUT: replaces the group).

    Credentials in the URL (``http://user:pw@host:9091``) are sent as basic auth.
    Returns True on success. Any failure is logged (URL redacted) and returns
    False: a push happens on the way out and must never turn a clean exit into
    a crash.
    """
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        handler: Callable[..., Callable[[], None]] = default_handler
        if parts.username is not None or parts.password is not None:
            register_secret(parts.password or "")
            handler = _auth_handler(parts.username or "", parts.password or "")
            netloc = parts.netloc.rsplit("@", 1)[1]
            parts = parts._replace(netloc=netloc)
        push_to_gateway(
            parts.geturl(),
            job=job,
            registry=registry,
            grouping_key=grouping_key,
            timeout=timeout,
            handler=handler,
        )
    except Exception as exc:
        log_event(
            _log,
            "metrics-push-failed",
            level=logging.WARNING,
            url=redact_url(url),
            job=job,
            error=redact(f"{type(exc).__name__}: {exc}"),
        )
        return False
    log_event(_log, "metrics-pushed", level=logging.DEBUG, url=redact_url(url), job=job)
    return True
