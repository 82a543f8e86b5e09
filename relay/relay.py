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

import contextlib
import dataclasses
import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Engine

from outboxkit.errors import SchemaNotAppliedError
from outboxkit.relay import accounting, drain
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.claim import claim_batch, reclaims_due
from outboxkit.relay.conflicts import OwnershipConflicts
from outboxkit.relay.drain import ExitRecord, release
from outboxkit.relay.engine import check_session_settings, create_engine
from outboxkit.relay.finalize import Decision, Fate, FinalizeResult, decide, exhausted, finalize
from outboxkit.relay.foreign import ForeignRelayMonitor, OutsiderMonitor
from outboxkit.relay.metrics import RelayMetrics
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.publish import FatalProducerError, InFlight, Publisher, Report
from outboxkit.relay.retention import start_retention
from outboxkit.relay.rows import Batch, ByteBudget, ClaimedRow
from outboxkit.relay.sampling import BacklogSampler
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import ShardOwnership, claim_fence, claiming, default_ownership
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
from outboxkit.runtime.service import freeze_heap
from outboxkit.runtime.settings import SERVER_DATABASES, invalid, warn_renamed
from outboxkit.schema.apply import read_shard_count, require_claim_schema

__all__ = ["PUSH_JOB", "Relay"]

_T = TypeVar("_T")

