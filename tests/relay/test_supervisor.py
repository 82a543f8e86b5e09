"""Unexpected exceptions inside a batch: restarted with backoff, never once draining."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from relay_support import (
    EmbeddedRelay,
    add_events,
    fast_settings,
    http_get,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay import Batch, Relay, accounting
from outboxkit.relay.pipeline import Pipeline
from outboxkit.runtime import EXIT_FAILURE
from outboxkit.runtime.testing import capture_json_logs

pytestmark = [pytest.mark.integration, on_both_databases]


class Boom(RuntimeError):
    pass


def test_injected_exception_restarts_the_loop_with_backoff_and_keeps_the_attempt(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(5)])
    crashes = iter([Boom("first"), Boom("second")])

    def fault(batch: Batch) -> None:
        exc = next(crashes, None)
        if exc is not None:
            raise exc

    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap), on_batch=fault)
        wait_for(lambda: status_counts(engine, outbox) == {"delivered": 5}, timeout=20, what="rows")
        assert relay.stop() == 0
    crashed = logs.events("worker-crashed")
    assert [c["restart_in_s"] for c in crashed] == [1.0, 2.0], "the backoff series"
    assert [c["worker"] for c in crashed] == ["relay", "relay"]
    assert "Boom: first" in str(crashed[0]["error"]) and "Traceback" in str(crashed[0]["exc"])
    assert relay.metric("service_worker_restarts_total", {"worker": "relay"}) == 2
    assert relay.metric("outbox_rows_released_total") == 10, "the batch released twice"
    # Two crashed claims kept their attempt (no refund), the third delivered.
    assert {r.attempts for r in rows(engine, outbox)} == {3}


def test_a_relay_that_crashes_on_every_batch_is_not_ready_and_does_not_exit_clean(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """A loop that crashes on every batch (a row it cannot handle): after three
    crashes in a row readiness answers 503 naming the worker and the error's
    class, and the exit record says ``crash-loop`` with exit code 1, not ``clean``."""
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x")])

    def fault(batch: Batch) -> None:
        raise Boom("this batch again")

    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap), on_batch=fault)
        ready = relay.relay.health.url + "/healthz/ready"
        assert http_get(ready)[0] == 200, "one crash is not a crash loop"
        wait_for(lambda: relay.relay.supervisor.crashes >= 3, timeout=30, what="three crashes")
        status, body = http_get(ready)
        assert status == 503, body
        assert isinstance(body, dict) and body["state"] == "running"
        (loop,) = body["crash_loop"]
        assert loop["worker"] == "relay" and loop["error"] == "Boom"
        assert loop["consecutive_crashes"] >= 3
        assert relay.stop() == EXIT_FAILURE
    assert logs.events("worker-crash-loop")[0]["worker"] == "relay"
    exit_line = logs.events("relay-exit")[0]
    assert exit_line["result"] == "crash-loop" and exit_line["exit_code"] == EXIT_FAILURE
    assert exit_line["level"] == "ERROR"
    assert [c["worker"] for c in exit_line["crash_loop"]] == ["relay"]
    assert status_counts(engine, outbox) == {"retryable": 1}


def test_exception_during_drain_is_not_restarted_and_rows_are_released(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
) -> None:
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(5)])
    codes, logs = _run_crashing_once_draining(db_url, kafka_bootstrap)
    assert codes == [EXIT_FAILURE]
    assert logs.events("worker-crashed-during-drain")
    assert not logs.events("worker-crashed"), "never restarted once draining"
    exit_line = logs.events("relay-exit")[0]
    assert exit_line["result"] == "error" and exit_line["unknown"] == 5
    assert exit_line["batch_size"] == 5 and exit_line["left_leased"] == 0
    assert status_counts(engine, outbox) == {"retryable": 5}
    assert {r.attempts for r in rows(engine, outbox)} == {1}, "released without refund"


def test_a_counting_failure_inside_a_salvage_is_not_reported_as_rows_left_leased(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bug inside the first batch makes the relay salvage it: the rows are
    # released (committed), then counting them raises. The log said
    # "batch-salvage-failed ... rows stay leased until their lease expires", which
    # sends an operator after rows that are in fact released.
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(5)])
    crashes = iter([Boom("first")])
    account = Pipeline._account
    counted: list[int] = []

    def fault(batch: Batch) -> None:
        exc = next(crashes, None)
        if exc is not None:
            raise exc

    def fail_first_count(self: Pipeline, batch: Batch, decisions: Any, result: Any) -> None:
        if not counted:
            counted.append(len(batch))
            raise RuntimeError("injected fault counting a salvaged batch")
        account(self, batch, decisions, result)

    monkeypatch.setattr(Pipeline, "_account", fail_first_count)
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap), on_batch=fault)
        wait_for(lambda: status_counts(engine, outbox) == {"delivered": 5}, timeout=20, what="rows")
        assert relay.stop() == 0
    assert counted == [5]
    assert not logs.events("batch-salvage-failed"), "the salvage's write committed"
    [failed] = logs.events("batch-count-failed")
    assert failed["rows"] == 5 and "injected fault" in str(failed["error"])
    assert "written" in str(failed["effect"])
    assert relay.metric("service_worker_restarts_total", {"worker": "relay"}) == 1
    assert relay.metric("outbox_lease_lost_total") == 0
    # The crashed claim kept its attempt (no refund), the second delivered.
    assert {r.attempts for r in rows(engine, outbox)} == {2}


def test_a_counting_failure_during_the_drain_keeps_the_batch_in_the_exit_record(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bug inside the batch in flight when the drain began: the salvage releases
    # its rows, then counting them for the metrics raises. The exit record was
    # added at the end of that counting, so `relay-exit` said batch_size 0 and
    # unknown 0 for a drain that released 5 rows.
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(5)])

    def count_fails(*_args: Any) -> None:
        raise RuntimeError("injected fault counting a salvaged batch")

    monkeypatch.setattr(accounting, "count_outcomes", count_fails)
    codes, logs = _run_crashing_once_draining(db_url, kafka_bootstrap)
    assert codes == [EXIT_FAILURE]
    [failed] = logs.events("batch-count-failed")
    assert failed["rows"] == 5 and "injected fault" in str(failed["error"])
    [exit_line] = logs.events("relay-exit")
    assert exit_line["batch_size"] == 5, exit_line
    assert exit_line["unknown"] == 5 and exit_line["left_leased"] == 0
    assert status_counts(engine, outbox) == {"retryable": 5}


def _run_crashing_once_draining(db_url: str, kafka_bootstrap: str) -> tuple[list[int], Any]:
    """Run a relay whose first batch begins the drain and then raises (a bug while
    draining): its exit codes (one, or none if it hung for 30 s) and its JSON logs."""
    holder: list[Relay] = []

    def drain_then_crash(batch: Batch) -> None:
        holder[0].stop()
        raise Boom("while draining")

    relay = Relay(fast_settings(db_url, kafka_bootstrap), on_batch=drain_then_crash)
    holder.append(relay)
    codes: list[int] = []
    with capture_json_logs(level="INFO") as logs:
        thread = threading.Thread(target=lambda: codes.append(relay.run()))
        thread.start()
        thread.join(30)
    return codes, logs
