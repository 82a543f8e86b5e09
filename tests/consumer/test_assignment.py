"""What an operator sees of a consumer the group has assigned nothing: a member
beside another that holds the topic's only partition, as a member of a group
whose coordinator does not answer is (live, ready, idle)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import http_get, wait_for
from prometheus_client.parser import text_string_to_metric_families

from outboxkit.consumer import Consumer, ConsumerSettings, Message

pytestmark = pytest.mark.integration


class Idle(Consumer):
    def handle(self, message: Message) -> None:
        pass


def scrape(consumer: Consumer) -> dict[str, float]:
    """The consumer's ``/metrics`` as Prometheus reads it: name -> value (one
    series each of the names asked for below); empty while the health server
    is not up yet."""
    try:
        with urllib.request.urlopen(f"{consumer.health.url}/metrics", timeout=5) as resp:  # noqa: S310
            text = resp.read().decode()
    except OSError:
        return {}
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("worker_assigned", "worker_last_rebalance"))
    }


def ready(consumer: Consumer) -> tuple[int, dict[str, Any]]:
    return http_get(f"{consumer.health.url}/healthz/ready")


def test_assigned_partitions_and_time_since_rebalance_show_a_member_with_nothing(
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    holder, spare = (Idle(settings(group_id=group, topics=(topic,))) for _ in range(2))
    with run_consumer(holder):
        wait_for(
            lambda: scrape(holder).get("worker_assigned_partitions") == 1,
            30,
            what="the topic's one partition assigned to the first member",
        )
        assert scrape(holder)["worker_last_rebalance_timestamp_seconds"] > 0
        before = scrape(holder)["worker_last_rebalance_timestamp_seconds"]
        with run_consumer(spare):
            # The second member's join is a rebalance for the first one too; the
            # only partition stays where it is (cooperative-sticky).
            wait_for(
                lambda: scrape(holder)["worker_last_rebalance_timestamp_seconds"] > before,
                30,
                what="the rebalance of the second member's join",
            )
            assert scrape(holder)["worker_assigned_partitions"] == 1
            metrics = scrape(spare)
            assert metrics["worker_assigned_partitions"] == 0
            status, body = ready(spare)
            # Ready all the same (docs/consumer.md: an idle member is no fault of
            # its own); the alert on the group's assigned partitions says it.
            assert status == 200
            assert body["assigned"] == 0
            first = body["since_rebalance_s"]
            wait_for(
                lambda: ready(spare)[1]["since_rebalance_s"] >= first + 1,
                30,
                what="the time since the last rebalance growing",
            )
            assert scrape(spare) == metrics, "no rebalance since: the metrics stay as they were"
