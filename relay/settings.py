"""Relay settings: one frozen dataclass, filled from ``--flags`` and ``OUTBOXKIT_*``.

Every field ``x_y`` is the flag ``--x-y`` and the variable ``OUTBOXKIT_X_Y``
(see :mod:`outboxkit.runtime.settings`). Durations are seconds, fractions and
``500ms``/``2s``/``1m`` allowed. :meth:`RelaySettings.validate` holds the
cross-field rules; a violation exits with code 2 and names the settings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from outboxkit.runtime.kafkaconf import RELAY_GUARDED, guarded_problems, librdkafka_problem
from outboxkit.runtime.parse import parse_retention
from outboxkit.runtime.settings import (
    RuntimeSettings,
    at_least_one,
    at_most,
    connect_timeout_problem,
    invalid,
    is_postgresql_url,
    missing,
    non_negative,
    positive,
    retry_backoff_problem,
    setting,
    valid_relay_database_url,
)
from outboxkit.schema.table import DEFAULT_TABLE, identifier_problem

#: ``--binlog-row-image``: ``server`` changes nothing; the others are set on each
#: of the relay's own MySQL/MariaDB sessions (relay/engine.py).
ROW_IMAGES = ("server", "noblob", "minimal")

__all__ = [
    "COMPRESSION_CODECS",
    "DEFAULT_BATCH_MAX_BYTES",
    "FAILED_ROWS",
    "MAX_PAUSE_S",
    "SHARD_OWNERSHIPS",
    "RelaySettings",
]

COMPRESSION_CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
#: What a ``failed`` row does to its key's later rows (``--failed-rows``, docs/relay.md):
#: ``hold`` keeps per-key order (they wait until it is requeued or discarded);
#: ``skip`` trades that order for progress (they are delivered past it).
FAILED_ROWS = ("hold", "skip")
#: How shards are shared between relays (docs/scaling.md, docs/postgresql.md).
SHARD_OWNERSHIPS = ("auto", "redis", "advisory", "all")

#: The claim's byte budget (``--batch-max-bytes``): far above a batch of ordinary
#: events (500 x 1 KB), and with the rest of a relay's memory under the shipped
#: pods' 256 Mi limit (docs/operations.md, "Memory").
DEFAULT_BATCH_MAX_BYTES = 16 * 1024 * 1024
#: librdkafka's default ``message.max.bytes`` (the writer's own default limit).
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000

#: Longest pause between purge batches: a longer one holds a purge for hours.
MAX_PAUSE_S = 60.0
#: librdkafka's own default (300 s) would outlive any sensible lease.
DEFAULT_MESSAGE_TIMEOUT_MS = 30_000
#: librdkafka's range for message.timeout.ms (0 means "no timeout" and is refused).
MAX_MESSAGE_TIMEOUT_MS = 2_147_483_647
#: librdkafka's largest ``socket.timeout.ms``.
MAX_SOCKET_TIMEOUT_MS = 300_000
#: Two names of one librdkafka property; the one set last wins inside librdkafka.
MESSAGE_TIMEOUT_NAMES = ("message.timeout.ms", "delivery.timeout.ms")
_MILLISECONDS = re.compile(r"[0-9]{1,10}", re.ASCII)
_KAFKA_CONFIG = "--kafka-config / OUTBOXKIT_KAFKA_CONFIG"


def effective_message_timeout_ms(kafka_config: Mapping[str, str]) -> int:
    """The producer's message timeout, read from either of its two names.

    Raises ``ValueError`` naming the property when a value is not a positive
    integer of milliseconds (``0`` is librdkafka's "no timeout": a row still
    queued in the producer could then be sent after its lease was released), or
    when both names are set to different values.
    """
    found: dict[str, int] = {}
    for name in MESSAGE_TIMEOUT_NAMES:
        raw = kafka_config.get(name)
        if raw is None:
            continue
        text = raw.strip()
        if not _MILLISECONDS.fullmatch(text) or int(text) > MAX_MESSAGE_TIMEOUT_MS:
            raise ValueError(
                f"{name} must be an integer of milliseconds between 1 and "
                f"{MAX_MESSAGE_TIMEOUT_MS} (got {raw!r})"
            )
        value = int(text)
        if value == 0:
            raise ValueError(
                f"{name}=0 means no timeout in librdkafka: rows still queued in the producer "
                "could be released and sent twice; give a bound in milliseconds"
            )
        found[name] = value
    if len(set(found.values())) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in found.items())
        raise ValueError(
            f"{shown}: delivery.timeout.ms is librdkafka's alias of message.timeout.ms; "
            "set one of them (or both to the same value)"
        )
    return next(iter(found.values()), DEFAULT_MESSAGE_TIMEOUT_MS)


def _kafka_ms(kafka_config: Mapping[str, str], name: str) -> int | None:
    """An integer property of ``kafka_config`` in ms; None when unset or not an
    integer (librdkafka's own check reports that)."""
    raw = kafka_config.get(name, "").strip()
    return int(raw) if _MILLISECONDS.fullmatch(raw) else None


def default_socket_timeout_ms(message_timeout_ms: int) -> int:
    """``socket.timeout.ms`` unless set: a quarter of the message timeout (the
    ratio of the Java producer's request and delivery timeouts, 30 s and 120 s),
    at least 5 s where half the message timeout allows it; never above half of
    it, so a request given up on a hung leader is sent once more, to the
    partition's new leader, before the message times out. librdkafka's own
    default (60 s) exceeds the relay's message timeout: a hung leader then
    held the whole batch for the message timeout."""
    half = message_timeout_ms // 2
    return max(10, min(half, max(message_timeout_ms // 4, 5000), MAX_SOCKET_TIMEOUT_MS))


def default_request_timeout_ms(socket_timeout_ms: int) -> int:
    """``request.timeout.ms`` unless set (the broker's wait for the in-sync
    replicas' acks): two thirds of the socket timeout, so the broker answers
    (``REQUEST_TIMED_OUT``, retried) before the client gives the request up."""
    return max(1, socket_timeout_ms * 2 // 3)


def _pause(value: float) -> str | None:
    return non_negative(value) or at_most(MAX_PAUSE_S)(value)


def _positive_or_unset(value: float | None) -> str | None:
    return None if value is None else positive(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelaySettings(RuntimeSettings):
    """Everything ``outboxkit relay`` can be told; see ``docs/relay.md``."""

    service: str = setting("outboxkit-relay", help="service name in logs, metrics, exit record")
    db_url: str | None = setting(
        None,
        help="SQLAlchemy database URL: MySQL/MariaDB, e.g. "
        "mysql+pymysql://user:password@host:3306/db, or PostgreSQL, e.g. "
        "postgresql+psycopg://user:password@host:5432/db",
        validate=valid_relay_database_url,
    )
    table: str = setting(DEFAULT_TABLE, help="outbox table to relay", validate=identifier_problem)
    batch_size: int = setting(500, help="rows claimed per batch", validate=at_least_one)
    batch_max_bytes: int = setting(
        DEFAULT_BATCH_MAX_BYTES,
        help="bytes of payloads and headers a claim loads at most (fewer rows then); a "
        "bigger row goes alone, one whose payload is over the producer's message.max.bytes "
        "fails without being loaded (docs/relay.md, big rows)",
        validate=at_least_one,
    )
    poll_interval: float = setting(
        1.0,
        help="seconds to wait before claiming again when nothing was due; with the pipeline, "
        "also how often a claim beside a leased batch looks for expired leases",
        validate=positive,
    )
    lease_ttl: float = setting(
        60.0,
        help="seconds a claimed row stays leased to this relay; after that another relay "
        "may reclaim it",
        validate=positive,
    )
    flush_timeout: float = setting(
        10.0,
        help="drain: seconds to wait for the delivery reports of the batch in flight "
        "(outbox_flush_timeout) before releasing the rest",
        validate=non_negative,
    )
    batch_deadline: float | None = setting(
        None,
        help="seconds to wait for the delivery reports of one batch; rows without a report "
        "by then are released",
        default_help="message.timeout.ms + 2 s",
        validate=_positive_or_unset,
    )
    pipeline: bool | None = setting(
        None,
        help="overlap the round trips of two batches: claim the next batch while the "
        "current one's delivery reports are awaited and its outcomes written on a "
        "second connection (docs/relay.md)",
        default_help="on with PostgreSQL, off with MySQL/MariaDB",
    )
    max_attempts: int = setting(
        10, help="claims of a row before a retriable error marks it failed", validate=at_least_one
    )
    retry_backoff_base: float = setting(
        0.5,
        help="window of a retryable row's first retry in seconds (full jitter); the "
        "consumer's setting of this name spaces a handler's retries",
        validate=positive,
        aliases=("backoff_base",),
    )
    retry_backoff_cap: float = setting(
        300.0,
        help="largest window of a retryable row's retry in seconds",
        validate=positive,
        aliases=("backoff_cap",),
    )
    failed_rows: str = setting(
        "hold",
        help="what a failed row does to its key's later rows: hold keeps per-key order (they "
        "wait until the failed row is requeued or discarded; outbox_keys_held_by_failed "
        "counts the keys); skip delivers them past it, giving up that key's order for "
        "progress (docs/relay.md)",
        choices=FAILED_ROWS,
    )
    paused_topic_retry: float = setting(
        30.0,
        help="seconds between probes of a topic paused for a relay configuration fault "
        "(unknown topic, authorization, authentication)",
        validate=positive,
    )
    delete_on_deliver: bool = setting(
        False, help="delete rows once Kafka acknowledged them instead of marking them delivered"
    )
    binlog_row_image: str = setting(
        "server",
        help="MySQL/MariaDB: the row images the relay's own sessions write to the binary "
        "log. server keeps the server's binlog_row_image; noblob leaves out the payload "
        "and headers a status change does not touch; minimal logs the primary key and "
        "the changed columns. Needs BINLOG ADMIN (MariaDB) or SESSION_VARIABLES_ADMIN "
        "(MySQL 8) (docs/relay.md)",
        choices=ROW_IMAGES,
    )
    compression: str = setting(
        "lz4", help="Kafka compression codec (compression.type)", choices=COMPRESSION_CODECS
    )
    start_jitter: float = setting(
        1.0,
        help="up to this many seconds of random delay before the first claim, so relays "
        "started together spread out",
        validate=non_negative,
    )
    metrics_interval: float = setting(
        15.0,
        help="seconds between samples of the backlog gauges (one cheap query per status)",
        validate=positive,
    )
    progress_interval: float = setting(
        60.0,
        help="seconds between relay-progress log lines (delivered, failed, retrying since "
        "the last line, and the backlog), written only when rows moved or wait; taken "
        "with the backlog sample, so at most as often as metrics-interval; 0 = never",
        validate=non_negative,
    )
    connect_timeout: float = setting(
        10.0,
        help="seconds to reach the database and Kafka at start before exiting with code 3",
        validate=connect_timeout_problem,
    )
    # Retention (docs/admin.md): the same purge as `outboxkit admin purge`, off the hot path.
    retention: float | None = setting(
        None,
        help="delete delivered rows older than this (e.g. 7d, 12h) in a background worker; "
        "never during shutdown; one relay per table at a time",
        parse=parse_retention,
        default_help="off: keep delivered rows (purge with `outboxkit admin purge`)",
    )
    retention_interval: float = setting(
        3600.0, help="seconds between retention runs (e.g. 1h)", parse=parse_retention
    )
    retention_batch_size: int = setting(
        1000, help="rows deleted per retention transaction", validate=at_least_one
    )
    retention_pause: float = setting(
        0.2,
        help="seconds of pause between retention batches, so the service's writes keep flowing "
        "(at most 60 s)",
        validate=_pause,
    )
    # Several relays: shard leases and wake-up hints in Redis (--redis-url); docs/scaling.md.
    redis_prefix: str = setting(
        "", help="prefix of every Redis key and channel (a {hash tag} for Redis Cluster)"
    )
    shard_lease_ttl: float = setting(
        45.0,
        help="with --redis-url: TTL of a shard lease in Redis; a dead relay's shards are taken "
        "over after it; must exceed 2 x --shard-renew-interval + the batch deadline + 1 s",
        validate=positive,
    )
    shard_renew_interval: float = setting(
        5.0, help="with --redis-url: seconds between shard lease renewals", validate=positive
    )
    wakeups: bool = setting(
        True,
        help="claim as soon as a writer's wake-up arrives instead of waiting for "
        "--poll-interval: NOTIFY on PostgreSQL, Redis hints with --redis-url on MySQL/MariaDB",
    )
    shard_ownership: str = setting(
        "auto",
        help="how relays share the shards: redis (leases, needs --redis-url), advisory "
        "(PostgreSQL session advisory locks), all (this relay claims every shard); auto = "
        "redis with --redis-url, else advisory on PostgreSQL, else all",
        choices=SHARD_OWNERSHIPS,
    )
    #: Former keyword names of ``retry_backoff_base``/``retry_backoff_cap``, still
    #: taken by the constructor (not readable as attributes: read the new names).
    backoff_base: dataclasses.InitVar[float | None] = None
    backoff_cap: dataclasses.InitVar[float | None] = None

    def __post_init__(self, backoff_base: float | None, backoff_cap: float | None) -> None:
        for new, value in (
            ("retry_backoff_base", backoff_base),
            ("retry_backoff_cap", backoff_cap),
        ):
            if value is not None:
                object.__setattr__(self, new, value)

    def failed_rows_hold(self) -> bool:
        """Whether a ``failed`` row holds its key's later rows (``--failed-rows hold``)."""
        return self.failed_rows == "hold"

    def effective_shard_ownership(self) -> str:
        """``redis``, ``advisory`` or ``all``: what ``--shard-ownership`` means here."""
        if self.shard_ownership != "auto":
            return self.shard_ownership
        if self.redis_url:
            return "redis"
        return "advisory" if self.db_url and is_postgresql_url(self.db_url) else "all"

    def effective_pipeline(self, dialect: str) -> bool:
        """Whether the relay overlaps two batches on a database of ``dialect``
        (SQLAlchemy's dialect name). Unset means on with PostgreSQL, where the
        pipeline moved 1.3-1.7 x the rows of one relay for the same database CPU,
        and off with MySQL/MariaDB, where it gained 1.04-1.26 x with one relay and
        lost a little with several (docs/relay.md, "the pipeline")."""
        if self.pipeline is not None:
            return self.pipeline
        return dialect == "postgresql"

    def wakeup_source(self) -> str:
        """``notify`` (PostgreSQL, even with --redis-url: sent at commit, never for a
        rollback), ``redis`` (hints, MySQL/MariaDB with --redis-url) or ``poll``."""
        if not self.wakeups:
            return "poll"
        if self.db_url and is_postgresql_url(self.db_url):
            return "notify"
        return "redis" if self.redis_url else "poll"

    def message_timeout_ms(self) -> int:
        """The producer's message timeout (``message.timeout.ms`` or its alias
        ``delivery.timeout.ms``); every derived budget is computed from it."""
        return effective_message_timeout_ms(self.kafka_config)

    def socket_timeout_ms(self) -> int:
        """The producer's ``socket.timeout.ms``: set, or derived from the message
        timeout (:func:`default_socket_timeout_ms`)."""
        return _kafka_ms(self.kafka_config, "socket.timeout.ms") or default_socket_timeout_ms(
            self.message_timeout_ms()
        )

    def request_timeout_ms(self) -> int:
        """The producer's ``request.timeout.ms``: set, or derived from the socket
        timeout (:func:`default_request_timeout_ms`)."""
        return _kafka_ms(self.kafka_config, "request.timeout.ms") or default_request_timeout_ms(
            self.socket_timeout_ms()
        )

    def max_message_bytes(self) -> int:
        """The producer's ``message.max.bytes`` (``--kafka-config``, else librdkafka's
        default): no record larger than this is ever sent."""
        raw = self.kafka_config.get("message.max.bytes", "")
        try:
            return int(raw.strip())
        except ValueError:  # unset (or refused by validate, with librdkafka's words)
            return DEFAULT_MAX_MESSAGE_BYTES

    def effective_batch_deadline(self) -> float:
        if self.batch_deadline is not None:
            return self.batch_deadline
        return self.message_timeout_ms() / 1000 + 2.0

    def shard_batch_budget(self) -> float:
        """Longest a claimed batch stays unsettled: its deadline plus time to finalize."""
        return self.effective_batch_deadline() + 1.0

    def validate(self) -> list[str]:
        problems = list(super().validate())
        if not self.db_url:
            problems.append(missing("db_url", ": required by the relay"))
        if not self.kafka_bootstrap and "bootstrap.servers" not in self.kafka_config:
            problems.append(missing("kafka_bootstrap", ": required by the relay"))
        problems.extend(self._ownership_problems())
        if self.binlog_row_image != "server" and self.db_url and is_postgresql_url(self.db_url):
            problems.append(
                invalid(
                    "binlog_row_image",
                    "MySQL/MariaDB only: PostgreSQL has no binary log (leave it at server)",
                )
            )
        problems.extend(guarded_problems(self.kafka_config, RELAY_GUARDED))
        rejected = librdkafka_problem(self.kafka_config, "producer")
        if rejected:
            problems.append(rejected)
        try:
            timeout_ms = self.message_timeout_ms()
        except ValueError as exc:
            problems.append(f"invalid {_KAFKA_CONFIG}: {exc}")
            return problems
        problems.extend(self._request_timeout_problems(timeout_ms))
        backoff = retry_backoff_problem(self.retry_backoff_base, self.retry_backoff_cap)
        if backoff:
            problems.append(backoff)
        deadline = self.effective_batch_deadline()
        if deadline * 1000 < timeout_ms:
            problems.append(
                invalid(
                    "batch_deadline",
                    f"must be >= message.timeout.ms ({deadline} s < {timeout_ms} ms), or rows "
                    "still queued in the producer would be released and sent twice",
                )
            )
        # A batch must always be finalized or released while its lease still holds,
        # or another relay could reclaim rows whose outcome this one still awaits.
        if self.lease_ttl <= deadline + self.flush_timeout:
            problems.append(
                invalid(
                    "lease_ttl",
                    "must exceed the batch deadline "
                    "(--batch-deadline, default message.timeout.ms + 2 s) plus --flush-timeout "
                    f"({self.lease_ttl} <= {deadline} + {self.flush_timeout})",
                )
            )
        # A relay that cannot renew must stop claiming a batch's budget before its shard
        # lease can expire, and still have a renewal in between (docs/scaling.md).
        budget = self.shard_batch_budget()
        if self.redis_url and self.shard_lease_ttl <= 2 * self.shard_renew_interval + budget:
            problems.append(
                invalid(
                    "shard_lease_ttl",
                    "must exceed 2 x --shard-renew-interval plus the batch deadline + 1 s "
                    f"({self.shard_lease_ttl} <= 2 x {self.shard_renew_interval} + {budget})",
                )
            )
        if self.flush_timeout >= self.shutdown_timeout:
            problems.append(
                invalid(
                    "flush_timeout",
                    f"must be below --shutdown-timeout ({self.flush_timeout} >= "
                    f"{self.shutdown_timeout}), "
                    "or every drain with a batch in flight would end in a forced exit",
                )
            )
        return problems

    def _request_timeout_problems(self, timeout_ms: int) -> list[str]:
        """A request to a hung leader must be given up well before its messages
        time out (docs/relay.md, "A hung partition leader")."""
        problems: list[str] = []
        set_socket = _kafka_ms(self.kafka_config, "socket.timeout.ms") is not None
        set_request = _kafka_ms(self.kafka_config, "request.timeout.ms") is not None
        socket_ms = self.socket_timeout_ms()
        if set_socket and socket_ms > timeout_ms // 2:
            problems.append(
                f"invalid {_KAFKA_CONFIG}: socket.timeout.ms must be at most half of "
                f"message.timeout.ms ({socket_ms} > {timeout_ms} / 2): a produce request "
                "to a hung leader would hold the whole batch until its messages time out"
            )
        request_ms = self.request_timeout_ms()
        if (set_socket or set_request) and request_ms >= socket_ms:
            problems.append(
                f"invalid {_KAFKA_CONFIG}: request.timeout.ms must be below "
                f"socket.timeout.ms ({request_ms} >= {socket_ms}): the broker's answer to a "
                "slow replication would come after the relay gave the request up"
            )
        return problems

    def _ownership_problems(self) -> list[str]:
        if self.shard_ownership == "redis" and not self.redis_url:
            return [
                invalid("shard_ownership", "redis leases need --redis-url / OUTBOXKIT_REDIS_URL")
            ]
        if (
            self.shard_ownership == "advisory"
            and self.db_url
            and not is_postgresql_url(self.db_url)
        ):
            return [
                invalid(
                    "shard_ownership",
                    "advisory locks need PostgreSQL (the database is not); use redis "
                    "(with --redis-url) or all",
                )
            ]
        return []
