"""``ConsumerSettings``: what a consumer process is configured with.

Every field is a flag and an ``OUTBOXKIT_*`` variable (``worker_drain_timeout``
is ``--worker-drain-timeout`` / ``OUTBOXKIT_WORKER_DRAIN_TIMEOUT``); see
``outboxkit.runtime.settings``. ``topics``, ``group_id``, ``dlq_topic`` and
``concurrency`` default to the consumer class's attributes when unset.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from outboxkit.runtime.kafkaconf import CONSUMER_GUARDED, guarded_problems, librdkafka_problem
from outboxkit.runtime.settings import (
    CONSUMER_HEALTH_PORT,
    RuntimeSettings,
    at_least_one,
    at_most,
    connect_timeout_problem,
    database_backend,
    invalid,
    non_negative,
    port_number,
    positive,
    retry_backoff_problem,
    setting,
    unsupported_database,
    valid_database_url,
    where,
)
from outboxkit.schema.table import DEFAULT_INBOX_TABLE, identifier_problem

__all__ = ["ConsumerSettings", "dead_letter_problems", "is_pattern"]


#: One thread per worker: far beyond this the process runs out of threads.
MAX_CONCURRENCY = 1024
#: librdkafka's range of auto.commit.interval.ms and statistics.interval.ms (1 day).
MAX_KAFKA_INTERVAL_S = 86400.0
#: Messages in one inbox transaction at most: a group holds its rows' locks and
#: its offsets back until it commits, so a group stays short.
MAX_INBOX_BATCH = 1000


def _kafka_interval(value: float) -> str | None:
    return positive(value) or at_most(MAX_KAFKA_INTERVAL_S)(value)


def _interval_or_off(value: float) -> str | None:
    return non_negative(value) or at_most(MAX_KAFKA_INTERVAL_S)(value)


def _optional_at_least_one(value: int | None) -> str | None:
    if value is None:
        return None
    return at_least_one(value) or at_most(MAX_CONCURRENCY)(value)


def _inbox_batch(value: int) -> str | None:
    return at_least_one(value) or at_most(MAX_INBOX_BATCH)(value)


def is_pattern(topic: str) -> bool:
    """librdkafka's rule: a subscribed name that starts with ``^`` is a regex."""
    return topic.startswith("^")


