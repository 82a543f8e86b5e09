"""Relay metrics (names are a contract: alert rules use them) and the backlog sampler.

Counters move when a batch is finalized; the backlog gauges are sampled from
the database every ``metrics_interval`` seconds with one index-only query per
status, never per batch and never over ``delivered`` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy.engine import Connection

from outboxkit.relay._dbtime import micros_between, time_ahead
from outboxkit.relay.claim_sql import invalid_status, key_probe, key_rows, sql_int
from outboxkit.schema.table import MYSQL_DIALECTS, Status, db_now, outbox_table

__all__ = [
    "BACKLOG_STATUSES",
    "RelayMetrics",
    "counter_value",
    "keys_held_by_failed_query",
    "ordering_blocked_query",
    "sample_backlog",
    "sample_keys_held_by_failed",
    "sample_ordering_blocked",
    "topics_with_rows",
]

#: ``delivered`` is history, not backlog; counting it would grow without bound.
BACKLOG_STATUSES = (Status.PENDING, Status.RETRYABLE, Status.DELIVERING, Status.FAILED)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
_BATCH_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


def counter_value(counter: Counter) -> float:
    """A counter's value (the ``_total`` sample of its only series)."""
    return sum(
        s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")
    )


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=registry)

        self.claimed = counter("outbox_rows_claimed", "Rows leased by this relay")
        self.delivered = counter("outbox_rows_delivered", "Rows acknowledged by Kafka")
        self.retryable = counter(
            "outbox_rows_retryable", "Rows set back to retryable after a retriable Kafka error"
        )
        self.failed = counter("outbox_rows_failed", "Rows marked failed (need a manual requeue)")
        self.released = counter(
            "outbox_rows_released",
            "Rows given back without an outcome (drain, deadline, crash) or held back for order",
        )
        self.reclaimed = counter(
            "outbox_rows_reclaimed", "Rows taken over from an expired lease of another relay"
        )
        self.acked_out_of_order = counter(
            "outbox_rows_acked_out_of_order",
            "Rows Kafka acknowledged although an earlier row of the same key failed to send "
            "in the same batch (a message timeout): that event is in the partition ahead of "
            "the earlier one",
        )
        self.shard_out_of_range = counter(
            "outbox_rows_shard_out_of_range",
            "Rows claimed whose stored shard was outside the table's shard range (written by "
            "another writer); claimed under the shard of their key's hash",
        )
        self.lease_lost = counter(
            "outbox_lease_lost", "Finalize/release skipped: the row's lease was no longer ours"
        )
        self.batch_size = Histogram(
            "outbox_batch_size", "Rows per claimed batch", buckets=_BATCH_BUCKETS, registry=registry
        )
        self.publish_latency = Histogram(
            "outbox_publish_latency_seconds",
            "From created_at to Kafka's acknowledgement, on the database clock",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.backlog = Gauge(
            "outbox_backlog_rows", "Rows per status (sampled)", ["status"], registry=registry
        )
        self.oldest_pending_age = Gauge(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending or retryable row (sampled)",
            registry=registry,
        )
        self.topic_paused = Gauge(
            "outbox_topic_paused",
            "1 while a topic is paused for a relay configuration fault",
            ["topic", "reason"],
            registry=registry,
        )
        self.shutdown_pending = Gauge(
            "outbox_shutdown_pending",
            "Rows this relay held when it stopped (wait for lease expiry); live while draining",
            registry=registry,
        )
        self.ordering_blocked = Gauge(
            "outbox_ordering_blocked_rows",
            "Waiting rows held back for an earlier, undelivered row of the same key (sampled)",
            registry=registry,
        )
        self.keys_held_by_failed = Gauge(
            "outbox_keys_held_by_failed",
            "Keys whose later rows wait behind a failed row of the key (sampled; always 0 "
            "with --failed-rows skip): requeue or discard the failed rows to release them",
            registry=registry,
        )
        self.producer_fatal = Counter(
            "outbox_kafka_producer_fatal",
            "Fatal errors of the Kafka producer (it can send nothing more; a new one is built)",
            ["reason"],
            registry=registry,
        )
        self.producer_rebuilds = Counter(
            "outbox_kafka_producer_rebuilds",
            "Kafka producers built to replace one that hit a fatal error",
            registry=registry,
        )
        self.delivery_errors = Counter(
            "outbox_kafka_delivery_errors",
            "Rows Kafka did not acknowledge for a retriable (dependency) reason, by topic "
            "and error: message timeouts (leader change, ISR below min.insync.replicas, a "
            "broker down), NOT_ENOUGH_REPLICAS, transport errors; the rows are retried",
            ["topic", "error"],
            registry=registry,
        )
        self.shards_owned = Gauge(
            "outbox_shards_owned", "Shards this relay may claim from", registry=registry
        )

    def track_shutdown_pending(self, held: Callable[[], int]) -> None:
        self.shutdown_pending.set_function(lambda: float(held()))


def sample_backlog(conn: Connection, table: str) -> tuple[dict[Status, int], float]:
    """Rows per backlog status, and the age in seconds of the oldest due-or-waiting row.

    Each count is a range scan of one status in the ``(status, id)`` index; the
    age reads the first rows of each status by id in the same index, and takes
    the first whose ``created_at`` is a time: a zero date or an infinity
    (another writer's) has no age, and must neither fail the sample nor hide
    the backlog behind it (at most ``_AGE_PROBE`` such rows are stepped over).
    """
    t = outbox_table(table)
    counts = {
        status: int(
            conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.status == status.value)
            ).scalar_one()
        )
        for status in BACKLOG_STATUSES
    }
    oldest_us = 0.0
    for status in (Status.PENDING, Status.RETRYABLE):
        first = (
            sa.select(micros_between(t.c.created_at, db_now()))
            .where(t.c.status == status.value)
            # (status, id): served by that index alone, never by walking the
            # primary key through delivered rows (see claim_sql._status_range).
            .order_by(t.c.status, t.c.id)
            .limit(_AGE_PROBE)
        )
        # The first row in id order that has an age.
        age = next((a for (a,) in conn.execute(first) if a is not None), None)
        if age is not None:
            oldest_us = max(oldest_us, float(age))
    return counts, oldest_us / 1_000_000


