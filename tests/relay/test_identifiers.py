"""A paused topic holds back its own rows only, not a topic whose name differs in case."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, fast_settings, rows, wait_for

from outboxkit import Event
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.integration


def test_a_paused_missing_topic_does_not_hold_back_the_topic_spelled_in_lower_case(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    real = kafka_topics(partitions=1)
    missing = real.upper()  # never created: its rows pause the topic
    add_events(engine, outbox, [Event(topic=missing, key=f"m{i}", payload=b"m") for i in range(3)])
    with capture_json_logs(level="INFO") as logs:
        # The next probe of the paused topic is a minute away: the real topic's rows
        # must not wait for it.
        relay = embedded(fast_settings(db_url, kafka_bootstrap, paused_topic_retry=60.0))
        wait_for(lambda: logs.events("topic-paused"), timeout=20, what="topic-paused")
        assert logs.events("topic-paused")[0]["topic"] == missing
        added = time.monotonic()
        add_events(
            engine, outbox, [Event(topic=real, key=f"r{i}", payload=b"r") for i in range(20)]
        )
        wait_for(
            lambda: relay.metric("outbox_rows_delivered_total") == 20,
            timeout=20,
            what="the real topic's rows delivered before the paused topic's next probe",
        )
        assert time.monotonic() - added < 60
        assert relay.stop() == 0
    by_topic = {(r.topic, r.status) for r in rows(engine, outbox)}
    assert by_topic == {(real, "delivered"), (missing, "retryable")}