#: The largest id the ``id`` column (a signed BIGINT) holds.
_MAX_ID = 2**63 - 1

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
    #: Rows handed to the producer (in id order); their reports land in ``inflight``.
    sent: list[ClaimedRow] = field(default_factory=list)
    #: Decisions known without Kafka (spent rows; rows released unsent).
    known: list[Decision] = field(default_factory=list)
    #: Refund the attempt if the rows end up released (False after a crash).
    refund: bool = True
    #: What the salvage decided (known outcomes kept) when it could not write it.
    decisions: list[Decision] | None = None
    #: The finalizer wrote and counted its outcomes (the loop thread may not
    #: have joined it: an interrupt came first); nothing is left to release.
    written: bool = False


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
        #: ``settings.pipeline``, or the database's default once connected
        #: (:meth:`RelaySettings.effective_pipeline`).
        self._pipelined = bool(settings.pipeline)
        self._ownership = ownership
        self._waker: Waker = waker if waker is not None else PollWaker()
        self._own_waker = waker is None
        self._foreign: ForeignRelayMonitor | OutsiderMonitor | None = None
        #: Which outbox this is and which server holds it, read at start; every
        #: shared name carries the identity (outboxkit.runtime.identity).
        self._identity: OutboxIdentity | None = None
        self._fingerprint: str | None = None
        self.conflicts = OwnershipConflicts(self.registry, log, outbox=settings.table)
        self._on_batch = on_batch
        self._publisher: Publisher | None = None
        self._producer_trouble: object | None = None
        #: Batches leased to us, oldest first: at most two (one while not pipelining).
        #: Replaced, never mutated: other threads read it (shard leases, metrics).
        self._held: tuple[_Held, ...] = ()
        #: Writes a batch's outcomes while the loop claims and produces the next one (pipeline).
        self._finalizer: ThreadPoolExecutor | None = None
        #: When a claim last looked for expired leases (monotonic; see reclaims_due).
        self._reclaims_looked = -math.inf
        self._shard_count: int | None = None
        #: What one claim may load (docs/relay.md, "Big rows").
        self._byte_budget = ByteBudget(settings.batch_max_bytes, settings.max_message_bytes())
        self._jittered = False
        #: Built once started (it needs the engine and the shard ownership).
        self._sampler: BacklogSampler | None = None
        self._crashes_before_drain = 0
        self._retention: threading.Thread | None = None
        self._abandoned: list[str] = []
        self._open: list[str] = []
        self._exit = ExitRecord(signal=None, state="starting")
        self._owns_process = False
        self.metrics.track_shutdown_pending(self._shutdown_pending)
        self._retries = accounting.RetryReporter(self.metrics, self._short_partitions)
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
        self._retention = start_retention(
            self.engine, self.settings, self.lifecycle, self.service_metrics
        )
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
        Once started, the relay also freezes the heap (``runtime.service.freeze_heap``):
        no full collection walks what lives as long as the process.
        """
        self._owns_process = True
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
        restarts this after an unexpected exception, never once draining).

        With ``pipeline`` on, two batches overlap: while batch N+1 is claimed, the
        finalizer thread waits for N's delivery reports and writes N's outcomes
        (its own database connection), so the two database round trips run at once;
        N+1 is produced as soon as it is claimed, whether or not N is written yet.
        N is settled before N+2 is claimed, so at most two batches are leased to
        this relay, and the claim rules keep them apart per key: a key whose row
        is in N (``delivering`` under a live lease) has no row in N+1, so N+1's
        messages cannot overtake N's.
        """
        self._settle_leftover()
        self._start_jitter()
        while not self.lifecycle.draining.is_set():
            if self._publisher is not None and self._publisher.fatal is not None:
                if not self._step(self._finish_all, "batch-interrupted"):
                    return
                self._rebuild_producer()  # with no batch in flight (it purges the queue)
                continue
            assert self._sampler is not None  # built by _start
            self._sampler.sample_if_due()
            previous = self._held[-1] if self._held else None
            pending = self._settle_ahead(previous)
            try:
                batch = self._claim() if self._may_claim(previous) else None
            except Exception as exc:
                # The database failed the claim that was running when the drain began
                # (a redeploy during a blip): what is held is salvaged, so this is the
                # end of the loop, not a crash. A claim whose commit went through
                # unseen left rows leased; they are reclaimed after their lease.
                self._await_settled(previous, pending)  # before anything is salvaged
                self._salvage_all(exc, culprit=None)
                self._end_if_interrupted(
                    exc, "claim-interrupted", "the drain goes on; nothing was held"
                )
                return
            if batch is None and previous is None:
                self._waker.wait(self.settings.poll_interval)
                continue
            turn = functools.partial(self._advance, previous, batch, pending)
            if not self._step(turn, "batch-interrupted"):
                return
        # Draining: no claim any more; what is in flight gets its reports (within
        # the flush budget, see drain.batch_deadline) and is settled, oldest first.
        self._step(self._finish_all, "batch-interrupted")

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

    def _next_id_upper(self, shards: frozenset[int]) -> int | None:
        """Beside a leased batch, whose keys hold back their later rows, a claim
        looks no further than about one batch of our shards' rows past its last
        id (see claim.py); otherwise it is unbounded. Never past the largest id a
        BIGINT holds (rows another writer stored at the last ids): a bound
        beyond it failed every such claim on PostgreSQL (``bigint out of range``)."""
        if not self._held:
            return None
        last = self._held[-1].batch.rows[-1].id  # a batch is in id order
        share = len(shards) / max(len(shards), self._shard_count or 1)
        return min(last + math.ceil(self.settings.batch_size / share), _MAX_ID)

    def _may_claim(self, previous: _Held | None) -> bool:
        """Claim while ``previous`` is in flight only while its reports can still
        come (before its deadline, which its lease outlasts): a claim never meets
        our own rows' expired leases."""
        return previous is None or time.monotonic() < drain.batch_deadline(self, previous.batch)

    def _advance(
        self,
        previous: _Held | None,
        batch: Batch | None,
        pending: Future[None] | None,
    ) -> None:
        """One turn: produce ``batch`` (if any); then wait until ``pending``, the
        settling of ``previous`` (if any) on the finalizer thread, is over. Without
        the pipeline, ``batch`` is settled in the same turn.

        ``batch`` goes out before ``previous`` is written: a row committed during
        the claim would otherwise wait for that write too (the latency of a
        pipelined relay at low rates). Their keys are apart (see :meth:`_loop`)."""
        held = self._held[-1] if batch is not None else None
        assert held is None or held.batch is batch
        if held is not None:
            try:
                self._send(held)
            except Exception as exc:
                # No salvage while the finalizer may still be writing ``previous``.
                self._await_settled(previous, pending)
                self._salvage_all(exc, culprit=held)
                raise
        if previous is not None:
            assert pending is not None
            self._join_settled(previous, pending)
        if held is None:
            return
        if not self._pipelined or held.inflight is None:
            self._finish(held)  # nothing was sent: settle it now, not a turn later

    def _finish(self, held: _Held) -> None:
        """Wait for the batch's reports, then write its outcomes."""
        self._guard(held, lambda: self._settle(held, self._outcomes(held)))

    def _finish_all(self) -> None:
        for held in self._held:
            self._finish(held)

    def _guard(self, held: _Held, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` for ``held``; on an unexpected exception salvage every batch
        held (this one without refund unless a dependency failed) and re-raise."""
        try:
            return fn()
        except Exception as exc:
            self._salvage_all(exc, culprit=held)
            raise

    def _salvage_all(self, exc: Exception, *, culprit: _Held | None) -> None:
        """Salvage every batch held, oldest first. Only ``culprit`` (the batch whose
        work raised) loses its attempt, and only if no dependency failed. A batch
        the finalizer already wrote (what raised came after its commit, e.g. while
        counting) is only forgotten: its rows are no longer under its token."""
        for held in self._drop_written():
            refund = held is not culprit or is_infrastructure_error(exc)
            self._salvage(held, refund=refund)

    def _send(self, held: _Held) -> None:
        """Hand the batch to the producer (reports arrive in ``held.inflight``);
        spent rows, and rows of a batch that may no longer be sent, are decided here."""
        batch = held.batch
        assert self._publisher is not None
        if self._on_batch is not None:
            self._on_batch(batch)
        spent = [d for d in (exhausted(r, self.settings.max_attempts) for r in batch.rows) if d]
        spent_ids = {d.row.id for d in spent}
        to_send = [r for r in batch.rows if r.id not in spent_ids]
        held.known = spent
        if self.lifecycle.draining.is_set():  # the drain began during the claim
            held.known = [*spent, *(Decision(r, Fate.RELEASED, refund=True) for r in to_send)]
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
            held.known = [*spent, *(Decision(r, Fate.RELEASED, refund=True) for r in to_send)]
        elif to_send:
            held.sent = to_send
            until = functools.partial(drain.produce_deadline, self, batch)
            held.inflight = self._publisher.publish(to_send, until)

    def _outcomes(self, held: _Held) -> list[Decision]:
        """Wait for the batch's reports (bounded by its deadline) and decide every row."""
        if held.inflight is None:
            return list(held.known)
        assert self._publisher is not None
        self._publisher.wait(held.inflight, lambda: drain.batch_deadline(self, held.batch))
        decisions = decide(
            held.sent,
            self._reports(held.inflight),
            max_attempts=self.settings.max_attempts,
            refund_unknown=True,
        )
        return [*held.known, *decisions]

    def _settle_ahead(self, held: _Held | None) -> Future[None] | None:
        """Pipeline: wait for ``held``'s reports, write and count its outcomes on the
        finalizer thread, beside the next claim (:meth:`_join_settled` waits for it)."""
        if held is None:
            return None
        if self._finalizer is None:
            self._finalizer = ThreadPoolExecutor(1, thread_name_prefix="outboxkit-finalize")
        return self._finalizer.submit(self._outcomes_written, held)

    def _outcomes_written(self, held: _Held) -> None:
        """On the finalizer thread: decide, write, and count at once (metrics agree
        with the table as soon as the write committed). The loop thread drops
        ``held`` from what it holds when it joins; it does no accounting of its
        own until then, so the two never count at the same time."""
        decisions = self._outcomes(held)
        result = self._write(held, decisions)
        held.written = True
        self._account(held.batch, decisions, result)

    def _join_settled(self, held: _Held, pending: Future[None]) -> None:
        """Wait for the finalizer's settling of ``held``; then it is no longer held, or
        if it failed every batch held is salvaged (``held`` without refund unless a
        dependency failed)."""
        try:
            pending.result()
        except Exception as exc:
            self._salvage_all(exc, culprit=held)
            raise
        self._forget(held)

    def _await_settled(self, held: _Held | None, pending: Future[None] | None) -> None:
        """Before a salvage: let the finalizer's settling of ``held`` end; if it
        succeeded ``held`` is no longer held, else it is salvaged with the rest."""
        if held is None or pending is None:
            return
        with contextlib.suppress(Exception):
            pending.result()
            self._forget(held)

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
            started = time.monotonic()
            # Beside a leased batch, the rows a look reads are mostly that batch's,
            # in the middle of their finalize: once per poll_interval (see claim.py).
            reclaim = reclaims_due(
                in_flight=bool(self._held),
                looked=self._reclaims_looked,
                now=started,
                poll_interval=self.settings.poll_interval,
            )
            batch = claim_batch(
                self.engine,
                self.settings.table,
                owner=self.settings.node_id,
                shards=shards,
                limit=self.settings.batch_size,
                lease_ttl=self.settings.lease_ttl,
                excluded_topics=self.paused.excluded(),
                shard_count=self._shard_count,
                id_upper=self._next_id_upper(shards),
                fence=claim_fence(self._ownership, shards),
                reclaim=reclaim,
                budget=self._byte_budget,
            )
            if reclaim:
                self._reclaims_looked = started
            if batch is None:
                return None
            self._held = (*self._held, _Held(batch))
        self.metrics.claimed.inc(len(batch))
        self.metrics.shard_out_of_range.inc(
            sum(1 for r in batch.rows if r.misplaced_shard is not None)
        )
        self.metrics.batch_size.observe(len(batch))
        self.metrics.reclaimed.inc(sum(1 for r in batch.rows if r.reclaimed_from is not None))
        return batch

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
        self._settled(held, decisions, self._write(held, decisions))

    def _write(self, held: _Held, decisions: list[Decision]) -> FinalizeResult:
        return finalize(
            self.engine,
            self.settings.table,
            held.batch,
            decisions,
            backoff=self.backoff,
            delete_on_deliver=self.settings.delete_on_deliver,
        )

    def _settled(self, held: _Held, decisions: list[Decision], result: FinalizeResult) -> None:
        self._forget(held)
        self._account(held.batch, decisions, result)

    def _drop_written(self) -> tuple[_Held, ...]:
        """Forget the batches the finalizer wrote (their rows are no longer under
        their tokens: nothing is left to settle or release); return the rest,
        oldest first."""
        for held in self._held:
            if held.written:
                self._forget(held)
        return self._held

    def _forget(self, held: _Held) -> None:
        """``held`` is settled: no longer ours (only the loop thread replaces ``_held``)."""
        self._held = tuple(h for h in self._held if h is not held)

    def _salvage(self, held: _Held, *, refund: bool) -> None:
        """After an unexpected exception inside a batch: finalize known outcomes,
        release the rest **without** refund (a row that always crashes the relay
        must still reach ``failed``), unless a dependency failed (the database or
        Kafka went away: not the rows' fault). A failure before the write leaves
        the rows leased; the drain tries again (``drain.release_leftover``). A
        failure counting what was written is logged as such: the rows are settled."""
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
            result = self._write(held, decisions)
        except Exception as exc:
            _log_salvage_error(
                "batch-salvage-failed", held, exc, "rows stay leased until their lease expires"
            )
            return
        try:
            self._settled(held, decisions, result)
        except Exception as exc:
            _log_salvage_error(
                "batch-count-failed",
                held,
                exc,
                "the outcomes are written; the metrics miss this batch",
            )

    def close_finalizer(self) -> None:
        """Wait for a finalize still being written (after an interrupt), then stop
        the finalizer thread. A batch it wrote is marked ``written`` and not
        released again (:meth:`_settle_leftover`)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.shutdown(wait=True)

    def _settle_leftover(self) -> None:
        """Settle the batches a crashed run could not settle, oldest first (raises if
        the DB is still gone): nothing for a batch the finalizer wrote, the
        salvage's decisions when it got that far (acknowledged rows stay
        delivered, no second copy), else release every row."""
        self.close_finalizer()
        for held in self._drop_written():  # after an interrupt skipped the join
            if held.decisions is not None:
                self._settle(held, held.decisions)
                continue
            result = release(
                self.engine, self.settings.table, held.batch, held.batch.rows, refund=held.refund
            )
            self._settled(held, [], result)

    def _account(self, batch: Batch, decisions: list[Decision], result: FinalizeResult) -> None:
        """Count a finalized batch and act on its outcomes (see relay/accounting.py).

        The exit record comes first: it is what an operator reads after a drain,
        and a failure in the metrics below must not drop the batch from it. The
        outcome counters come last (a scrape that counts a row delivered also
        finds its latency observed), and count what was written even when
        something before them failed."""
        if self.lifecycle.draining.is_set():
            self._exit.add(len(batch), result)
        lost = set(result.lease_lost)
        try:
            for d in decisions:
                # Reported even when the lease was lost: the copy is in the partition.
                accounting.warn_acked_out_of_order(self.metrics, d)
                if d.row.id not in lost and d.fate is Fate.DELIVERED:
                    accounting.delivered(self.metrics, self.paused, batch, d)
            accounting.pause_topics(self.paused, decisions, lost)
            self._retries.report(decisions, lost)
        finally:
            accounting.count_outcomes(self.metrics, result)

    def _short_partitions(self, topic: str) -> list[dict[str, Any]] | None:
        """The topic's partitions without a leader or with replicas out of sync, as
        the cluster reports them now (one metadata request, at most 2 s; None if
        no broker answered). For the ``delivery-retry`` line, once per topic per
        10 s at most."""
        publisher = self._publisher
        if publisher is None:
            return None
        try:
            meta = publisher.producer.list_topics(topic, timeout=2.0).topics.get(topic)
        except Exception:  # a probe for a log line never breaks the loop
            return None
        if meta is None:
            return None
        return [
            {
                "partition": p.id,
                "leader": p.leader,
                "isr": list(p.isrs),
                "replicas": list(p.replicas),
            }
            for p in sorted(meta.partitions.values(), key=lambda p: p.id)
            if p.leader < 0 or len(p.isrs) < len(p.replicas)
        ][:20]

    # -- helpers of the loop --------------------------------------------------------

    def _start_jitter(self) -> None:
        if not self._jittered:
            self._jittered = True
            self.lifecycle.wait_draining(random.uniform(0, self.settings.start_jitter))

    @property
    def outbox_name(self) -> str:
        """The outbox's identity key once read at start (``orders.outbox_events``),
        else the table name."""
        return self._identity.key if self._identity is not None else self.settings.table

    def _inflight_shards(self) -> frozenset[int]:
        return frozenset().union(*(h.batch.shards for h in self._held))

    def held_rows(self) -> int:
        """Rows leased to this relay and not yet finalized or released."""
        return sum(len(h.batch) for h in self._held)

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
            if self.engine.dialect.name not in SERVER_DATABASES:
                raise ConfigError(
                    invalid(
                        "db_url",
                        "the relay runs on MySQL/MariaDB or PostgreSQL "
                        f"(got {self.engine.dialect.name})",
                    )
                )
            self._pipelined = s.effective_pipeline(self.engine.dialect.name)
            shard_count = self._read_shard_count()
            self._shard_count = shard_count
            self._publisher = Publisher(s)
            self._open.append("kafka-producer")
            self._publisher.check_reachable(s.connect_timeout)
            # Coordination follows the database the relay really uses (engine=).
            coord = s if s.db_url else self._with_engine_url(s)
            if self._ownership is None:
                self._ownership, self._foreign = default_ownership(
                    coord,
                    shard_count,
                    registry=self.registry,
                    logger=log,
                    identity=self._identity,
                    fingerprint=self._fingerprint,
                    conflicts=self.conflicts,
                )
            self._sampler = BacklogSampler(
                s,
                self.engine,
                metrics=self.metrics,
                paused=self.paused,
                ownership=self._ownership,
                foreign=self._foreign,
                fingerprint=self._fingerprint,
            )
            self._ownership.start(self._inflight_shards)
            self._open.append("shard-ownership")
            if self._own_waker:  # NOTIFY on PostgreSQL, Redis hints on MySQL, or polling
                self._waker, opened = default_waker(
                    coord, self.lifecycle, logger=log, identity=self._identity
                )
                self._open.extend([opened] if opened else [])
        except ConfigError as exc:
            return drain.failed_start(self, "config", EXIT_CONFIG, exc)
        except (DependencyError, SchemaNotAppliedError) as exc:
            return drain.failed_start(self, "dependency", EXIT_DEPENDENCY, exc)
        except Exception as exc:
            # e.g. a driver's unwrapped login failure
            if not isinstance(exc, sa.exc.DBAPIError) and not is_infrastructure_error(exc):
                raise
            if self._engine is not None:
                # A login refused or a database that does not exist: the URL is
                # wrong, and restarting will not mend it.
                failure = database_unreachable(exc, self._engine.url)
                if isinstance(failure, ConfigError):
                    return drain.failed_start(self, "config", EXIT_CONFIG, failure)
            return drain.failed_start(self, "dependency", EXIT_DEPENDENCY, exc)
        warn_renamed(log, s)
        frozen = {"heap_frozen": freeze_heap()} if self._owns_process else {}
        log_event(
            log,
            "relay-started",
            table=s.table,
            outbox=str(self._identity),
            shards=shard_count,
            health_port=self.health.port,
            pipeline=self._pipelined,
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
                self.conflicts.outbox = self._identity.key
                if not self._own_engine:
                    check_session_settings(conn, lease_ttl=self.settings.lease_ttl)
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


def _log_salvage_error(event: str, held: _Held, exc: Exception, effect: str) -> None:
    log_event(
        log,
        event,
        level=logging.ERROR,
        rows=len(held.batch),
        error=redact(f"{type(exc).__name__}: {exc}"),
        effect=effect,
    )
