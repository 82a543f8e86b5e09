"""The metric names the code registers, for tests that check queries against them."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

__all__ = ["exported_metric_names"]


def exported_metric_names() -> set[str]:
    """Every family and series name the relay and the consumer register, plus ``up``."""
    import logging

    from outboxkit.consumer.metrics import ConsumerMetrics
    from outboxkit.relay.conflicts import OwnershipConflicts
    from outboxkit.relay.metrics import RelayMetrics
    from outboxkit.relay.ownership.redis_leases import ShardLeaseMetrics
    from outboxkit.runtime import ServiceMetrics

    builders: list[Callable[[CollectorRegistry], object]] = [
        lambda r: RelayMetrics(r),
        lambda r: ConsumerMetrics(r),
        lambda r: ServiceMetrics(r, service="x"),
        lambda r: ShardLeaseMetrics(r, owned_gauge=False),
        lambda r: OwnershipConflicts(r, logging.getLogger("outboxkit.relay"), outbox="x"),
    ]
    names = {"up"}
    for build in builders:
        registry = CollectorRegistry()
        build(registry)
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names
