"""The relay: claim a batch -> publish it -> finalize it, until drained.

``Relay(settings).run()`` blocks until the relay has drained and returns an
exit code. On the main thread it owns the process's signals for the run
(``handle_signals``, as the consumer's: SIGTERM/SIGINT drain, a watchdog forces
the exit) and removes the handlers when it returns; an application embedding
the relay on another thread calls :meth:`Relay.stop`.

Guarantees: a row is marked ``delivered`` only after Kafka acknowledged it;
every row change after the claim is checked against the lease token; no row is
claimed once the drain began; rows without a known outcome are released on the
way out, and any row that cannot be released (database gone) is counted in the
exit record and ``outbox_shutdown_pending`` and comes back after its lease expires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import random
import time
import warnings
from collections.abc import Callable

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Engine

from outboxkit._version import __version__
from outboxkit.errors import SchemaNotAppliedError
from outboxkit.relay import drain
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.conflicts import OwnershipConflicts
from outboxkit.relay.engine import check_row_image, check_session_settings, create_engine
from outboxkit.relay.foreign import ForeignRelayMonitor, OutsiderMonitor
from outboxkit.relay.metrics import RelayMetrics
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.pipeline import Pipeline
from outboxkit.relay.publish import FatalProducerError, Publisher
from outboxkit.relay.retention import start_retention
from outboxkit.relay.rows import Batch
from outboxkit.relay.sampling import BacklogSampler
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import ShardOwnership, default_ownership
from outboxkit.relay.wakeup import PollWaker, Waker, default_waker
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
from outboxkit.runtime.errors import database_unreachable, is_infrastructure_error
from outboxkit.runtime.identity import OutboxIdentity, read_fingerprint, read_identity
from outboxkit.runtime.metrics import push_job
from outboxkit.runtime.service import frozen_while_running, handles_signals
from outboxkit.runtime.settings import SERVER_DATABASES, invalid, warn_renamed
from outboxkit.schema.apply import require_claim_schema
from outboxkit.schema.meta import read_shard_count

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


class Relay:
    """One relay process (or one embedded relay) for one outbox table.

    ``engine``: use this SQLAlchemy engine instead of building one from
    ``settings.db_url`` (it is not disposed at exit). ``ownership``: which
    shards to claim (default: all of them). ``waker``: what to wait on when idle
    (default: sleep ``poll_interval``). ``on_batch``: called with every claimed
    batch before it is published; an exception it raises is handled like any
    bug inside a batch (tests inject faults with it).

    The relay is its lifecycle (start, run, drain, stop) and its loop; one turn
    of the loop is the :class:`~outboxkit.relay.pipeline.Pipeline`'s, the
    periodic look at the table the
    :class:`~outboxkit.relay.sampling.BacklogSampler`'s, and the way out
    :mod:`outboxkit.relay.drain`'s, which is handed what the relay opened
    (:class:`~outboxkit.relay.drain.Resources`) and nothing else.
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
        #: What the relay opens as it starts (the engine given here is not its
        #: own: never disposed), and what the drain closes and records.
        self._resources = drain.Resources(
            settings=settings,
            lifecycle=self.lifecycle,
            supervisor=self.supervisor,
            health=self.health,
            metrics=self.metrics,
            service_metrics=self.service_metrics,
            waker=waker if waker is not None else PollWaker(),
            outbox=settings.table,
            own_engine=engine is None,
            engine=engine,
            ownership=ownership,
        )
        self._own_waker = waker is None
        #: Which outbox this is and which server holds it, read at start; every
        #: shared name carries the identity (outboxkit.runtime.identity).
        self._identity: OutboxIdentity | None = None
        self._fingerprint: str | None = None
        self.conflicts = OwnershipConflicts(self.registry, log, outbox=settings.table)
        self._on_batch = on_batch
        self._producer_trouble: object | None = None
        #: Built once started (they need the engine, the producer, the shards).
        self._pipeline: Pipeline | None = None
        self._sampler: BacklogSampler | None = None
        self._jittered = False
        self._owns_process = False
        #: What run() undoes when it returns (the heap freeze of a process owner).
        self._heap = contextlib.ExitStack()
        self.metrics.track_shutdown_pending(self._shutdown_pending)
        self.lifecycle.on_drain(functools.partial(drain.on_drain, self._resources))
        self.lifecycle.on_hurry(functools.partial(drain.on_hurry, self._resources))

    # -- public API -----------------------------------------------------------

    def run(self, *, handle_signals: bool | None = None) -> int:
        """Start, relay until drained, shut down in order; return the exit code.

        With ``handle_signals`` (entry points that own the process):
        SIGTERM/SIGINT drain, a second one hurries, a watchdog forces the exit
        (code 4) once ``shutdown_timeout`` has passed, and once started the
        relay freezes the heap (``runtime.service.frozen_while_running``: no
        full collection walks what lives as long as the process); the handlers
        are removed and the freeze undone when ``run`` returns. Embedded, pass
        ``False`` and call :meth:`stop`. The default, ``None``, is yes on the
        main thread and no elsewhere, as for the consumer
        (:class:`~outboxkit.runtime.service.Service`).
        """
        res = self._resources
        install = handles_signals(handle_signals)
        if install:
            self._owns_process = True
        with (
            self.lifecycle.process_signals(
                install, cut=lambda: drain.cut(res), on_forced=lambda: drain.on_forced(res)
            ),
            contextlib.ExitStack() as self._heap,
        ):
            return self._run()

    def _run(self) -> int:
        code = self._start()
        if code is not None:
            return code
        self.lifecycle.set_running()
        res = self._resources
        self._prune_pushed_groups(res.outbox)
        res.retention = start_retention(
            self.engine, self.settings, self.lifecycle, self.service_metrics
        )
        try:
            self.supervisor.run("relay", self._loop)
        except BaseException:  # KeyboardInterrupt when embedded without handlers
            self.lifecycle.drain("interrupted")
            drain.stop(res)
            raise
        return drain.stop(res)

    def _prune_pushed_groups(self, outbox: str) -> None:
        """Delete old exit groups of this outbox's relays that alert on nothing, in the
        background (runtime/pushgroups.py): pod-named groups would pile up."""
        from outboxkit.runtime.pushgroups import start_pruning

        start_pruning(
            self.settings.pushgateway_url,
            job=PUSH_JOB,
            match={"outbox": outbox},
            older_than=self.settings.pushgateway_prune_after,
        )

    def stop(self) -> None:
        """Start the drain (thread-safe; what the first SIGTERM does); :meth:`run`
        then returns once it is done."""
        self.lifecycle.drain("api")

    def drain(self) -> None:
        """Deprecated: :meth:`stop`, the name both services share."""
        warnings.warn(
            "Relay.drain() is deprecated and will be removed: call Relay.stop()",
            DeprecationWarning,
            stacklevel=2,
        )
        self.stop()

    def install_process_handlers(self) -> None:
        """Deprecated: ``run(handle_signals=True)`` does the same for the run (and is
        the default on the main thread)."""
        warnings.warn(
            "Relay.install_process_handlers() is deprecated and will be removed: "
            "call Relay.run(handle_signals=True)",
            DeprecationWarning,
            stacklevel=2,
        )
        self._owns_process = True
        self.lifecycle.install_signal_handlers()
        res = self._resources
        self.lifecycle.start_watchdog(
            lambda: drain.cut(res), on_forced=lambda: drain.on_forced(res)
        )

    def _freeze_heap(self) -> int:
        """Freeze the heap until run() returns (left alone if someone else froze
        it); returns the objects frozen."""
        self._heap.enter_context(frozen_while_running(True))
        return gc.get_freeze_count()

    @property
    def engine(self) -> Engine:
        engine = self._resources.engine
        if engine is None:
            raise RuntimeError("the relay has not been started")
        return engine

    @property
    def outbox_name(self) -> str:
        """The outbox's identity key once read at start (``orders.outbox_events``),
        else the table name."""
        return self._resources.outbox

    def held_rows(self) -> int:
        """Rows leased to this relay and not yet finalized or released."""
        return self._resources.held_rows()

    # -- the loop ---------------------------------------------------------------

    def _loop(self) -> None:
        """Claim -> publish -> finalize until the drain begins (the supervisor
        restarts this after an unexpected exception, never once draining).

        Each turn the pipeline settles the batch claimed last (on its finalizer
        thread with ``pipeline`` on) beside the claim of the next, then produces
        the next; at most two batches are leased to this relay, and their keys
        are apart (:class:`~outboxkit.relay.pipeline.Pipeline`).
        """
        pipeline, sampler, publisher = self._pipeline, self._sampler, self._resources.publisher
        assert pipeline is not None and sampler is not None and publisher is not None
        pipeline.settle_leftover()
        self._start_jitter()
        while not self.lifecycle.draining.is_set():
            if publisher.fatal is not None:
                if not self._step(pipeline.finish_all, "batch-interrupted"):
                    return
                self._rebuild_producer()  # with no batch in flight (it purges the queue)
                continue
            sampler.sample_if_due()
            previous = pipeline.newest()
            pending = pipeline.settle_ahead(previous)
            try:
                batch = pipeline.claim() if pipeline.may_claim(previous) else None
            except Exception as exc:
                # The database failed the claim that was running when the drain began
                # (a redeploy during a blip): what is held is salvaged, so this is the
                # end of the loop, not a crash. A claim whose commit went through
                # unseen left rows leased; they are reclaimed after their lease.
                pipeline.await_settled(previous, pending)  # before anything is salvaged
                pipeline.salvage_all(exc, culprit=None)
                self._end_if_interrupted(
                    exc, "claim-interrupted", "the drain goes on; nothing was held"
                )
                return
            if batch is None and previous is None:
                self._resources.waker.wait(self.settings.poll_interval)
                continue
            turn = functools.partial(pipeline.advance, previous, batch, pending)
            if not self._step(turn, "batch-interrupted"):
                return
        # Draining: no claim any more; what is in flight gets its reports (within
        # the flush budget, see drain.batch_deadline) and is settled, oldest first.
        self._step(pipeline.finish_all, "batch-interrupted")

    def _step(self, fn: Callable[[], None], event: str) -> bool:
        """Run ``fn`` (batch work); after a dependency failure once draining, log
        ``event`` and return False (the loop ends: the drain releases what is still
        held, drain.release_leftover); any other exception is a crash."""
        try:
            fn()
        except Exception as exc:
            self._end_if_interrupted(exc, event, "the drain releases what is still held")
            return False
        return True

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

    def _start_jitter(self) -> None:
        if not self._jittered:
            self._jittered = True
            self.lifecycle.wait_draining(random.uniform(0, self.settings.start_jitter))

    def _rebuild_producer(self) -> None:
        """The producer hit a fatal error (its batch is settled): build new ones,
        with exponential backoff capped at ``paused_topic_retry``, until one
        settles without a fatal error or the drain begins."""
        publisher = self._resources.publisher
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

    def _shutdown_pending(self) -> int:
        """Rows we hold while draining/stopped; 0 while running (no false alerts)."""
        if not self.lifecycle.draining.is_set():
            return 0
        return self.held_rows()

    def _ready_details(self) -> dict[str, object]:
        details: dict[str, object] = {"paused_topics": self.paused.details()}
        conflicts = self.conflicts.details()
        if conflicts:
            details["ownership_conflicts"] = conflicts
        trouble = self._producer_trouble
        if trouble is not None:
            details["kafka_producer"] = f"rebuilding after {trouble}"
        return details

    # -- start ----------------------------------------------------------------------

    def _start(self) -> int | None:
        """Connect to the database and Kafka and bind the health port; an exit code on failure."""
        s, res = self.settings, self._resources
        try:
            # First, so probes get answers while the relay connects: live 200,
            # ready 503 ("starting"); a dependency that takes connect_timeout to
            # give up must not look like a dead process.
            self.health.start()
            if res.engine is None:
                res.engine = create_engine(s)
            else:  # no gap locks in the claim; see claim.py
                res.engine = res.engine.execution_options(isolation_level="READ COMMITTED")
            res.opened.append("database")
            if self.engine.dialect.name not in SERVER_DATABASES:
                raise ConfigError(
                    invalid(
                        "db_url",
                        "the relay runs on MySQL/MariaDB or PostgreSQL "
                        f"(got {self.engine.dialect.name})",
                    )
                )
            pipelined = s.effective_pipeline(self.engine.dialect.name)
            shard_count = self._read_shard_count()
            publisher = res.publisher = Publisher(s)
            res.opened.append("kafka-producer")
            publisher.check_reachable(s.connect_timeout)
            # Coordination follows the database the relay really uses (engine=).
            coord = s if s.db_url else self._with_engine_url(s)
            foreign: ForeignRelayMonitor | OutsiderMonitor | None = None
            if res.ownership is None:
                res.ownership, foreign = default_ownership(
                    coord,
                    shard_count,
                    registry=self.registry,
                    logger=log,
                    identity=self._identity,
                    fingerprint=self._fingerprint,
                    conflicts=self.conflicts,
                )
            pipeline = res.held = self._pipeline = Pipeline(
                s,
                self.lifecycle,
                engine=self.engine,
                publisher=publisher,
                ownership=res.ownership,
                metrics=self.metrics,
                paused=self.paused,
                backoff=self.backoff,
                exit=res.exit,
                shard_count=shard_count,
                pipelined=pipelined,
                on_batch=self._on_batch,
            )
            self._sampler = BacklogSampler(
                s,
                self.engine,
                metrics=self.metrics,
                paused=self.paused,
                ownership=res.ownership,
                foreign=foreign,
                fingerprint=self._fingerprint,
            )
            res.ownership.start(pipeline.inflight_shards)
            res.opened.append("shard-ownership")
            if self._own_waker:  # NOTIFY on PostgreSQL, Redis hints on MySQL, or polling
                res.waker, opened = default_waker(
                    coord, self.lifecycle, logger=log, identity=self._identity
                )
                res.opened.extend([opened] if opened else [])
        except ConfigError as exc:
            return drain.failed_start(res, "config", EXIT_CONFIG, exc)
        except (DependencyError, SchemaNotAppliedError) as exc:
            return drain.failed_start(res, "dependency", EXIT_DEPENDENCY, exc)
        except Exception as exc:
            # e.g. a driver's unwrapped login failure
            if not isinstance(exc, sa.exc.DBAPIError) and not is_infrastructure_error(exc):
                raise
            if res.engine is not None:
                # A login refused or a database that does not exist: the URL is
                # wrong, and restarting will not mend it.
                failure = database_unreachable(exc, res.engine.url)
                if isinstance(failure, ConfigError):
                    return drain.failed_start(res, "config", EXIT_CONFIG, failure)
            return drain.failed_start(res, "dependency", EXIT_DEPENDENCY, exc)
        warn_renamed(log, s)
        frozen = {"heap_frozen": self._freeze_heap()} if self._owns_process else {}
        log_event(
            log,
            "relay-started",
            version=__version__,
            table=s.table,
            outbox=str(self._identity),
            shards=shard_count,
            health_port=self.health.port,
            pipeline=pipelined,
            settings=describe(s),
            **frozen,
        )
        return None

    def _with_engine_url(self, s: RelaySettings) -> RelaySettings:
        """``s`` with the URL of the engine it was given, for the sessions of its own
        that PostgreSQL coordination opens (advisory locks, LISTEN)."""
        url = self.engine.url.render_as_string(hide_password=False)
        return dataclasses.replace(s, db_url=url)

    def _read_shard_count(self) -> int:
        """The first database round trip, retried while the database is unreachable
        (restarting, a connection reset) for up to ``connect_timeout``, as Kafka and
        Redis are: a blip at start must not fail the pod. A SIGTERM ends the wait."""

        def read() -> int:
            with self.engine.connect() as conn:
                shard_count = read_shard_count(conn, self.settings.table)
                require_claim_schema(conn, self.settings.table)
                self._identity = read_identity(conn, self.settings.table)
                self._fingerprint = read_fingerprint(conn)
                self.conflicts.outbox = self._resources.outbox = self._identity.key
                if not self._resources.own_engine:
                    check_session_settings(conn, lease_ttl=self.settings.lease_ttl)
                check_row_image(
                    conn,
                    wanted=self.settings.binlog_row_image,
                    own_engine=self._resources.own_engine,
                )
                return shard_count

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
