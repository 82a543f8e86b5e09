"""The relay: claim a batch -> publish it -> finalize it, until drained.

``Relay(settings).run()`` blocks until the relay has drained and returns an
exit code. It installs no signal handlers unless asked: the CLI calls
:meth:`Relay.install_process_handlers` (signals and the forced-exit watchdog;
``run(handle_signals=True)`` does the same), and ``run`` removes the handlers
when it returns; an application embedding the relay calls :meth:`Relay.drain`.

Guarantees: a row is marked ``delivered`` only after Kafka acknowledged it;
every row change after the claim is checked against the lease token; no row is
claimed once the drain began; rows without a known outcome are released on the
way out, and any row that cannot be released (database gone) is counted in the
exit record and ``outbox_shutdown_pending`` and comes back after its lease expires.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Engine

from outboxkit.errors import SchemaNotAppliedError
from outboxkit.relay import accounting, drain
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.claim import Batch, claim_batch, create_engine
from outboxkit.relay.drain import ExitRecord, release
from outboxkit.relay.finalize import Decision, Fate, FinalizeResult, decide, exhausted, finalize
from outboxkit.relay.leases import ForeignRelayMonitor
from outboxkit.relay.metrics import (
    RelayMetrics,
    sample_backlog,
    sample_ordering_blocked,
    topics_with_rows,
)
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.publish import FatalProducerError, InFlight, Publisher, Report
from outboxkit.relay.retention import start_retention
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import ShardOwnership, claiming, default_ownership
from outboxkit.relay.wakeup import PollWaker, RedisWaker, Waker
from outboxkit.runtime import (
    EXIT_CONFIG,
    EXIT_DEPENDENCY,
    ConfigError,
    DependencyError,
    ServiceRuntime,
    describe,
    log_event,
    redact,
)
from outboxkit.runtime.errors import is_infrastructure_error
from outboxkit.runtime.metrics import push_job
from outboxkit.runtime.settings import invalid, warn_renamed
from outboxkit.schema.apply import read_shard_count
from outboxkit.wakeup import wakeup_channel

__all__ = ["PUSH_JOB", "Relay"]

log = logging.getLogger("outboxkit.relay")

#: Pushgateway job of the metrics pushed at exit; grouped by ``instance=node_id``
#: (the convention of every process: outboxkit/runtime/metrics.py).
PUSH_JOB = push_job("relay")
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
    #: What the salvage decided (known outcomes kept) when it could not write it.
    decisions: list[Decision] | None = None


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
        self.backoff = Backoff(base=settings.retry_backoff_base, cap=settings.retry_backoff_cap)
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
        self.lifecycle.on_drain(lambda: drain.on_drain(self))
        self.lifecycle.on_hurry(lambda: drain.on_hurry(self))

    # -- public API -----------------------------------------------------------

    def run(self, *, handle_signals: bool = False) -> int:
        """Start, relay until drained, shut down in order; return the exit code.

        ``handle_signals=True`` does for this run what :meth:`install_process_handlers`
        does; either way signal handlers are removed again when ``run`` returns.
        """
        with self.lifecycle.process_signals(
            handle_signals, cut=lambda: drain.cut(self), on_forced=lambda: drain.on_forced(self)
        ):
            return self._run()

    def _run(self) -> int:
        code = self._start()
        if code is not None:
            return code
        self.lifecycle.set_running()
        start_retention(self)
        try:
            self.supervisor.run("relay", self._loop)
        except BaseException:  # KeyboardInterrupt when embedded without handlers
            self.lifecycle.drain("interrupted")
            drain.stop(self)
            raise
        return drain.stop(self)

    def drain(self) -> None:
        """Start the drain (what the first SIGTERM does); :meth:`run` then returns."""
        self.lifecycle.drain("api")

    def install_process_handlers(self) -> None:
        """For entry points that own the process: SIGTERM/SIGINT drain (second: hurry),
        and a watchdog forces the exit (code 4) once ``shutdown_timeout`` has passed.
        """
        self.lifecycle.install_signal_handlers()
        self.lifecycle.start_watchdog(
            lambda: drain.cut(self), on_forced=lambda: drain.on_forced(self)
        )

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
                # The database failed the claim that was running when the drain began
                # (a redeploy during a blip): nothing is held, so this is the end of
                # the loop, not a crash. A claim whose commit went through unseen left
                # rows leased; they are reclaimed after their lease.
                self._end_if_interrupted(
                    exc, "claim-interrupted", "the drain goes on; nothing was held"
                )
                return
            if batch is None:
                self._waker.wait(self.settings.poll_interval)
                continue
            try:
                self._deliver(batch)
            except Exception as exc:
                # Same for the batch's finalize: the drain retries the release of
                # what is still held while its budget lasts (drain.release_leftover).
                self._end_if_interrupted(
                    exc, "batch-interrupted", "the drain releases what is still held"
                )
                return

    def _end_if_interrupted(self, exc: Exception, event: str, effect: str) -> None:
        """Re-raise ``exc`` (a crash) unless the drain has begun and a dependency
        failed: then log ``event`` and let the loop end as a clean stop."""
        if not (self.lifecycle.draining.is_set() and is_infrastructure_error(exc)):
            raise exc
        log_event(
            log,
            event,
            level=logging.WARNING,
            error=redact(f"{type(exc).__name__}: {exc}"),
            effect=effect,
        )

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
        exception: finalize what is known, release the rest (without refund unless
        a dependency failed), re-raise.
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
            elif to_send and time.monotonic() >= drain.batch_deadline(self, batch):
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
                self._publisher.wait(held.inflight, lambda: drain.batch_deadline(self, batch))
                decisions = decide(
                    to_send,
                    self._reports(held.inflight),
                    max_attempts=self.settings.max_attempts,
                    refund_unknown=True,
                )
            self._settle(held, [*spent, *decisions])
        except Exception as exc:
            self._salvage(held, refund=is_infrastructure_error(exc))
            raise

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

    def _salvage(self, held: _Held, *, refund: bool) -> None:
        """After an unexpected exception inside a batch: finalize known outcomes,
        release the rest **without** refund (a row that always crashes the relay
        must still reach ``failed``), unless a dependency failed (the database or
        Kafka went away: not the rows' fault). Failures here leave the rows
        leased; the drain tries again (``drain.release_leftover``)."""
        held.refund = refund
        try:
            reports: dict[int, Report] = {}
            if held.inflight is not None and self._publisher is not None:
                self._publisher.wait(held.inflight, lambda: drain.batch_deadline(self, held.batch))
                reports = self._reports(held.inflight)
            decisions = decide(
                held.batch.rows,
                reports,
                max_attempts=self.settings.max_attempts,
                refund_unknown=refund,
            )
            held.decisions = decisions
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
        """Settle a batch a crashed run could not settle (raises if the DB is still
        gone): the salvage's decisions when it got that far (acknowledged rows stay
        delivered, no second copy), else release every row."""
        held = self._held
        if held is None:
            return
        if held.decisions is not None:
            self._settle(held, held.decisions)
            return
        result = release(
            self.engine, self.settings.table, held.batch, held.batch.rows, refund=held.refund
        )
        self._held = None
        self._account(held.batch, [], result)

    def _account(self, batch: Batch, decisions: list[Decision], result: FinalizeResult) -> None:
        """Count a finalized batch and act on its outcomes (see relay/accounting.py)."""
        accounting.count_outcomes(self.metrics, result)
        lost = set(result.lease_lost)
        for d in decisions:
            # Reported even when the lease was lost: the copy is in the partition.
            accounting.warn_acked_out_of_order(self.metrics, d)
            if d.row.id not in lost and d.fate is Fate.DELIVERED:
                accounting.delivered(self.metrics, self.paused, batch, d)
        accounting.pause_topics(self.paused, decisions, lost)
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
                self._engine = create_engine(s)
            else:  # no gap locks in the claim; see claim.py
                self._engine = self._engine.execution_options(isolation_level="READ COMMITTED")
            self._open.append("database")
            if self.engine.dialect.name not in ("mysql", "mariadb"):
                raise ConfigError(
                    invalid(
                        "db_url",
                        f"the relay runs on MySQL/MariaDB only (got {self.engine.dialect.name})",
                    )
                )
            shard_count = self._read_shard_count()
            self._shard_count = shard_count
            self._publisher = Publisher(s)
            self._open.append("kafka-producer")
            self._publisher.check_reachable(s.connect_timeout)
            if self._ownership is None:
                self._ownership, self._foreign = default_ownership(
                    s, shard_count, registry=self.registry, logger=log
                )
            self._ownership.start(self._inflight_shards)
            self._open.append("shard-ownership")
            if self._own_waker and s.redis_url and s.wakeups:
                channel = wakeup_channel(s.table, s.redis_prefix)
                self._waker = RedisWaker(s.redis_url, channel, self.lifecycle, logger=log)
                self._open.append("redis-wakeups")
        except ConfigError as exc:
            return drain.failed_start(self, "config", EXIT_CONFIG, exc)
        except (DependencyError, SchemaNotAppliedError, sa.exc.DBAPIError) as exc:
            return drain.failed_start(self, "dependency", EXIT_DEPENDENCY, exc)
        except Exception as exc:
            if not is_infrastructure_error(exc):  # e.g. a driver's unwrapped login failure
                raise
            return drain.failed_start(self, "dependency", EXIT_DEPENDENCY, exc)
        warn_renamed(log, s)
        log_event(
            log,
            "relay-started",
            table=s.table,
            shards=shard_count,
            health_port=self.health.port,
            settings=describe(s),
        )
        return None

    def _read_shard_count(self) -> int:
        """The first database round trip, retried while the database is unreachable
        (restarting, a connection reset) for up to ``connect_timeout``, as Kafka and
        Redis are: a blip at start must not fail the pod. A SIGTERM ends the wait."""

        def read() -> int:
            with self.engine.connect() as conn:
                return read_shard_count(conn, self.settings.table)

        def sleep(seconds: float) -> None:
            self.lifecycle.wait_draining(seconds)  # a SIGTERM ends the wait

        def waiting(state: tenacity.RetryCallState) -> None:
            if state.attempt_number == 1:
                exc = state.outcome.exception() if state.outcome else None
                log_event(
                    log,
                    "database-waiting",
                    level=logging.WARNING,
                    error=redact(f"{type(exc).__name__}: {exc}"),
                    connect_timeout_s=self.settings.connect_timeout,
                )

        started = time.monotonic()
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_infrastructure_error),
            wait=tenacity.wait_exponential(multiplier=0.1, max=1.0),
            before_sleep=waiting,
            stop=lambda _state: (
                self.lifecycle.draining.is_set()
                or time.monotonic() - started >= self.settings.connect_timeout
            ),
            sleep=sleep,
            reraise=True,
        )
        return retrying(read)
