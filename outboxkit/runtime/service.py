"""The runtime pieces a long-running service (relay, consumer) wires the same way."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry

from outboxkit.runtime.health import HealthServer
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.metrics import ServiceMetrics
from outboxkit.runtime.settings import RuntimeSettings
from outboxkit.runtime.supervisor import Supervisor

__all__ = [
    "Service",
    "ServiceRuntime",
    "freeze_heap",
    "frozen_while_running",
    "handles_signals",
]


@runtime_checkable
class Service(Protocol):
    """The one lifecycle both services (``Relay``, ``Consumer``) offer their caller.

    ``run`` starts the service and returns its exit code once it has drained;
    ``stop`` (thread-safe) starts the drain, as the first SIGTERM does. With
    ``handle_signals`` the service owns the process's SIGTERM/SIGINT for the run
    (a second signal hurries the drain; a watchdog forces the exit past
    ``shutdown_timeout``) and gives them back when ``run`` returns; the default,
    ``None``, means yes on the main thread (an entry point) and no on any other
    (embedded: call ``stop``). A clean stop's exit record says ``clean``
    (:data:`~outboxkit.runtime.exitrecord.CLEAN`).
    """

    def run(self, *, handle_signals: bool | None = None) -> int: ...

    def stop(self) -> None: ...


def handles_signals(requested: bool | None) -> bool:
    """What ``run(handle_signals=requested)`` does (see :class:`Service`)."""
    if requested is None:
        return threading.current_thread() is threading.main_thread()
    return requested


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
        """``details``: extra fields of the readiness answer. A crash-looping
        worker adds its own and turns readiness to 503 (``Supervisor.readiness``)."""
        registry = CollectorRegistry()
        service_metrics = ServiceMetrics(registry, service=settings.service)
        lifecycle = Lifecycle(
            service=settings.service,
            node_id=settings.node_id,
            shutdown_timeout=settings.shutdown_timeout,
            logger=logger,
            metrics=service_metrics,
        )
        supervisor = Supervisor(lifecycle, logger=logger, metrics=service_metrics)

        def readiness() -> dict[str, object]:
            # The service's fields, then the supervisor's: its "ready": false wins.
            return {**details(), **supervisor.readiness()}

        return cls(
            registry=registry,
            service_metrics=service_metrics,
            lifecycle=lifecycle,
            supervisor=supervisor,
            health=HealthServer(
                lifecycle,
                host=settings.health_host,
                port=settings.health_port,
                registry=registry,
                details=readiness,
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


_freeze_lock = threading.Lock()
_freeze_holders = 0  # running blocks of frozen_while_running that took part


@contextmanager
def frozen_while_running(enabled: bool) -> Iterator[bool]:
    """:func:`freeze_heap` for the block's duration, undone when the last such
    block of the process ends; yields whether this block takes part.

    For services that may be embedded (the consumer): a few objects per
    message live until the message is handled, and as they move up the
    generations they trigger full collections, which walk every object in the
    process; on the benchmark's 200,000-message topic, 6 or 7 of 50-80 ms each,
    about a sixth of the consumer's CPU. The objects alive at start are nearly
    all there for good, so they are left out while the service runs. The cost:
    a reference cycle among them that becomes garbage meanwhile is reclaimed
    only after the freeze ends (``gc.unfreeze``). If something else in the
    process froze objects already (a pre-fork server, the relay's
    :func:`freeze_heap`), nothing is done: unfreezing would undo its freeze.
    """
    global _freeze_holders
    with _freeze_lock:
        joined = enabled and (_freeze_holders > 0 or gc.get_freeze_count() == 0)
        if joined:
            if _freeze_holders == 0:
                freeze_heap()
            _freeze_holders += 1
    try:
        yield joined
    finally:
        if joined:
            with _freeze_lock:
                _freeze_holders -= 1
                if _freeze_holders == 0:
                    gc.unfreeze()
