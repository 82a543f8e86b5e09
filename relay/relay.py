"""The relay: claim a batch -> publish it -> finalize it, until drained.

``Relay(settings).run()`` blocks until the relay has drained and returns an
exit code. It installs no signal handlers: the CLI calls
:meth:`Relay.install_process_handlers` (signals and the forced-exit watchdog);
an application embedding the relay calls :meth:`Relay.drain` instead.

Guarantees: a row is marked ``delivered`` only after Kafka acknowledged it;
every row change after the claim is checked against the lease token; no row is
claimed once the drain began; rows without a known outcome are released on the
way out, and any row that cannot be released (database gone) is counted in the
exit record and ``outbox_shutdown_pending`` and comes back after its lease expires.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Engine

from outboxkit.errors import SchemaNotAppliedError
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.claim import Batch, claim_batch
from outboxkit.relay.drain import ExitRecord, log_exit_record, release
from outboxkit.relay.finalize import Decision, Fate, FinalizeResult, decide, exhausted, finalize
from outboxkit.relay.leases import ForeignRelayMonitor, LeaseSettings, RedisShardLeases
from outboxkit.relay.metrics import (
    RelayMetrics,
    sample_backlog,
    sample_ordering_blocked,
    topics_with_rows,
)
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.publish import FatalProducerError, InFlight, Publisher, Report
from outboxkit.relay.retention import run_retention
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import AllShards, ShardOwnership, claiming
from outboxkit.relay.wakeup import PollWaker, RedisWaker, Waker
from outboxkit.runtime import (
    EXIT_CONFIG,
    EXIT_DEPENDENCY,
    EXIT_FAILURE,
    EXIT_FORCED,
    EXIT_OK,
    ConfigError,
    DependencyError,
    ServiceRuntime,
    Supervisor,
    describe,
    log_event,
    redact,
)
from outboxkit.runtime.errors import is_infrastructure_error
from outboxkit.runtime.metrics import push_exit_metrics, push_job
from outboxkit.schema.apply import read_shard_count
from outboxkit.wakeup import wakeup_channel

__all__ = ["PUSH_JOB", "Relay"]

log = logging.getLogger("outboxkit.relay")

#: Pushgateway job of the metrics pushed at exit; grouped by ``instance=node_id``
#: (the convention of every process: outboxkit/runtime/metrics.py).
PUSH_JOB = push_job("relay")
_CLOSE_BUDGET = 5.0
#: Seconds of the shutdown budget kept for disposing the pool, the exit record and
#: the metrics push after waiting for workers.
_RECORD_RESERVE = 0.5
_FATAL_ADVICE = {
    "authorization": "grant the relay's principal WRITE on the topics it serves "
    "(or IDEMPOTENT_WRITE on the cluster for brokers before 2.8)",
    "authentication": "check the SASL/SSL settings in --kafka-config / OUTBOXKIT_KAFKA_CONFIG",
}


@dataclass
class _Held:
    """A batch whose rows are leased to us and not yet finalized or released."""

    batch: Batch
    inflight: InFlight | None = None
    #: Refund the attempt if the rows end up released (False after a crash).
    refund: bool = True


class Relay:
    """One relay process (or one embedded relay) for one outbox table.

    ``engine``: use this SQLAlchemy engine instead of building one from
    ``settings.db_url`` (it is not disposed at exit). ``ownership``: which
    shards to claim (default: all of them). ``waker``: what to wait on when idle
    (default: sleep ``poll_interval``). ``on_batch``: called with every claimed
    batch before it is published; an exception it raises is handled like any
    bug inside a batch (tests inject faults with it).
    """

    def __init__(
        self,
        settings: RelaySettings,
        *,
        engine: Engine | None = None,
        ownership: ShardOwnership | None = None,
        waker: Waker | None = None,
        on_batch: Callable[[Batch], None] | None = None,
    ) -> None:
        self.settings = settings
        rt = ServiceRuntime.build(settings, logger=log, details=self._ready_details)
        self.registry, self.service_metrics = rt.registry, rt.service_metrics
        self.lifecycle, self.supervisor, self.health = rt.lifecycle, rt.supervisor, rt.health
        self.metrics = RelayMetrics(self.registry)
        self.paused = PausedTopics(
            retry_interval=settings.paused_topic_retry, gauge=self.metrics.topic_paused
        )
        self.backoff = Backoff(base=settings.backoff_base, cap=settings.backoff_cap)
        self._engine = engine
        self._own_engine = engine is None
        self._ownership = ownership
        self._waker: Waker = waker if waker is not None else PollWaker()
        self._own_waker = waker is None
        self._foreign: ForeignRelayMonitor | None = None
        self._on_batch = on_batch
        self._publisher: Publisher | None = None
        self._producer_trouble: object | None = None
        self._held: _Held | None = None
        self._shard_count: int | None = None
        self._jittered = False
        self._next_sample = 0.0
        self._crashes_before_drain = 0
        self._retention: threading.Thread | None = None
        self._abandoned: list[str] = []
        self._open: list[str] = []
        self._exit = ExitRecord(signal=None, state="starting")
        self.metrics.track_shutdown_pending(self._shutdown_pending)
        self.lifecycle.on_drain(self._on_drain)
        self.lifecycle.on_hurry(self._on_hurry)

    # -- public API -----------------------------------------------------------

    def run(self) -> int:
        """Start, relay until drained, shut down in order; return the exit code."""
        code = self._start()
        if code is not None:
            return code
        self.lifecycle.set_running()
        self._start_retention()
        try:
            self.supervisor.run("relay", self._loop)
        except BaseException:  # KeyboardInterrupt when embedded without handlers
            self.lifecycle.drain("interrupted")
            self._stop()
            raise
        return self._stop()

    def drain(self) -> None:
        """Start the drain (what the first SIGTERM does); :meth:`run` then returns."""
        self.lifecycle.drain("api")

    def install_process_handlers(self) -> None:
        """For entry points that own the process: SIGTERM/SIGINT drain (second: hurry),
        and a watchdog forces the exit (code 4) once ``shutdown_timeout`` has passed.
        """
        self.lifecycle.install_signal_handlers()
        self.lifecycle.start_watchdog(self._cut, on_forced=self._on_forced)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the relay has not been started")
        return self._engine

    # -- the loop ---------------------------------------------------------------

    def _loop(self) -> None:
        """Claim -> publish -> finalize until the drain begins (the supervisor
        restarts this after an unexpected exception, never once draining)."""
        self._settle_leftover()
        self._start_jitter()
        while not self.lifecycle.draining.is_set():
            if self._publisher is not None and self._publisher.fatal is not None:
                self._rebuild_producer()
                continue
            self._sample_backlog_if_due()
            try:
                batch = self._claim()
            except Exception as exc:
                if not (self.lifecycle.draining.is_set() and is_infrastructure_error(exc)):
                    raise
                # The database failed the claim that was running when the drain began
                # (a redeploy during a blip): nothing is held, so this is the end of
                # the loop, not a crash. A claim whose commit went through unseen left
                # rows leased; they are reclaimed after their lease.
                log_event(
                    log,
                    "claim-interrupted",
                    level=logging.WARNING,
                    error=redact(f"{type(exc).__name__}: {exc}"),
                    effect="the drain goes on; nothing was held",
                )
                return
            if batch is None:
                self._waker.wait(self.settings.poll_interval)
            else:
                self._deliver(batch)

    def _claim(self) -> Batch | None:
        assert self._ownership is not None
        # The handshake with shard ownership: none of these shards is handed to
        # another relay until the block ends, and before it ends the claimed rows
        # are registered (self._held is what inflight_shards() reports).
        with claiming(self._ownership) as shards:
            self.metrics.shards_owned.set(len(shards))
            if not shards or self.lifecycle.draining.is_set():
                return None
            batch = claim_batch(
                self.engine,
                self.settings.table,
                owner=self.settings.node_id,
                shards=shards,
                limit=self.settings.batch_size,
                lease_ttl=self.settings.lease_ttl,
                excluded_topics=self.paused.excluded(),
                shard_count=self._shard_count,
            )
            if batch is None:
                return None
            self._held = _Held(batch)
        self.metrics.claimed.inc(len(batch))
        self.metrics.shard_out_of_range.inc(
            sum(1 for r in batch.rows if r.misplaced_shard is not None)
        )
        self.metrics.batch_size.observe(len(batch))
        self.metrics.reclaimed.inc(sum(1 for r in batch.rows if r.reclaimed_from is not None))
        return batch

    def _deliver(self, batch: Batch) -> None:
        """Publish the batch, wait for its reports, finalize. On an unexpected
        exception: finalize what is known, release the rest without refund, re-raise.
        """
        held = self._held
        assert held is not None and held.batch is batch and self._publisher is not None
        try:
            if self._on_batch is not None:
                self._on_batch(batch)
            spent = [d for d in (exhausted(r, self.settings.max_attempts) for r in batch.rows) if d]
            spent_ids = {d.row.id for d in spent}
            to_send = [r for r in batch.rows if r.id not in spent_ids]
            if self.lifecycle.draining.is_set():  # the drain began during the claim
                decisions = [Decision(r, Fate.RELEASED, refund=True) for r in to_send]
            elif to_send and time.monotonic() >= self._deadline(batch):
                # Stalled since the claim (a stopped process, a long pause): the
                # batch's budget is spent and its lease may have run out, so another
                # relay may hold these rows by now. Sending them would only make
                # duplicates; give them back (token-checked, nothing was sent).
                log_event(
                    log,
                    "batch-expired-before-publish",
                    level=logging.WARNING,
                    rows=len(to_send),
                    stalled_s=round(time.monotonic() - batch.claimed_mono, 3),
                    effect="released unsent (attempt refunded) or left to the relay "
                    "that reclaimed them",
                )
                decisions = [Decision(r, Fate.RELEASED, refund=True) for r in to_send]
            else:
                held.inflight = self._publisher.publish(to_send)
                self._publisher.wait(held.inflight, lambda: self._deadline(batch))
                decisions = decide(
                    to_send,
                    self._reports(held.inflight),
                    max_attempts=self.settings.max_attempts,
                    refund_unknown=True,
                )
            self._settle(held, [*spent, *decisions])
        except Exception:
            self._salvage(held)
            raise

    def _deadline(self, batch: Batch) -> float:
        """When to stop waiting for this batch's reports (monotonic); moves on drain/hurry."""
        if self.lifecycle.hurry.is_set():
            return 0.0
        limit = batch.claimed_mono + self.settings.effective_batch_deadline()
        started = self.lifecycle.drain_started_at
        if started is not None:
            limit = min(limit, started + self.settings.flush_timeout)
        return limit

    def _reports(self, inflight: InFlight) -> dict[int, Report]:
        assert self._publisher is not None
        return self._publisher.settle_reports(inflight)

    def _rebuild_producer(self) -> None:
        """The producer hit a fatal error (its batch is settled): build new ones,
        with exponential backoff capped at ``paused_topic_retry``, until one
        settles without a fatal error or the drain begins."""
        publisher = self._publisher
        assert publisher is not None

        def attempt() -> None:
            fatal = publisher.fatal
            if fatal is not None:
                self._producer_trouble = fatal
                self.metrics.producer_fatal.labels(reason=fatal.reason).inc()
                log_event(
                    log,
                    "kafka-producer-fatal",
                    level=logging.ERROR,
                    code=fatal.name,
                    reason=fatal.reason,
                    error=fatal.error,
                    session=publisher.sessions,
                    action="building a new producer (a new idempotent session); "
                    + _FATAL_ADVICE.get(fatal.reason, "check the broker log for the cause"),
                )
            self.metrics.producer_rebuilds.inc()
            publisher.rebuild(self.settings.connect_timeout)

        def sleep(seconds: float) -> None:
            self.lifecycle.wait_draining(seconds)  # a drain ends the wait (and the retries)

        cap = max(0.1, self.settings.paused_topic_retry)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(FatalProducerError),
            wait=tenacity.wait_exponential(multiplier=0.5, max=cap),
            stop=lambda _state: self.lifecycle.draining.is_set(),
            sleep=sleep,
            reraise=True,
        )
        try:
            retrying(attempt)
        except FatalProducerError as exc:
            if exc.fatal is not None:
                self.metrics.producer_fatal.labels(reason=exc.fatal.reason).inc()
            return  # draining: the loop ends
        self._producer_trouble = None
        log_event(log, "kafka-producer-rebuilt", session=publisher.sessions)

    def _settle(self, held: _Held, decisions: list[Decision]) -> None:
        """Write the decisions under the batch's token, then count and log them."""
        result = finalize(
            self.engine,
            self.settings.table,
            held.batch,
            decisions,
            backoff=self.backoff,
            delete_on_deliver=self.settings.delete_on_deliver,
        )
        self._held = None
        self._account(held.batch, decisions, result)

    def _salvage(self, held: _Held) -> None:
        """After an unexpected exception inside a batch: finalize known outcomes,
        release the rest **without** refund (a row that always crashes the relay
        must still reach ``failed``). Failures here leave the rows leased."""
        held.refund = False
        try:
            reports: dict[int, Report] = {}
            if held.inflight is not None and self._publisher is not None:
                self._publisher.wait(held.inflight, lambda: self._deadline(held.batch))
                reports = self._reports(held.inflight)
            decisions = decide(
                held.batch.rows,
                reports,
                max_attempts=self.settings.max_attempts,
                refund_unknown=False,
            )
            self._settle(held, decisions)
        except Exception as exc:
            log_event(
                log,
                "batch-salvage-failed",
                level=logging.ERROR,
                rows=len(held.batch),
                error=redact(f"{type(exc).__name__}: {exc}"),
                effect="rows stay leased until their lease expires",
            )

    def _settle_leftover(self) -> None:
        """Release a batch a crashed run could not settle (raises if the DB is still gone)."""
        held = self._held
        if held is None:
            return
        result = release(
            self.engine, self.settings.table, held.batch, held.batch.rows, refund=held.refund
        )
        self._held = None
        self._account(held.batch, [], result)

    def _account(self, batch: Batch, decisions: list[Decision], result: FinalizeResult) -> None:
        m = self.metrics
        m.delivered.inc(result.counts[Fate.DELIVERED])
        m.failed.inc(result.counts[Fate.FAILED])
        m.retryable.inc(result.counts[Fate.RETRYABLE] + result.counts[Fate.PAUSED])
        m.released.inc(result.counts[Fate.RELEASED])
        m.lease_lost.inc(len(result.lease_lost))
        lost = set(result.lease_lost)
        for d in decisions:
            # Reported even when the lease was lost: the copy is in the partition.
            if d.acked_ahead_of is not None:
                earlier, error = d.acked_ahead_of
                m.acked_out_of_order.inc()
                log_event(
                    log,
                    "acked-out-of-order",
                    level=logging.WARNING,
                    row_id=d.row.id,
                    event_id=d.row.event_id,
                    topic=d.row.topic,
                    partition=d.partition,
                    offset=d.offset,
                    earlier_row_id=earlier,
                    earlier_error=error,
                    note=(
                        "this event is in the partition ahead of the earlier event of its "
                        "key; it is sent again after it, so the last copies are in order"
                    ),
                )
            if d.row.id in lost:
                continue
            if d.fate is Fate.DELIVERED:
                if d.acked_mono is not None:
                    age = batch.db_time(d.acked_mono) - d.row.created_at
                    m.publish_latency.observe(max(0.0, age.total_seconds()))
                if d.row.topic in self.paused:
                    self.paused.resume(d.row.topic)
        paused: dict[str, list[Decision]] = {}
        for d in decisions:
            if d.fate is Fate.PAUSED and d.row.id not in lost:
                paused.setdefault(d.row.topic, []).append(d)
        for topic, rows in paused.items():
            self.paused.pause(
                topic, rows[0].pause_reason or "config", rows[0].error or "", len(rows)
            )
        if self.lifecycle.draining.is_set():
            self._exit.add(len(batch), result)

    # -- helpers of the loop --------------------------------------------------------

    def _start_jitter(self) -> None:
        if not self._jittered:
            self._jittered = True
            self.lifecycle.wait_draining(random.uniform(0, self.settings.start_jitter))

    def _sample_backlog_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + self.settings.metrics_interval
        paused = self.paused.paused_topics()
        try:
            with self.engine.connect() as conn:
                counts, age = sample_backlog(conn, self.settings.table)
                blocked = sample_ordering_blocked(conn, self.settings.table, paused)
                gone = paused - topics_with_rows(conn, self.settings.table, paused)
                if self._foreign is not None:
                    self._foreign.check(conn)
        except Exception as exc:  # a metrics hook never breaks the loop
            log_event(log, "backlog-sample-failed", level=logging.WARNING, error=redact(str(exc)))
            return
        for status, n in counts.items():
            self.metrics.backlog.labels(status=status.value).set(n)
        self.metrics.oldest_pending_age.set(age)
        self.metrics.ordering_blocked.set(blocked)
        for topic in sorted(gone):  # nothing left to probe with: the pause would never end
            self.paused.resume(topic, cause="no-rows-left")

    def _inflight_shards(self) -> frozenset[int]:
        held = self._held
        return held.batch.shards if held is not None else frozenset()

    def _shutdown_pending(self) -> int:
        """Rows we hold while draining/stopped; 0 while running (no false alerts)."""
        held = self._held
        if held is None or not self.lifecycle.draining.is_set():
            return 0
        return len(held.batch)

    def _ready_details(self) -> dict[str, object]:
        details: dict[str, object] = {"paused_topics": self.paused.details()}
        trouble = self._producer_trouble
        if trouble is not None:
            details["kafka_producer"] = f"rebuilding after {trouble}"
        return details

    # -- start and stop -------------------------------------------------------------

    def _start(self) -> int | None:
        """Connect to the database and Kafka and bind the health port; an exit code on failure."""
        s = self.settings
        try:
            # First, so probes get answers while the relay connects: live 200,
            # ready 503 ("starting"); a dependency that takes connect_timeout to
            # give up must not look like a dead process.
            self.health.start()
            if self._engine is None:
                self._engine = _create_engine(s)
            else:  # no gap locks in the claim; see claim.py
                self._engine = self._engine.execution_options(isolation_level="READ COMMITTED")
            self._open.append("database")
            if self.engine.dialect.name not in ("mysql", "mariadb"):
                raise ConfigError(
                    "invalid --db-url / OUTBOXKIT_DB_URL: the relay supports MySQL and "
                    f"MariaDB (got {self.engine.dialect.name})"
                )
            with self.engine.connect() as conn:
                shard_count = read_shard_count(conn, s.table)
            self._shard_count = shard_count
            self._publisher = Publisher(s)
            self._open.append("kafka-producer")
            self._publisher.check_reachable(s.connect_timeout)
            if self._ownership is None:
                self._ownership = self._default_ownership(shard_count)
            self._ownership.start(self._inflight_shards)
            self._open.append("shard-ownership")
            if self._own_waker and s.redis_url and s.wakeups:
                channel = wakeup_channel(s.table, s.redis_prefix)
                self._waker = RedisWaker(s.redis_url, channel, self.lifecycle, logger=log)
                self._open.append("redis-wakeups")
        except ConfigError as exc:
            return self._failed_start("config", EXIT_CONFIG, exc)
        except (DependencyError, SchemaNotAppliedError, sa.exc.DBAPIError) as exc:
            return self._failed_start("dependency", EXIT_DEPENDENCY, exc)
        except Exception as exc:
            if not is_infrastructure_error(exc):  # e.g. a driver's unwrapped login failure
                raise
            return self._failed_start("dependency", EXIT_DEPENDENCY, exc)
        log_event(
            log,
            "relay-started",
            table=s.table,
            shards=shard_count,
            health_port=self.health.port,
            settings=describe(s),
        )
        return None

    def _default_ownership(self, shard_count: int) -> ShardOwnership:
        """Redis shard leases when ``redis_url`` is set; else every shard, and a watch
        for a second relay on the table (which would give up per-key order)."""
        s = self.settings
        if not s.redis_url:
            self._foreign = ForeignRelayMonitor(s.table, s.node_id, log)
            return AllShards(shard_count)
        leases = RedisShardLeases(
            s.redis_url,
            table=s.table,
            node_id=s.node_id,
            shard_count=shard_count,
            settings=LeaseSettings(
                ttl=s.shard_lease_ttl,
                renew_interval=s.shard_renew_interval,
                batch_budget=s.shard_batch_budget(),
                prefix=s.redis_prefix,
            ),
            registry=self.registry,
            owned_gauge=False,  # the relay's own outbox_shards_owned counts claimable shards
            logger=log,
        )
        leases.check_reachable(s.connect_timeout)
        return leases

    def _failed_start(self, kind: str, code: int, exc: BaseException) -> int:
        error = exc.orig if isinstance(exc, sa.exc.DBAPIError) and exc.orig else exc
        log_event(
            log,
            "start-failed",
            level=logging.ERROR,
            kind=kind,
            error=redact(f"{type(error).__name__}: {error}"),
            exit_code=code,
        )
        self.lifecycle.drain("start-failed")
        self._close_resources()
        self.lifecycle.set_stopped()
        self.health.stop()
        self._exit.state = "stopped"
        self._exit.signal = self.lifecycle.signal_name
        self._exit.result = f"{kind}-error"
        self._exit.exit_code = code
        log_exit_record(self._exit)
        return code

    def _stop(self) -> int:
        """The drain, in order. Each step says why it comes where it does."""
        # 1. Rows first: the loop finalized or released its batch unless it crashed;
        #    try once more, so nothing waits for lease expiry without need.
        if self._held is not None:
            try:
                self._settle_leftover()
            except Exception as exc:
                log_event(
                    log,
                    "release-failed",
                    level=logging.ERROR,
                    rows=len(self._held.batch),
                    error=redact(f"{type(exc).__name__}: {exc}"),
                    effect="rows stay leased until their lease expires",
                )
        left = len(self._held.batch) if self._held is not None else 0
        # 2-4. Kafka (flush what is acknowledged-to-be, purge released rows' copies),
        #    then Redis (shard leases: the next owner must find our rows settled and
        #    no copy of them left in our producer), then the DB pool.
        self._close_resources()
        self.lifecycle.set_stopped()
        record = self._exit
        record.left_leased = left
        record.batch_size += left
        record.abandoned = list(self._abandoned)
        if left:
            record.result, record.exit_code = "left-leased", EXIT_DEPENDENCY
        elif self._abandoned:  # the budget ran out for a worker: not a clean exit
            record.result, record.exit_code = "forced", EXIT_FORCED
        elif self.supervisor.crashes > self._crashes_before_drain:
            record.result, record.exit_code = "error", EXIT_FAILURE
        elif self.lifecycle.exit_code() != EXIT_OK:
            record.result, record.exit_code = "fatal", self.lifecycle.exit_code()
        self._finish_record(record)
        self.health.stop()
        return record.exit_code

    def _start_retention(self) -> None:
        """Purge old delivered rows in a worker of its own (its own supervisor, so its
        crashes never count as the relay loop's), stopping at once when draining."""
        s = self.settings
        if s.retention is None:
            return
        retention_s = s.retention
        supervisor = Supervisor(self.lifecycle, logger=log, metrics=self.service_metrics)

        def loop() -> None:
            run_retention(
                self.engine,
                table=s.table,
                retention_s=retention_s,
                interval_s=s.retention_interval,
                stop=self.lifecycle.draining.is_set,
                batch_size=s.retention_batch_size,
                pause_s=s.retention_pause,
                node_id=s.node_id,
            )

        # A daemon thread: a statement stalled on a frozen database must not keep
        # the process alive after the drain gave up on it (see _join_retention).
        self._retention = threading.Thread(
            target=supervisor.run, args=("retention", loop), name="retention", daemon=True
        )
        self._retention.start()

    def _join_retention(self) -> None:
        """Wait for retention to stop (it checks the drain between batches) while the
        shutdown budget lasts; past that it is abandoned, and the exit record says so."""
        thread = self._retention
        if thread is None:
            return
        thread.join(timeout=max(0.0, self.lifecycle.remaining() - _RECORD_RESERVE))
        if thread.is_alive():
            what = "retention (a database statement did not return)"
            self._abandoned.append(what)
            log_event(
                log,
                "worker-abandoned",
                level=logging.ERROR,
                worker="retention",
                detail=what,
                effect="the statement's transaction is rolled back by the database when "
                "the connection drops with the process",
            )

    def _close_resources(self) -> None:
        # Kafka first: once a shard lease is released, the next owner claims the
        # rows we released and sends them; a copy still in our producer's queue
        # could then land after the new owner's later events of the same key.
        if "kafka-producer" in self._open and self._publisher is not None:
            publisher = self._publisher
            budget = min(_CLOSE_BUDGET, max(0.0, self.lifecycle.remaining() - 1.0))
            self._step("kafka-producer", lambda: self._log_unsent(publisher.close(budget)))
        # Then Redis: the shard leases (the rows are settled, our copies are
        # flushed or purged), then the wake-up subscription.
        if "shard-ownership" in self._open and self._ownership is not None:
            self._step("shard-ownership", self._ownership.release_all)
            self._step("shard-ownership", self._ownership.close)
        if "redis-wakeups" in self._open and isinstance(self._waker, RedisWaker):
            self._step("redis-wakeups", self._waker.close)
        # Retention needs only the database: it stops within one batch once
        # draining; wait for it (within the budget) before the pool goes away.
        self._join_retention()
        if "database" in self._open and self._engine is not None and self._own_engine:
            self._step("database", self._engine.dispose)
        self._open.clear()

    def _step(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            log_event(
                log,
                "close-failed",
                level=logging.ERROR,
                resource=name,
                error=redact(f"{type(exc).__name__}: {exc}"),
            )

    def _log_unsent(self, unsent: int) -> None:
        if unsent:
            log_event(log, "kafka-unsent-at-close", level=logging.WARNING, messages=unsent)

    def _finish_record(self, record: ExitRecord) -> None:
        lc = self.lifecycle
        record.signal = lc.signal_name
        record.state = lc.state.value
        record.shutdown_deadline_ms = round(lc.shutdown_timeout * 1000)
        started = lc.drain_started_at
        if started is not None:
            record.duration_ms = round((time.monotonic() - started) * 1000)
        if self.settings.pushgateway_url:
            record.metrics_pushed = push_exit_metrics(
                self.settings.pushgateway_url,
                component="relay",
                node_id=self.settings.node_id,
                metrics=(self.metrics.shutdown_pending, *self.service_metrics.exit_metrics()),
                # Within what is left of the shutdown budget (the watchdog is
                # already disarmed here), but at least a moment to try.
                timeout=max(0.5, min(5.0, lc.remaining())),
            )
        log_exit_record(record)

    # -- lifecycle callbacks ------------------------------------------------------

    def _on_drain(self) -> None:
        self._crashes_before_drain = self.supervisor.crashes
        wake = getattr(self._waker, "wake", None)
        if callable(wake):
            wake()

    def _on_hurry(self) -> None:
        held = self._held
        unfinished = 0
        if held is not None:
            unfinished = held.inflight.missing() if held.inflight else len(held.batch)
        log_event(log, "drain-hurried", level=logging.WARNING, unfinished_rows=unfinished)

    def _cut(self) -> list[str]:
        """Watchdog: the drain overran shutdown_timeout; name what is being abandoned."""
        cut = list(self._open)
        retention = self._retention
        if retention is not None and retention.is_alive():
            cut.append("retention")
        held = self._held
        if held is not None:
            cut.append(f"{len(held.batch)} leased rows (back after lease expiry)")
        return cut

    def _on_forced(self) -> None:
        held = self._held
        started = self.lifecycle.drain_started_at
        if started is not None:  # set_stopped() will not run: record the duration here
            self.service_metrics.shutdown_duration.set(time.monotonic() - started)
        record = self._exit
        record.left_leased = len(held.batch) if held is not None else 0
        record.batch_size += record.left_leased
        record.abandoned = self._cut()
        record.result, record.exit_code = "forced", EXIT_FORCED
        self._finish_record(record)


def _create_engine(settings: RelaySettings) -> Engine:
    assert settings.db_url is not None
    url = sa.make_url(settings.db_url)
    connect_args: dict[str, object] = {}
    if url.get_backend_name() in ("mysql", "mariadb"):
        # A statement that outlives a lease is pointless; a hung server must not
        # hang the loop forever either.
        timeout = max(1, math.ceil(settings.lease_ttl))
        connect_args = {
            "connect_timeout": max(1, math.ceil(settings.connect_timeout)),
            "read_timeout": timeout,
            "write_timeout": timeout,
        }
    return sa.create_engine(
        url,
        pool_pre_ping=True,
        pool_size=2,
        max_overflow=2,
        isolation_level="READ COMMITTED",
        connect_args=connect_args,
    )