#: Rows per status the backlog age looks at for one whose ``created_at`` is a time.
_AGE_PROBE = 16


def count_invalid_status(conn: Connection, table: str) -> int:
    """Rows whose status is outside the enum (MariaDB/MySQL: ``''``, see
    ``claim_sql.INVALID_STATUS``); 0 on PostgreSQL, whose enum refuses them. One
    range of the ``(status, id)`` index."""
    if conn.dialect.name not in MYSQL_DIALECTS:
        return 0
    t = outbox_table(table)
    return int(
        conn.execute(
            sa.select(sa.func.count()).select_from(t).where(invalid_status(t))
        ).scalar_one()
    )


def sample_ordering_blocked(
    conn: Connection, table: str, paused_topics: Collection[str] = (), *, failed_holds: bool = True
) -> int:
    """Waiting rows whose key has an earlier row that holds it back
    (:func:`ordering_blocked_query`)."""
    query = ordering_blocked_query(table, paused_topics, conn.dialect.name, failed_holds)
    return int(conn.execute(query).scalar_one())


def sample_keys_held_by_failed(conn: Connection, table: str) -> int:
    """Keys held back by a failed row (:func:`keys_held_by_failed_query`)."""
    return int(conn.execute(keys_held_by_failed_query(table, conn.dialect.name)).scalar_one())


