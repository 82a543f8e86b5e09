"""Metrics every outboxkit process exposes, and a Pushgateway push that never raises.

A process that is gone cannot be scraped, so the numbers that matter after
exit (rows left leased, forced shutdowns) are pushed to a Prometheus
Pushgateway when one is configured.

The push convention, the same for every process (the alert rules in
``deploy/prometheus/rules`` select on it):

* job ``outboxkit_<component>`` (``outboxkit_relay``, ``outboxkit_consumer``):
  the underscore keeps pushed series apart from the scrape jobs
  (``outboxkit-relay``, ``outboxkit-consumer``) the live-value rules select;
* one group per process, keyed ``instance=<node id>`` (the relay adds
  ``outbox=<identity>``); old groups that alert on nothing are pruned by the
  processes that come after (:mod:`outboxkit.runtime.pushgroups`);
* only *exit* metrics (:func:`push_exit_metrics`): values that describe how the
  process ended. Never a gauge of live state (lag, backlog, paused topics): the
  Pushgateway keeps a group forever, so a pushed live gauge would report the
  moment of exit as if it were now, and an alert on it would never resolve.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client import Enum as EnumMetric
from prometheus_client.exposition import default_handler, push_to_gateway
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from outboxkit.runtime.logs import log_event, redact, redact_url, register_secret

__all__ = [
    "PUSH_JOB_PREFIX",
    "STATES",
    "ServiceMetrics",
    "push_exit_metrics",
    "push_job",
    "push_metrics",
]

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

    def exit_metrics(self) -> tuple[Collector, ...]:
        """What every process pushes at exit: forced shutdowns and the drain's duration."""
        return (self.forced_shutdowns, self.shutdown_duration)


#: Pushgateway jobs are ``outboxkit_<component>``; see the module docstring.
PUSH_JOB_PREFIX = "outboxkit_"


def push_job(component: str) -> str:
    """The Pushgateway job of a ``component`` (``relay``, ``consumer``)."""
    return f"{PUSH_JOB_PREFIX}{component}"


class _Selected(Collector):
    """Exposes only the given metrics of a process's registry, for the exit push."""

    def __init__(self, metrics: Iterable[Collector]) -> None:
        self._metrics = tuple(metrics)

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.collect()


def push_exit_metrics(
    url: str,
    *,
    component: str,
    node_id: str,
    metrics: Iterable[Collector],
    timeout: float = 5.0,
    grouping: dict[str, str] | None = None,
) -> bool:
    """Push ``metrics`` (exit metrics only) as job ``outboxkit_<component>``,
    group ``instance=<node_id>`` plus ``grouping`` (the relay adds
    ``outbox=<identity>``, so relays of two outboxes never share a group, even
    under one node id); replaces that group. Never raises (see
    :func:`push_metrics`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Selected(metrics))
    return push_metrics(
        url,
        job=push_job(component),
        grouping_key={"instance": node_id, **(grouping or {})},
        registry=registry,
        timeout=timeout,
    )


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
