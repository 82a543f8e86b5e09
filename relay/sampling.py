"""The relay's periodic look at its table: backlog gauges, and what follows from it.

Once per ``metrics_interval`` the loop asks :class:`BacklogSampler` for one
look (one connection, a few read-only queries): the backlog by status, the age
of the oldest due row, rows held back behind an earlier row of their key, keys
held back by a failed row, rows whose status is outside the enum. The same look
resumes a paused topic that has no rows left to probe with, lets the no-Redis
monitor check for another relay, and follows the server's fingerprint across a
failover. None of it is on the claim -> publish -> finalize path: a failed look
is logged and skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.relay.foreign import ForeignRelayMonitor, OutsiderMonitor
from outboxkit.relay.metrics import (
    RelayMetrics,
    count_invalid_status,
    counter_value,
    sample_backlog,
    sample_keys_held_by_failed,
    sample_ordering_blocked,
    topics_with_rows,
)
from outboxkit.relay.ownership.redis_leases import RedisShardLeases
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import ShardOwnership
from outboxkit.runtime.identity import read_fingerprint
from outboxkit.runtime.logs import Episode, log_event, redact
from outboxkit.schema.table import Status

__all__ = ["BacklogSampler", "Progress"]

#: The relay's own logger: these are the relay's lines.
log = logging.getLogger("outboxkit.relay")


class Progress:
    """The ``relay-progress`` line: what the relay did since its last one.

    Every ``interval`` seconds (0 = never), taken with a backlog sample, one
    INFO line with the rows ``delivered``, ``failed`` and set back to
    ``retrying`` since the last line (the ``outbox_rows_*_total`` counters'
    increase) and the ``backlog`` by status as just sampled; ``since_s`` is the
    time the counts cover. Written only when a count is above 0 or rows wait
    (pending, retryable or delivering): an idle relay stays quiet.
    """

    def __init__(self, metrics: RelayMetrics, *, interval: float) -> None:
        self._metrics = metrics
        self._interval = interval
        self._last_at = time.monotonic()
        self._last = self._totals()

    def _totals(self) -> tuple[float, float, float]:
        m = self._metrics
        return counter_value(m.delivered), counter_value(m.failed), counter_value(m.retryable)

    def log_if_due(self, backlog: Mapping[Status, int], *, table: str) -> None:
        if self._interval <= 0:
            return
        now = time.monotonic()
        if now - self._last_at < self._interval:
            return
        totals = self._totals()
        delivered, failed, retrying = (
            round(t - b) for t, b in zip(totals, self._last, strict=True)
        )
        since = now - self._last_at
        self._last, self._last_at = totals, now
        waiting = {s.value: n for s, n in backlog.items() if s is not Status.FAILED}
        if not (delivered or failed or retrying or any(waiting.values())):
            return
        log_event(
            log,
            "relay-progress",
            table=table,
            since_s=round(since, 1),
            delivered=delivered,
            failed=failed,
            retrying=retrying,
            backlog={s.value: n for s, n in backlog.items()},
        )


class BacklogSampler:
    """Samples the relay's table at most once per ``metrics_interval``.

    ``foreign``: the monitor that watches for another relay without Redis (if
    any); ``fingerprint``: the server's fingerprint as read at start, which
    ``ownership`` (Redis leases) records beside its membership.
    """

    def __init__(
        self,
        settings: RelaySettings,
        engine: Engine,
        *,
        metrics: RelayMetrics,
        paused: PausedTopics,
        ownership: ShardOwnership,
        foreign: ForeignRelayMonitor | OutsiderMonitor | None,
        fingerprint: str | None,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._paused = paused
        self._ownership = ownership
        self._foreign = foreign
        self._fingerprint = fingerprint
        self._next_sample = 0.0
        self._invalid_status = Episode(log, "status-invalid", "status-invalid-gone")
        self._progress = Progress(metrics, interval=settings.progress_interval)

    def sample_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + self._settings.metrics_interval
        table = self._settings.table
        paused = self._paused.paused_topics()
        try:
            with self._engine.connect() as conn:
                counts, age = sample_backlog(conn, table)
                holds = self._settings.failed_rows_hold()
                blocked = sample_ordering_blocked(conn, table, paused, failed_holds=holds)
                held_keys = sample_keys_held_by_failed(conn, table) if holds else 0
                invalid = count_invalid_status(conn, table)
                gone = paused - topics_with_rows(conn, table, paused)
                if self._foreign is not None:
                    self._foreign.check(conn)
                self._follow_fingerprint(conn)
        except Exception as exc:  # a metrics hook never breaks the loop
            log_event(log, "backlog-sample-failed", level=logging.WARNING, error=redact(str(exc)))
            return
        for status, n in counts.items():
            self._metrics.backlog.labels(status=status.value).set(n)
        self._metrics.oldest_pending_age.set(age)
        self._metrics.ordering_blocked.set(blocked)
        self._metrics.keys_held_by_failed.set(held_keys)
        self._note_invalid_status(invalid)
        for topic in sorted(gone):  # nothing left to probe with: the pause would never end
            self._paused.resume(topic, cause="no-rows-left")
        self._progress.log_if_due(counts, table=table)

    def _note_invalid_status(self, rows: int) -> None:
        """Rows whose status is outside the enum: the gauge's ``invalid`` status,
        and one warning while there are any (they are never claimed and hold
        their keys back until requeued)."""
        self._metrics.backlog.labels(status="invalid").set(rows)
        if not rows:
            self._invalid_status.end(table=self._settings.table)
            return
        self._invalid_status.begin(
            rows,
            table=self._settings.table,
            rows=rows,
            effect="never claimed; each holds its key's later rows back",
            action="outboxkit admin status shows them; outboxkit admin requeue --id ... "
            "(or --all-failed) makes them pending; fix the writer (strict sql_mode)",
        )

    def _follow_fingerprint(self, conn: sa.Connection) -> None:
        """The server may change under the relay (a failover): what it records beside
        its membership follows, so a stale fingerprint never reports a conflict."""
        fingerprint = read_fingerprint(conn)
        if fingerprint is None or fingerprint == self._fingerprint:
            return
        self._fingerprint = fingerprint
        if isinstance(self._ownership, RedisShardLeases):
            self._ownership.fingerprint = fingerprint