def keys_held_by_failed_query(table: str, dialect: str | None = None) -> sa.Select[Any]:
    """Count the keys with a ``failed`` row that has a later row of the key still
    to send (``pending``, ``retryable`` or ``delivering``): with ``--failed-rows
    hold`` those rows wait until the failed row is requeued or discarded.

    Reads the failed rows (one range of ``(status, id)``; few, or an alert is
    firing already) and, for each, probes its key's later rows by the
    ``(message_key, status, id)`` index, one seek per status (as
    :func:`ordering_blocked_query`): never the backlog. Grouped by key first,
    MariaDB read the key index once per distinct key of the table instead."""
    failed = outbox_table(table).alias("failed_rows")
    later = outbox_table(table).alias("later")
    waiting = [
        key_probe(sql_int(1), later, table, dialect)
        .where(*key_rows(later, failed.c.message_key, status, dialect, after=failed.c.id))
        .exists()
        for status in (Status.PENDING, Status.RETRYABLE, Status.DELIVERING)
    ]
    query = sa.select(sa.func.count(sa.distinct(failed.c.message_key))).where(
        failed.c.status == Status.FAILED.value,
        failed.c.message_key.is_not(None),
        sa.or_(*waiting),
    )
    if dialect in MYSQL_DIALECTS:
        query = query.with_hint(failed, f"FORCE INDEX (ix_{table}_status_id)", dialect)
    return query


def ordering_blocked_query(
    table: str,
    paused_topics: Collection[str] = (),
    dialect: str | None = None,
    failed_holds: bool = True,
) -> sa.Select[Any]:
    """Count the waiting rows held back by an earlier row of their key.

    Starts from the blocking rows (retryable and not yet due, delivering under a
    live lease, failed with ``failed_holds``, not yet delivered in a paused
    topic) — few in a healthy system —
    and, for each blocking key, counts its later ``pending`` and ``retryable``
    rows with one probe per status through the ``(message_key, status, id)``
    index (:func:`~outboxkit.relay.claim_sql.key_probe`, as the claim does), so the
    cost follows the blockers, not the backlog. A join of blockers and waiting
    rows let PostgreSQL, on a table without statistics, read the whole backlog
    into a hash table on every sample.
    """
    t = outbox_table(table)
    now = db_now()
    blocking = [
        sa.and_(t.c.status == Status.RETRYABLE.value, time_ahead(t.c.next_attempt_at, now)),
        sa.and_(t.c.status == Status.DELIVERING.value, time_ahead(t.c.lease_expires_at, now)),
    ]
    if failed_holds:
        blocking.append(t.c.status == Status.FAILED.value)
    if paused_topics:
        blocking.append(
            sa.and_(
                t.c.topic.in_(sorted(paused_topics)),
                t.c.status.in_(
                    [Status.PENDING.value, Status.RETRYABLE.value, Status.DELIVERING.value]
                ),
            )
        )
    first = (
        sa.select(t.c.message_key, sa.func.min(t.c.id).label("first_id"))
        .where(t.c.message_key.is_not(None), sa.or_(*blocking))
        .group_by(t.c.message_key)
        .subquery("blockers")
    )
    later = outbox_table(table).alias("later")
    held = [
        key_probe(sa.func.count(), later, table, dialect)
        .where(*key_rows(later, first.c.message_key, status, dialect, after=first.c.first_id))
        .scalar_subquery()
        for status in (Status.PENDING, Status.RETRYABLE)
    ]
    return sa.select(sa.func.coalesce(sa.func.sum(held[0] + held[1]), 0)).select_from(first)


def topics_with_rows(conn: Connection, table: str, topics: Collection[str]) -> frozenset[str]:
    """Which of ``topics`` still have a row waiting or in flight.

    Only asked for paused topics (few, and rarely): a paused topic none of whose
    rows is left is resumed, or its pause would never end.
    """
    if not topics:
        return frozenset()
    t = outbox_table(table)
    waiting = [Status.PENDING.value, Status.RETRYABLE.value, Status.DELIVERING.value]
    query = (
        sa.select(t.c.topic)
        .where(t.c.status.in_(waiting), t.c.topic.in_(sorted(topics)))
        .distinct()
    )
    return frozenset(str(topic) for topic in conn.execute(query).scalars())
