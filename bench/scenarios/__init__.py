"""The scenarios, in the order a full run measures them.

Ceilings come first so the outboxkit figures that follow can be divided by
ceilings taken minutes earlier on the same machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.context import BenchContext
from bench.report import ScenarioResult


class Unavailable(Exception):
    """The code a scenario measures is not there (e.g. not merged yet)."""


Results = dict[str, ScenarioResult]
Runner = Callable[[BenchContext, Results], ScenarioResult]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Runner


def all_scenarios() -> list[Scenario]:
    from bench.scenarios import (
        consumer,
        db_ceiling,
        drain,
        drivers,
        latency,
        producer,
        scaling,
        startup,
        throughput,
    )

    return [
        Scenario("db-ceiling", "the relay's claim + finalize SQL, no Kafka", db_ceiling.run),
        Scenario("producer-ceiling", "confluent-kafka alone, from memory", producer.run),
        Scenario("relay-throughput", throughput.TITLE, throughput.run),
        Scenario("backlog-scaling", "first 10% vs last 10% of a large backlog", scaling.run),
        Scenario("latency", "commit→ack latency at steady writer rates; writer rate", latency.run),
        Scenario("consumer", "raw poll loop vs the consumer base class", consumer.run),
        Scenario("drain", "SIGTERM → exit under load", drain.run),
        Scenario("startup", startup.TITLE, startup.run),
        Scenario("relay-drivers", drivers.TITLE, drivers.run),
    ]


def names() -> list[str]:
    return [s.name for s in all_scenarios()]
