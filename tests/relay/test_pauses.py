"""``outbox_topic_paused`` always matches the pause state.

Generated sequences of pauses (with changing reasons) and resumes against the
real prometheus-client gauge: after every step exactly the paused topics are at
1, each under its current reason, and nothing else is left at 1 (an alert on the
gauge must clear). And a paused topic whose rows are all gone is resumed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from relay_support import EmbeddedRelay, add_events, fast_settings, wait_for
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay.metrics import RelayMetrics
from outboxkit.relay.pauses import PausedTopics
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import outbox_table

TOPICS = ("a", "b", "c")
REASONS = ("unknown-topic", "authorization", "authentication")

steps = st.lists(
    st.tuples(
        st.sampled_from(("pause", "resume")), st.sampled_from(TOPICS), st.sampled_from(REASONS)
    ),
    max_size=30,
)


def _gauge_at_one(registry: CollectorRegistry) -> dict[str, str]:
    out: dict[str, str] = {}
    for metric in registry.collect():
        if metric.name != "outbox_topic_paused":
            continue
        for sample in metric.samples:
            if sample.value == 1:
                topic = sample.labels["topic"]
                assert topic not in out, f"{topic} at 1 under two reasons"
                out[topic] = sample.labels["reason"]
            else:
                assert sample.value == 0, sample
    return out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(steps)
def test_gauge_matches_the_pause_state_after_every_step(
    ops: list[tuple[str, str, str]],
) -> None:
    registry = CollectorRegistry()
    paused = PausedTopics(retry_interval=30.0, gauge=RelayMetrics(registry).topic_paused)
    model: dict[str, str] = {}
    for op, topic, reason in ops:
        if op == "pause":
            paused.pause(topic, reason, "some error", 1)
            model[topic] = reason
        else:
            paused.resume(topic)
            model.pop(topic, None)
        assert _gauge_at_one(registry) == model
        assert paused.paused_topics() == frozenset(model)
        assert paused.details().keys() == model.keys()


@pytest.mark.integration
@on_both_databases
def test_a_paused_topic_whose_rows_are_gone_is_resumed(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    missing = f"okt_missing_{os.urandom(4).hex()}"
    add_events(engine, outbox, [Event(topic=missing, key="k", payload=b"m")])
    labels = {"topic": missing, "reason": "unknown-topic"}
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(
            fast_settings(db_url, kafka_bootstrap, paused_topic_retry=3600.0, metrics_interval=0.2)
        )
        wait_for(lambda: relay.metric("outbox_topic_paused", labels) == 1, timeout=20)
        t = outbox_table(outbox)
        with engine.begin() as conn:  # an operator deletes the rows (wrong topic name)
            conn.execute(sa.delete(t).where(t.c.topic == missing))
        wait_for(
            lambda: relay.metric("outbox_topic_paused", labels) == 0,
            timeout=20,
            what="the pause lifted once no row of the topic is left",
        )
        resumed = logs.events("topic-resumed")
        assert resumed and resumed[0]["topic"] == missing, resumed
        assert resumed[0]["cause"] == "no-rows-left"
        assert relay.stop() == 0


@pytest.mark.integration
@on_both_databases
def test_a_missing_topic_does_not_hold_back_the_other_topics_of_its_batch(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Eight rows for a topic that does not exist among 40 good ones, in one batch.

    librdkafka waits ``topic.metadata.propagation.max.ms`` before it reports an
    unknown topic (here set far beyond the test's waits, as a long message
    timeout does by default): the good rows must be delivered while the missing
    topic's rows are still unresolved or already paused, never burnt."""
    good = kafka_topics(partitions=2)
    missing = f"okt_missing_{os.urandom(4).hex()}"
    events = [Event(topic=good, key=f"g{i}", payload=b"g") for i in range(40)]
    for i in range(8):
        events.insert(i * 5, Event(topic=missing, key=f"m{i}", payload=b"m"))
    add_events(engine, outbox, events)
    settings = fast_settings(
        db_url,
        kafka_bootstrap,
        batch_size=100,
        lease_ttl=700.0,
        paused_topic_retry=3600.0,
        kafka_config={
            "message.timeout.ms": "600000",
            "topic.metadata.propagation.max.ms": "600000",
        },
    )
    t = outbox_table(outbox)

    def by_topic() -> dict[str, list[tuple[str, int]]]:
        with engine.connect() as conn:
            found = conn.execute(sa.select(t.c.topic, t.c.status, t.c.attempts))
            out: dict[str, list[tuple[str, int]]] = {}
            for topic, status, attempts in found:
                out.setdefault(topic, []).append((status, attempts))
            return out

    with capture_json_logs(level="INFO") as logs:
        relay = embedded(settings)
        wait_for(
            lambda: {s for s, _ in by_topic()[good]} == {"delivered"},
            timeout=60,
            what="the good topic's rows delivered",
        )
        waiting = by_topic()[missing]
        assert len(waiting) == 8
        assert {s for s, _ in waiting} <= {"delivering", "retryable"}, waiting
        assert all(a == 0 for s, a in waiting if s == "retryable"), "paused, not burnt"
        labels = {"topic": missing, "reason": "unknown-topic"}
        wait_for(lambda: relay.metric("outbox_topic_paused", labels) == 1, timeout=30)
        assert [e["topic"] for e in logs.events("topic-paused")] == [missing]
        assert relay.stop() == 0
    assert by_topic()[missing] == [("retryable", 0)] * 8
