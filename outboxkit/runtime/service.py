"""The runtime pieces a long-running service (relay, consumer) wires the same way."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from outboxkit.runtime.health import HealthServer
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.metrics import ServiceMetrics
from outboxkit.runtime.settings import RuntimeSettings
from outboxkit.runtime.supervisor import Supervisor

__all__ = ["ServiceRuntime", "freeze_heap"]


@dataclass(frozen=True, slots=True)
class ServiceRuntime:
    """One registry, the service metrics on it, the lifecycle, the worker
    supervisor and the health/metrics server (not started yet)."""

    registry: CollectorRegistry
    service_metrics: ServiceMetrics
    lifecycle: Lifecycle
    supervisor: Supervisor
    health: HealthServer

    @classmethod
    def build(
        cls,
        settings: RuntimeSettings,
        *,
        logger: logging.Logger,
        details: Callable[[], dict[str, object]],
    ) -> ServiceRuntime:
        """``details``: extra fields of the readiness answer."""
        registry = CollectorRegistry()
        service_metrics = ServiceMetrics(registry, service=settings.service)
        lifecycle = Lifecycle(
            service=settings.service,
            node_id=settings.node_id,
            shutdown_timeout=settings.shutdown_timeout,
            logger=logger,
            metrics=service_metrics,
        )
        return cls(
            registry=registry,
            service_metrics=service_metrics,
            lifecycle=lifecycle,
            supervisor=Supervisor(lifecycle, logger=logger, metrics=service_metrics),
            health=HealthServer(
                lifecycle,
                host=settings.health_host,
                port=settings.health_port,
                registry=registry,
                details=details,
            ),
        )


def freeze_heap() -> int:
    """Collect once, then move every object alive into the collector's permanent
    generation; return how many objects it holds.

    For processes that own their heap (the ``outboxkit relay`` command), once
    started: the modules, engine and producer live as long as the process, and a
    full collection walked them all, a pause of 50-90 ms measured on the relay's
    loop at 1,000 events/s (the p99 of commit->ack). Objects created later are
    collected as before. Not for embedded use: in a host process, cyclic garbage
    that is alive at this moment would never be collected.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