def dead_letter_problems(
    topics: Sequence[str], *, dlq_topic: str | None, dlq_suffix: str, class_dlq: bool = False
) -> list[str]:
    """Why the dead-letter topics of ``topics`` would loop; empty when they cannot.

    A message is dead-lettered to ``dlq_topic``, else ``<its topic><dlq_suffix>``.
    Were that a topic this consumer reads (an empty suffix, ``--dlq-topic`` naming
    a consumed topic, ``orders`` beside ``orders.dlq``), a poison record would come
    back and fail again, one more copy each round, forever. A regex subscription
    (``^...``) needs ``dlq_topic``, and no pattern may match it: the topics a
    pattern will match are not known at start, so their ``<topic><suffix>`` names
    can be neither checked nor created in advance, and a pattern such as
    ``^orders\\..*`` matches its own derived names (``orders.eu.dlq``...).
    ``class_dlq``: ``dlq_topic`` came from the class attribute, said in the message.
    """
    problems: list[str] = []
    literal = [t for t in topics if not is_pattern(t)]
    patterns: list[tuple[str, re.Pattern[str]]] = []
    for topic in topics:
        if not is_pattern(topic):
            continue
        try:
            patterns.append((topic, re.compile(topic)))
        except re.error as exc:
            problems.append(invalid("topics", f"'{topic}' is not a regular expression: {exc}"))
    origin = " (class attribute dlq_topic)" if class_dlq else ""

    def consumed_by(name: str) -> str | None:
        if name in literal:
            return "a consumed topic"
        for text, pattern in patterns:
            if pattern.search(name):
                return f"matched by the subscribed pattern '{text}'"
        return None

    if dlq_topic:
        why = consumed_by(dlq_topic)
        if why:
            problems.append(
                invalid(
                    "dlq_topic",
                    f"'{dlq_topic}'{origin} is {why}: a dead-lettered message would be "
                    "read and fail again, forever",
                )
            )
        return problems
    if patterns:
        problems.append(
            invalid(
                "dlq_topic",
                "a regex subscription needs one dead-letter topic that no pattern matches "
                f"(the <topic>{dlq_suffix} names of the topics a pattern will match cannot "
                "be checked or created in advance)",
            )
        )
    if not dlq_suffix and literal:
        shown = ", ".join(f"'{t}'" for t in literal)
        problems.append(
            invalid(
                "dlq_suffix",
                f"must not be empty: a failed message of {shown} would be dead-lettered "
                "back into the topic it came from, and fail again, forever",
            )
        )
        return problems
    for topic in literal:
        derived = f"{topic}{dlq_suffix}"
        why = consumed_by(derived)
        if why:
            problems.append(
                invalid(
                    "dlq_suffix",
                    f"the dead-letter topic of '{topic}', '{derived}', is {why}: its "
                    "messages would be handled again by this consumer",
                )
            )
    return problems


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConsumerSettings(RuntimeSettings):
    """Settings of one consumer process (see ``docs/consumer.md``)."""

    # The drain gets worker_drain_timeout, then the commit and close get
    # close_timeout; the forced exit must come after both.
    shutdown_timeout: float = setting(
        45.0,
        help="seconds from the first signal to a forced exit (exit code 4); must exceed "
        "worker-drain-timeout + close-timeout",
        validate=positive,
    )
    # Not the relay's (8080): a relay and a consumer run side by side on one machine.
    health_port: int = setting(
        CONSUMER_HEALTH_PORT,
        help="port of the health/metrics HTTP server (0 = any free port)",
        validate=port_number,
    )
    group_id: str | None = setting(None, help="consumer group (default: the class's group_id)")
    topics: tuple[str, ...] = setting((), help="topics to consume (default: the class's topics)")
    connect_timeout: float = setting(
        10.0,
        help="seconds to reach Kafka at start before exiting with code 3 (as the relay's); "
        "at least 1",
        validate=connect_timeout_problem,
    )
    worker_drain_timeout: float = setting(
        30.0,
        help="on drain, how long in-flight handlers may run before they count as unknown",
        validate=positive,
    )
    max_attempts: int = setting(
        5,
        help="handler attempts for a transient error before dead-lettering",
        validate=at_least_one,
    )
    retry_backoff_base: float = setting(
        0.5,
        help="first retry delay of a handler in seconds (exponential, full jitter); "
        "the relay's setting of this name spaces a row's sends",
        validate=positive,
    )
    retry_backoff_cap: float = setting(
        30.0, help="longest retry delay in seconds", validate=positive
    )
    retry_max_time: float = setting(
        300.0,
        help="give up retrying (and dead-letter) once the next retry would start later than "
        "this many seconds after the first attempt",
        validate=positive,
    )
    dlq_topic: str | None = setting(
        None, help="dead-letter topic (default: the class's dlq_topic, else <topic><dlq-suffix>)"
    )
    dlq_suffix: str = setting(".dlq", help="suffix of the default dead-letter topic")
    dlq_timeout: float = setting(
        15.0,
        help="how long one dead-letter write may wait for Kafka's acknowledgement",
        validate=positive,
    )
    concurrency: int | None = setting(
        None,
        help="worker threads (at most 1024); above 1, messages of one partition run in "
        "parallel across keys, in order per key (default: the class's concurrency, else 1)",
        validate=_optional_at_least_one,
    )
    max_buffered: int = setting(
        5000,
        help="messages fetched but not finished per partition before the partition is paused",
        validate=at_least_one,
    )
    gc_freeze: bool = setting(
        True,
        help="while consuming, leave the objects that exist at start out of the garbage "
        "collector's work (gc.freeze; undone at exit; see docs/consumer.md)",
    )
    heap_trim_interval: float = setting(
        1.0,
        help="seconds between hand-backs of the C heap's free memory to the OS "
        "(glibc's malloc_trim, from the poll thread; 0: never; see docs/consumer.md)",
        validate=_interval_or_off,
    )
    commit_interval: float = setting(
        5.0,
        help="seconds between periodic commits of processed offsets (at most 1 day)",
        validate=_kafka_interval,
    )
    revoke_timeout: float = setting(
        10.0,
        help="on a rebalance, how long in-flight handlers of revoked partitions may finish "
        "before their messages are left to the next owner",
        validate=non_negative,
    )
    close_timeout: float = setting(
        10.0,
        help="bound on the final commit and leaving the group at exit",
        validate=positive,
    )
    stats_interval: float = setting(
        5.0,
        help="seconds between librdkafka statistics (consumer lag metric); 0 = off; at most 1 day",
        validate=_interval_or_off,
    )
    # Only the inbox uses the database: which ones it runs on is checked in
    # validate(), with --inbox, so a consumer without it never minds the URL's kind.
    db_url: str | None = setting(
        None,
        help="SQLAlchemy database URL of the inbox, e.g. "
        "mysql+pymysql://user:password@host:3306/db or "
        "postgresql+psycopg://user:password@host:5432/db",
        validate=valid_database_url,
    )
    inbox: bool = setting(
        False, help="run each handler in a DB transaction that records the event in the inbox"
    )
    inbox_batch: int = setting(
        1,
        help="messages of one lane handled in one inbox transaction (1 = one per "
        "transaction; at most 1000; sync handlers only; see docs/consumer.md)",
        validate=_inbox_batch,
    )
    inbox_table: str = setting(
        DEFAULT_INBOX_TABLE,
        help="inbox table (created by outboxkit schema apply)",
        validate=identifier_problem,
    )

    def max_poll_interval_ms(self) -> int:
        """``max.poll.interval.ms`` unless ``kafka_config`` sets it: the session
        timeout (librdkafka's floor for it), and at least ``revoke_timeout`` + 20 s.

        librdkafka's default is 300 s. The poll loop never waits on a handler (they
        run on workers; a revocation waits ``revoke_timeout`` at most), so the
        application's own poll interval is short. But the broker also uses this
        value as the group's **rebalance timeout**: after a broker restart, the
        group waits that long for members that will never rejoin (the ones of
        before the restart, which the consumers replaced), and no partition is
        consumed meanwhile. The chaos suite saw five-minute stalls."""
        if "max.poll.interval.ms" in self.kafka_config:
            return int(self.kafka_config["max.poll.interval.ms"])
        session = int(self.kafka_config.get("session.timeout.ms", 45_000))
        return min(86_400_000, max(session, int((self.revoke_timeout + 20) * 1000)))

    def validate(self) -> list[str]:
        problems = [*super().validate()]
        problems.extend(guarded_problems(self.kafka_config, CONSUMER_GUARDED))
        rejected = librdkafka_problem(self.kafka_config, "consumer")
        if rejected:
            problems.append(rejected)
        if self.worker_drain_timeout + self.close_timeout >= self.shutdown_timeout:
            problems.append(
                invalid(
                    "worker_drain_timeout",
                    f"worker_drain_timeout ({self.worker_drain_timeout:g}) + close_timeout "
                    f"({self.close_timeout:g}) must be < shutdown_timeout "
                    f"({self.shutdown_timeout:g})",
                )
            )
        backend = database_backend(self.db_url) if self.inbox and self.db_url else None
        unsupported = unsupported_database(backend, "the consumer inbox") if backend else None
        if unsupported:
            problems.append(invalid("db_url", unsupported))
        if self.inbox_batch > 1 and not self.inbox:
            problems.append(invalid("inbox_batch", f"above 1 needs {where('inbox')}"))
        backoff = retry_backoff_problem(self.retry_backoff_base, self.retry_backoff_cap)
        if backoff:
            problems.append(backoff)
        return problems
