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
