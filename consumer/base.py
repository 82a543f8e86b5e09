"""The ``Consumer`` base class services subclass.

::

    class OrderConsumer(Consumer):
        topics = ("orders",)
        group_id = "billing"

        def handle(self, message: Message) -> None:
            order = message.json()
            ...

    OrderConsumer(ConsumerSettings(kafka_bootstrap="kafka:9092")).run()
    # or: outboxkit consume mypkg.consumers:OrderConsumer

``handle`` may be ``async def``: it then runs on the consumer's event loop
thread with the same guarantees (``consumer/asyncio_handler.py``).

Guarantees (details in ``docs/consumer.md``): an offset is committed only
after its message was handled, or dead-lettered and acknowledged; a crash or a
redeploy redelivers what was not finished; one message never runs on two
workers at once; order is kept per partition (per key with ``concurrency > 1``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import sqlalchemy as sa
from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import KafkaException
from sqlalchemy.engine import Engine

from outboxkit._version import __version__
from outboxkit.consumer import drain
from outboxkit.consumer.asyncio_handler import AsyncHandlers, is_async_handler
from outboxkit.consumer.batching import InboxGroups
from outboxkit.consumer.dlq import DeadLetters, producer_config
from outboxkit.consumer.errors import Classification, classify
from outboxkit.consumer.handling import Handling
from outboxkit.consumer.inbox import Inbox
from outboxkit.consumer.loop import PollLoop
from outboxkit.consumer.message import Message
from outboxkit.consumer.metrics import ConsumerMetrics
from outboxkit.consumer.report import DrainReport
from outboxkit.consumer.retry import RetryPolicy
from outboxkit.consumer.settings import ConsumerSettings, dead_letter_problems, is_pattern
from outboxkit.consumer.worker import Worker
from outboxkit.consumer.workers import Dispatcher
from outboxkit.runtime.db import create_loop_engine
from outboxkit.runtime.errors import (
    ConfigError,
    DependencyError,
    database_unreachable,
    is_infrastructure_error,
)
from outboxkit.runtime.exitcodes import EXIT_CONFIG, EXIT_DEPENDENCY, EXIT_FAILURE
from outboxkit.runtime.heap import HeapTrimmer
from outboxkit.runtime.kafkaclient import client_config, log_kafka_error
from outboxkit.runtime.logs import log_event, redact
from outboxkit.runtime.metrics import push_job
from outboxkit.runtime.service import ServiceRuntime, frozen_while_running, handles_signals
from outboxkit.runtime.settings import (
    describe,
    invalid,
    missing,
    unsupported_database,
    warn_renamed,
    where,
)
from outboxkit.runtime.tracing import consumer_tracing

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["PUSH_JOB", "Consumer"]

#: Pushgateway job of the metrics pushed at exit; grouped by ``instance=node_id``
#: (the convention of every process: outboxkit/runtime/metrics.py).
PUSH_JOB = push_job("consumer")

_log = logging.getLogger("outboxkit.consumer")

_kafka_log = logging.getLogger("outboxkit.consumer.kafka")

# How many messages of one lane a worker takes at once (a run) before the lane goes
# back to the ready queue, so one busy partition (or key) cannot starve the others.
_RUN_LIMIT = 64
_FORCED_CONFIG = {"enable.auto.offset.store": "false"}
# librdkafka's prefetch, as defaults an operator's --kafka-config overrides. Its own
# defaults (64 MB, and 100,000 messages per partition) let the consumer's memory
# grow with the backlog up to that cap, while the poll loop pauses a partition at
# max_buffered unfinished messages anyway. With a smaller cap librdkafka waits
# fetch.queue.backoff.ms (default 1 s) before fetching again once the cap is
# reached, so that wait is shortened too. 8 MB (16,000 messages of 512 B, a
# quarter second at the base class's fastest) read as fast as 16 MB in the
# benchmark, and the consumer's peak then no longer grew with the backlog.
_PREFETCH_DEFAULTS = {"queued.max.messages.kbytes": 8192, "fetch.queue.backoff.ms": 50}


class Consumer:
    """Base class: declare ``topics`` and ``group_id``, implement :meth:`handle`.

    Class attributes (settings of the same name win when set):

    * ``topics``, ``group_id``: what to consume, as which group (required);
    * ``dlq_topic``: one dead-letter topic for all topics (default ``<topic>.dlq``);
    * ``concurrency``: worker threads (default 1: one message at a time, in order);
    * ``transient_errors`` / ``permanent_errors``: your own exception classes,
      retried or dead-lettered at once (see ``outboxkit.consumer.errors``).
    """

    topics: ClassVar[Sequence[str]] = ()
    group_id: ClassVar[str | None] = None
    dlq_topic: ClassVar[str | None] = None
    concurrency: ClassVar[int] = 1
    transient_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    permanent_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(
        self,
        settings: ConsumerSettings | None = None,
        *,
        engine: Engine | AsyncEngine | None = None,
    ) -> None:
        """Check the configuration (``ConfigError`` naming the setting); connect nothing yet.

        ``engine``: a SQLAlchemy engine for the inbox (default: one built from
        ``db_url``), an ``AsyncEngine`` for an ``async def handle``. An ``Engine``
        passed in is not disposed at exit; an ``AsyncEngine``'s pool is, on the
        consumer's loop, whose connections it holds (the engine stays usable).
        """
        self.settings = s = settings if settings is not None else ConsumerSettings()
        self.group = s.group_id or self.group_id
        self.subscribed = tuple(s.topics or self.topics)
        self.workers = s.concurrency or self.concurrency
        # A run holds a whole inbox group (inbox_batch may be larger than _RUN_LIMIT).
        self._run_limit = max(_RUN_LIMIT, s.inbox_batch)
        self._async = (
            AsyncHandlers(cast(Callable[[Message], Awaitable[None]], self.handle), name="consumer")
            if is_async_handler(self.handle)
            else None
        )
        self._check(engine)
        rt = ServiceRuntime.build(s, logger=_log, details=self._details)
        self.registry, self.service_metrics = rt.registry, rt.service_metrics
        self.lifecycle, self.supervisor, self.health = rt.lifecycle, rt.supervisor, rt.health
        self.metrics = ConsumerMetrics(self.registry, group=str(self.group or ""))
        self.lifecycle.on_hurry(lambda: drain.on_hurry(self._drain_parts()))
        #: What the drain reached (its report, the exit commit, the close).
        self._exit = drain.ExitState()
        self._engine: Engine | None = engine if isinstance(engine, Engine) else None
        self._async_engine = engine
        self._owns_engine = False
        self._dispatcher = Dispatcher()
        #: Hands the C heap's free pages back to the OS from the poll thread.
        self.heap = HeapTrimmer(s.heap_trim_interval)
        # A stop must not wait out the poll loop's wait for room (up to 0.5 s).
        self.lifecycle.on_drain(self._dispatcher.wake_poll)
        self._kafka: Any = None
        self._loop: PollLoop | None = None
        self._dead_letters: DeadLetters | None = None
        self._error_logged: dict[int, float] = {}
        #: Set when the inbox opens with inbox_batch > 1: groups of a run in one transaction.
        self._groups: InboxGroups | None = None

    # -- what subclasses implement ------------------------------------------------

    def handle(self, message: Message) -> Awaitable[None] | None:
        """Process one message. Return normally when done; raise to retry or dead-letter.

        With the inbox on, write through ``message.tx``: your writes commit together
        with the inbox row. Called from a worker thread.

        May be ``async def``: it then runs on the consumer's event loop thread, and
        with the inbox writes through ``message.async_tx`` (an ``AsyncConnection``).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement handle(message)")

    def on_start(self) -> None:
        """Called once connected, before the first message. An exception aborts the start."""

    def on_stop(self) -> None:
        """Called once at exit, after the final commit and close."""

    def on_failure(self, message: Message, error: BaseException) -> None:
        """Called when the handler gave up on ``message``, before it is dead-lettered."""

    def classify(self, error: BaseException) -> Classification:
        """Transient (retry) or permanent (dead-letter); see ``outboxkit.consumer.errors``."""
        return classify(error, transient=self.transient_errors, permanent=self.permanent_errors)

    # -- running ---------------------------------------------------------------------

    def run(self, *, handle_signals: bool | None = None) -> int:
        """Consume until drained; return the process exit code.

        With ``handle_signals`` (entry points): SIGTERM/SIGINT drain, a second
        one hurries, and a watchdog forces the exit past ``shutdown_timeout``;
        the handlers are removed again when ``run`` returns. Embedded in a larger
        program, pass ``False`` and call :meth:`stop`. The default, ``None``, is
        yes on the main thread and no elsewhere, as for the relay
        (:class:`~outboxkit.runtime.service.Service`).
        """
        lc = self.lifecycle
        with lc.process_signals(
            handles_signals(handle_signals),
            cut=lambda: drain.cut(self._drain_parts()),
            on_forced=lambda: drain.on_forced(self._drain_parts()),
        ):
            if self._start():
                lc.set_running()
                self._prune_pushed_groups()
                with frozen_while_running(self.settings.gc_freeze):
                    self.supervisor.run("consumer-poll", self._poll_until_draining)
            lc.drain("stopped")
            code = drain.shutdown(self._drain_parts())
        return code

    def _prune_pushed_groups(self) -> None:
        """Delete old exit groups of this consumer group's members that alert on
        nothing, in the background (runtime/pushgroups.py): pod-named groups would
        pile up. Only its own consumer group's: another service's consumers may
        share the Pushgateway, and their groups are theirs to prune."""
        from outboxkit.runtime.pushgroups import start_pruning

        start_pruning(
            self.settings.pushgateway_url,
            job=PUSH_JOB,
            match={drain.PUSH_GROUP_LABEL: str(self.group)},
            older_than=self.settings.pushgateway_prune_after,
        )

    def stop(self) -> None:
        """Start the drain (thread-safe); :meth:`run` returns once it is done."""
        self.lifecycle.drain("api")

    @property
    def closed_cleanly(self) -> bool:
        """False if the final commit/close did not finish within ``close_timeout``."""
        return self._exit.closed

    @property
    def report(self) -> DrainReport | None:
        """The drain's report once :meth:`run` drained (None before)."""
        return self._exit.report

    def _drain_parts(self) -> drain.DrainParts:
        """What the drain works on, as it stands now (the start may not have made all of it)."""
        return drain.DrainParts(
            settings=self.settings,
            lifecycle=self.lifecycle,
            supervisor=self.supervisor,
            health=self.health,
            metrics=self.metrics,
            service_metrics=self.service_metrics,
            dispatcher=self._dispatcher,
            state=self._exit,
            on_stop=lambda: self._call_hook("on_stop"),
            loop=self._loop,
            kafka=self._kafka,
            async_handlers=self._async,
            dead_letters=self._dead_letters,
            owned_engine=self._engine if self._owns_engine else None,
            group_id=str(self.group or ""),
        )

    # -- start ---------------------------------------------------------------------

    def _check(self, engine: Engine | AsyncEngine | None) -> None:
        s = self.settings
        problems = list(s.validate())
        if not self.group:
            problems.append(missing("group_id", " (or class attribute group_id)"))
        if not self.subscribed:
            problems.append(missing("topics", " (or class attribute topics)"))
        problems.extend(
            dead_letter_problems(
                self.subscribed,
                dlq_topic=s.dlq_topic or self.dlq_topic,
                dlq_suffix=s.dlq_suffix,
                class_dlq=not s.dlq_topic and bool(self.dlq_topic),
            )
        )
        if not (s.kafka_bootstrap or s.kafka_config.get("bootstrap.servers")):
            problems.append(missing("kafka_bootstrap"))
        if s.inbox and engine is None and not s.db_url:
            problems.append(invalid("inbox", f"needs {where('db_url')}"))
        unsupported = (
            unsupported_database(engine.dialect.name, "the consumer inbox")
            if s.inbox and engine is not None
            else None
        )
        if unsupported:
            problems.append(f"invalid engine=: {unsupported}")
        if engine is not None and (self._async is None) != isinstance(engine, Engine):
            problems.append(
                "invalid engine=: an async def handle needs an AsyncEngine, a sync one an Engine"
            )
        if s.inbox_batch > 1 and self._async is not None:
            problems.append(
                invalid(
                    "inbox_batch",
                    "an async def handle runs one message per inbox transaction: leave it at 1",
                )
            )
        if not isinstance(self.workers, int) or self.workers < 1:
            problems.append(f"invalid concurrency {self.workers!r}: must be an integer >= 1")
        # Forced Kafka properties (enable.auto.offset.store and the rest) are checked
        # in one place: ConsumerSettings.validate(), through runtime/kafkaconf.py.
        if problems:
            raise ConfigError(errors=problems)

    def _start(self) -> bool:
        """Health server, Kafka, inbox, workers, subscription. False: the start failed."""
        lc = self.lifecycle
        log_event(
            _log,
            "consumer-starting",
            version=__version__,
            consumer=type(self).__qualname__,
            group_id=self.group,
            topics=list(self.subscribed),
            settings=describe(self.settings),
        )
        warn_renamed(_log, self.settings)
        try:
            self.health.start()
            if self._async is not None:
                self._async.start()
            self._connect()
            self._open_inbox()
        except DependencyError as exc:
            self._failed_start("dependency", EXIT_DEPENDENCY, exc)
            return False
        except ConfigError as exc:
            self._failed_start("config", EXIT_CONFIG, exc)
            return False
        try:
            self.on_start()
        except Exception as exc:
            lc.fatal("on_start failed", exc, exit_code=EXIT_FAILURE)
            return False
        worker = Worker(
            dispatcher=self._dispatcher,
            handling=self._handling,
            groups=self._groups,
            metrics=self.metrics,
            run_limit=self._run_limit,
        )
        for n in range(self.workers):
            name = f"consumer-worker-{n}"
            # Daemon threads: a handler still running at the deadline must not hold the exit.
            threading.Thread(
                target=self.supervisor.run, args=(name, worker.run), name=name, daemon=True
            ).start()
        assert self._loop is not None
        self._kafka.subscribe(
            list(self.subscribed),
            on_assign=self._loop.on_assign,
            on_revoke=self._loop.on_revoke,
            on_lost=self._loop.on_lost,
        )
        return True

    def _failed_start(self, kind: str, code: int, exc: BaseException) -> None:
        """An expected start failure (a dependency, the configuration): one line
        saying what and the exit code, as the relay's, then the drain. No traceback:
        the message is the whole story (an unexpected error keeps its traceback)."""
        log_event(
            _log,
            "start-failed",
            level=logging.ERROR,
            kind=kind,
            error=redact(f"{type(exc).__name__}: {exc}"),
            exit_code=code,
        )
        self.lifecycle.fatal("start-failed", exit_code=code)

    def _connect(self) -> None:
        s = self.settings
        base = client_config(s, logger=_kafka_log)
        self._loop = None
        config: dict[str, Any] = {
            "group.id": self.group,
            "partition.assignment.strategy": "cooperative-sticky",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": True,
            "auto.commit.interval.ms": int(s.commit_interval * 1000),
            "statistics.interval.ms": int(s.stats_interval * 1000),
            "max.poll.interval.ms": s.max_poll_interval_ms(),
            "error_cb": self._on_kafka_error,
            "stats_cb": self.metrics.on_stats,
            "on_commit": self._on_commit,
            **_PREFETCH_DEFAULTS,
            **base,
            **_FORCED_CONFIG,
        }
        self._kafka = KafkaConsumer(config)
        self._loop = PollLoop(
            kafka=self._kafka,
            dispatcher=self._dispatcher,
            metrics=self.metrics,
            lane_of=None if self.workers == 1 else self._lane_of,
            max_buffered=s.max_buffered,
            revoke_timeout=s.revoke_timeout,
            workers=self.workers,
            run_limit=self._run_limit,
        )
        try:
            metadata = self._kafka.list_topics(timeout=s.connect_timeout)
        except KafkaException as exc:
            raise DependencyError(f"Kafka unreachable: {exc}") from None
        self._dead_letters = DeadLetters(
            producer_config(base),
            group_id=str(self.group),
            timeout=s.dlq_timeout,
            topic_override=s.dlq_topic or self.dlq_topic,
            suffix=s.dlq_suffix,
        )
        for topic in self.subscribed:
            # A pattern is not a name: only its dead-letter topic (--dlq-topic) is looked up.
            named = [] if is_pattern(topic) else [(topic, "topic")]
            for name, role in [*named, (self._dead_letters.topic_for(topic), "dlq")]:
                if name not in metadata.topics:
                    log_event(
                        _log,
                        "topic-missing",
                        level=logging.WARNING,
                        topic=name,
                        role=role,
                        effect="consumed once it exists"
                        if role == "topic"
                        else "a message that fails pauses its partition until the topic exists",
                    )
        self._handling = Handling(
            handler=cast(Callable[[Message], None], self.handle)
            if self._async is None
            else self._async.handler,
            classify=self.classify,
            on_failure=self._on_failure,
            policy=RetryPolicy(
                max_attempts=s.max_attempts,
                base=s.retry_backoff_base,
                cap=s.retry_backoff_cap,
                max_time=s.retry_max_time,
            ),
            dead_letters=self._dead_letters,
            inbox=None,
            metrics=self.metrics,
            tracing=consumer_tracing(group=str(self.group)),
        )

    def _open_inbox(self) -> None:
        s = self.settings
        if not s.inbox:
            return
        if self._async is not None:
            # Same run/release interface as Inbox, for an async handler.
            self._handling.inbox = self._async.open_inbox(  # type: ignore[assignment]
                self._async_engine,
                s.db_url,
                group_id=str(self.group),
                table=s.inbox_table,
                pool_size=self.workers + 1,
            )
            return
        if self._engine is None:
            assert s.db_url is not None
            self._engine = create_loop_engine(s.db_url, pool_size=self.workers + 1, max_overflow=2)
            self._owns_engine = True
        try:
            with self._engine.connect() as conn:
                present = sa.inspect(conn).has_table(s.inbox_table)
        except Exception as exc:
            if not is_infrastructure_error(exc):
                raise
            raise database_unreachable(exc, self._engine.url) from None
        if not present:
            raise ConfigError(
                f"inbox table {s.inbox_table} does not exist: run outboxkit schema apply"
            )
        inbox = Inbox(self._engine, group_id=str(self.group), table=s.inbox_table)
        self._handling.inbox = inbox
        if s.inbox_batch > 1:
            self._groups = InboxGroups(
                dispatcher=self._dispatcher,
                inbox=inbox,
                handler=self._handling.handler,
                size=s.inbox_batch,
                tracing=self._handling.tracing,
            )

    def _lane_of(self, message: Message) -> Hashable:
        """The lane with several workers; with one, the poll loop uses the partition."""
        return (message.topic, message.partition, message.key)

    # -- the poll thread (the workers': consumer/worker.py) --------------------------------

    def _poll_until_draining(self) -> None:
        assert self._loop is not None
        while not self.lifecycle.draining.is_set():
            try:
                self._loop.step()
                self.heap.maybe_trim()
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if err is not None and getattr(err, "fatal", lambda: False)():
                    self.lifecycle.fatal("kafka", exc, exit_code=EXIT_DEPENDENCY)
                    return
                raise

    # -- hooks and callbacks --------------------------------------------------------------

    def _on_failure(self, message: Message, error: BaseException, attempts: int) -> None:
        self.on_failure(message, error)

    def _call_hook(self, name: str) -> None:
        try:
            getattr(self, name)()
        except Exception as exc:  # a hook never breaks the shutdown
            log_event(
                _log,
                "hook-failed",
                level=logging.ERROR,
                hook=name,
                error=redact(f"{type(exc).__name__}: {exc}"),
            )

    def _on_commit(self, err: Any, partitions: list[Any]) -> None:
        if self._loop is not None:
            self._loop.commits.on_commit(err, partitions)

    def _on_kafka_error(self, err: Any) -> None:
        # librdkafka repeats transport errors while a broker is down: log a code
        # once per minute, not once per retry.
        now = time.monotonic()
        if not err.fatal() and now - self._error_logged.get(err.code(), -1e9) < 60:
            return
        self._error_logged[err.code()] = now
        log_kafka_error(_log, err)
        if err.fatal():
            self.lifecycle.fatal("kafka", KafkaException(err), exit_code=EXIT_DEPENDENCY)

    def _details(self) -> dict[str, object]:
        loop = self._loop
        if loop is None:
            return {}
        running, waiting, queued = self._dispatcher.counts()
        return {
            "assigned": len(loop.offsets),
            "since_rebalance_s": round(loop.since_rebalance(), 1),
            "inflight": running + waiting,
            "buffered": queued,
            "dlq_blocked": sorted(f"{t}/{p}" for t, p in list(loop.dlq_blocked)),
        }
