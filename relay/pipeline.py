"""The pipelined turn: the batches leased to one relay, claimed, produced and settled.

The relay's loop (:meth:`~outboxkit.relay.relay.Relay._loop`) asks the
:class:`Pipeline` for one turn at a time: settle the batch claimed last on the
finalizer thread (:meth:`Pipeline.settle_ahead`), claim the next
(:meth:`Pipeline.claim`), produce it and wait for the settling
(:meth:`Pipeline.advance`). What a turn holds, how a crash inside it salvages
every batch held, and what the drain settles on the way out
(:meth:`Pipeline.settle_leftover`) are here; when to take a turn, and when to
stop, is the loop's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from outboxkit.relay import accounting, drain
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.claim import claim_batch, reclaims_due
from outboxkit.relay.drain import ExitRecord, release
from outboxkit.relay.finalize import (
    Decision,
    Fate,
    FinalizeResult,
    decide,
    finalize,
    spent_rows,
)
from outboxkit.relay.metrics import RelayMetrics
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.publish import InFlight, Publisher, Report
from outboxkit.relay.rows import Batch, ByteBudget, ClaimedRow
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import ShardOwnership, claim_fence, claiming
from outboxkit.runtime.errors import is_infrastructure_error
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import log_event, redact

__all__ = ["Held", "Pipeline"]

_T = TypeVar("_T")

#: The largest id the ``id`` column (a signed BIGINT) holds.
_MAX_ID = 2**63 - 1

#: The relay's own logger: these are the relay's lines.
log = logging.getLogger("outboxkit.relay")


@dataclass
class Held:
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


class Pipeline:
    """The batches leased to one relay, oldest first, and the turn that moves them.

    With ``pipelined``, two batches overlap: while batch N+1 is claimed, the
    finalizer thread waits for N's delivery reports and writes N's outcomes
    (its own database connection), so the two database round trips run at once;
    N+1 is produced as soon as it is claimed, whether or not N is written yet.
    N is settled before N+2 is claimed, so at most two batches are leased to
    this relay, and the claim rules keep them apart per key: a key whose row
    is in N (``delivering`` under a live lease) has no row in N+1, so N+1's
    messages cannot overtake N's. Without it, each batch is settled in the turn
    that claimed it.

    Built by the relay once it has started (engine, producer, shard ownership
    and shard count known). ``exit`` is the relay's exit record: batches
    settled once draining are counted in it. ``on_batch`` is called with every
    claimed batch before it is published (tests inject faults with it).
    """

    def __init__(
        self,
        settings: RelaySettings,
        lifecycle: Lifecycle,
        *,
        engine: Engine,
        publisher: Publisher,
        ownership: ShardOwnership,
        metrics: RelayMetrics,
        paused: PausedTopics,
        backoff: Backoff,
        exit: ExitRecord,
        shard_count: int,
        pipelined: bool,
        on_batch: Callable[[Batch], None] | None = None,
    ) -> None:
        self._settings = settings
        self._lifecycle = lifecycle
        self._engine = engine
        self._publisher = publisher
        self._ownership = ownership
        self._metrics = metrics
        self._paused = paused
        self._backoff = backoff
        self._exit = exit
        self._shard_count = shard_count
        self._pipelined = pipelined
        self._on_batch = on_batch
        #: Batches leased to us, oldest first: at most two (one while not pipelining).
        #: Replaced, never mutated: other threads read it (shard leases, metrics).
        self._held: tuple[Held, ...] = ()
        #: Writes a batch's outcomes while the loop claims and produces the next one.
        self._finalizer: ThreadPoolExecutor | None = None
        #: When a claim last looked for expired leases (monotonic; see reclaims_due).
        self._reclaims_looked = -math.inf
        #: What one claim may load (docs/relay.md, "Big rows").
        self._byte_budget = ByteBudget(settings.batch_max_bytes, settings.max_message_bytes())
        self._retries = accounting.RetryReporter(metrics, self._short_partitions)
        #: Batches in a row that found each topic's cluster at fault (see _outage_backoff).
        self._outage_streak: dict[str, int] = {}

    def _deadline(self, batch: Batch) -> float:
        return drain.batch_deadline(self._lifecycle, self._settings, batch)

    def held_rows(self) -> int:
        """Rows leased to this relay and not yet finalized or released."""
        return sum(len(h.batch) for h in self._held)

    def unfinished_rows(self) -> int:
        """Rows whose delivery reports are still missing (all of a batch not sent)."""
        return sum(h.inflight.missing() if h.inflight else len(h.batch) for h in self._held)

    def inflight_shards(self) -> frozenset[int]:
        """The shards of the rows held: shard ownership hands none of them to
        another relay until they are settled."""
        return frozenset().union(*(h.batch.shards for h in self._held))

    def newest(self) -> Held | None:
        """The batch claimed last, if one is still held (the one a turn settles)."""
        return self._held[-1] if self._held else None

    def may_claim(self, previous: Held | None) -> bool:
        """Claim while ``previous`` is in flight only while its reports can still
        come (before its deadline, which its lease outlasts): a claim never meets
        our own rows' expired leases."""
        return previous is None or time.monotonic() < self._deadline(previous.batch)

    def claim(self) -> Batch | None:
        """Claim a batch from the shards owned now; it is held from here on. None
        when no shard is owned, nothing is due, or the drain began."""
        # The handshake with shard ownership: none of these shards is handed to
        # another relay until the block ends, and before it ends the claimed rows
        # are registered (self._held is what inflight_shards() reports).
        with claiming(self._ownership) as shards:
            self._metrics.shards_owned.set(len(shards))
            if not shards or self._lifecycle.draining.is_set():
                return None
            started = time.monotonic()
            # Beside a leased batch, the rows a look reads are mostly that batch's,
            # in the middle of their finalize: once per poll_interval (see claim.py).
            reclaim = reclaims_due(
                in_flight=bool(self._held),
                looked=self._reclaims_looked,
                now=started,
                poll_interval=self._settings.poll_interval,
            )
            batch = claim_batch(
                self._engine,
                self._settings.table,
                owner=self._settings.node_id,
                shards=shards,
                limit=self._settings.batch_size,
                lease_ttl=self._settings.lease_ttl,
                excluded_topics=self._paused.excluded(),
                shard_count=self._shard_count,
                id_upper=self._next_id_upper(shards),
                fence=claim_fence(self._ownership, shards),
                reclaim=reclaim,
                budget=self._byte_budget,
                failed_holds=self._settings.failed_rows_hold(),
            )
            if reclaim:
                self._reclaims_looked = started
            if batch is None:
                return None
            self._held = (*self._held, Held(batch))
        self._metrics.claimed.inc(len(batch))
        self._metrics.shard_out_of_range.inc(
            sum(1 for r in batch.rows if r.misplaced_shard is not None)
        )
        self._metrics.batch_size.observe(len(batch))
        self._metrics.reclaimed.inc(sum(1 for r in batch.rows if r.reclaimed_from is not None))
        return batch

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
        return min(last + math.ceil(self._settings.batch_size / share), _MAX_ID)

    def advance(
        self,
        previous: Held | None,
        batch: Batch | None,
        pending: Future[None] | None,
    ) -> None:
        """One turn: produce ``batch`` (if any); then wait until ``pending``, the
        settling of ``previous`` (if any) on the finalizer thread, is over. Without
        the pipeline, ``batch`` is settled in the same turn.

        ``batch`` goes out before ``previous`` is written: a row committed during
        the claim would otherwise wait for that write too (the latency of a
        pipelined relay at low rates). Their keys are apart (see :class:`Pipeline`)."""
        held = self._held[-1] if batch is not None else None
        assert held is None or held.batch is batch
        if held is not None:
            try:
                self._send(held)
            except Exception as exc:
                # No salvage while the finalizer may still be writing ``previous``.
                self.await_settled(previous, pending)
                self.salvage_all(exc, culprit=held)
                raise
        if previous is not None:
            assert pending is not None
            self._join_settled(previous, pending)
        if held is None:
            return
        if not self._pipelined or held.inflight is None:
            self._finish(held)  # nothing was sent: settle it now, not a turn later

    def _send(self, held: Held) -> None:
        """Hand the batch to the producer (reports arrive in ``held.inflight``);
        spent rows, and rows of a batch that may no longer be sent, are decided here."""
        batch = held.batch
        if self._on_batch is not None:
            self._on_batch(batch)
        spent, to_send = spent_rows(
            batch.rows, self._settings.max_attempts, failed_holds=self._settings.failed_rows_hold()
        )
        held.known = spent
        if self._lifecycle.draining.is_set():  # the drain began during the claim
            held.known = [*spent, *(Decision(r, Fate.RELEASED, refund=True) for r in to_send)]
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
            held.known = [*spent, *(Decision(r, Fate.RELEASED, refund=True) for r in to_send)]
        elif to_send:
            held.sent = to_send
            until = functools.partial(
                drain.produce_deadline, self._lifecycle, self._settings, batch
            )
            held.inflight = self._publisher.publish(to_send, until)

    def settle_ahead(self, held: Held | None) -> Future[None] | None:
        """Wait for ``held``'s reports, write and count its outcomes on the
        finalizer thread, beside the next claim (:meth:`_join_settled` waits for it)."""
        if held is None:
            return None
        if self._finalizer is None:
            self._finalizer = ThreadPoolExecutor(1, thread_name_prefix="outboxkit-finalize")
        return self._finalizer.submit(self._outcomes_written, held)

    def _outcomes_written(self, held: Held) -> None:
        """On the finalizer thread: decide, write, and count at once (metrics agree
        with the table as soon as the write committed). The loop thread drops
        ``held`` from what it holds when it joins; it does no accounting of its
        own until then, so the two never count at the same time."""
        decisions = self._outcomes(held)
        result = self._write(held, decisions)
        held.written = True
        self._account(held.batch, decisions, result)

    def _join_settled(self, held: Held, pending: Future[None]) -> None:
        """Wait for the finalizer's settling of ``held``; then it is no longer held, or
        if it failed every batch held is salvaged (``held`` without refund unless a
        dependency failed)."""
        try:
            pending.result()
        except Exception as exc:
            self.salvage_all(exc, culprit=held)
            raise
        self._forget(held)

    def await_settled(self, held: Held | None, pending: Future[None] | None) -> None:
        """Before a salvage: let the finalizer's settling of ``held`` end; if it
        succeeded ``held`` is no longer held, else it is salvaged with the rest."""
        if held is None or pending is None:
            return
        with contextlib.suppress(Exception):
            pending.result()
            self._forget(held)

    def finish_all(self) -> None:
        for held in self._held:
            self._finish(held)

    def _finish(self, held: Held) -> None:
        """Wait for the batch's reports, then write its outcomes."""
        self._guard(held, lambda: self._settle(held, self._outcomes(held)))

    def _outcomes(self, held: Held) -> list[Decision]:
        """Wait for the batch's reports (bounded by its deadline) and decide every row."""
        if held.inflight is None:
            return list(held.known)
        self._publisher.wait(held.inflight, lambda: self._deadline(held.batch))
        decisions = decide(
            held.sent,
            self._reports(held.inflight),
            max_attempts=self._settings.max_attempts,
            refund_unknown=True,
            failed_holds=self._settings.failed_rows_hold(),
        )
        self._outage_backoff(decisions)
        return [*held.known, *decisions]

    def _outage_backoff(self, decisions: list[Decision]) -> None:
        """A cluster fault refunds the attempt, so the row's attempts no longer
        grow its backoff: the backoff grows instead with the batches in a row
        that found the topic's cluster at fault (reset by a delivery to the
        topic), capped like any backoff. Only one thread decides at a time (the
        finalizer, or the loop when not pipelining)."""
        delivered = {d.row.topic for d in decisions if d.fate is Fate.DELIVERED}
        faulted = {
            d.row.topic for d in decisions if d.fate is Fate.RETRYABLE and d.refund
        } - delivered
        for topic in delivered:
            self._outage_streak.pop(topic, None)
        for topic in faulted:
            if len(self._outage_streak) < 10_000 or topic in self._outage_streak:
                self._outage_streak[topic] = min(self._outage_streak.get(topic, 0) + 1, 64)
        for d in decisions:
            if d.fate is Fate.RETRYABLE and d.refund:
                d.backoff_attempts = d.row.attempts + self._outage_streak.get(d.row.topic, 1) - 1

    def _reports(self, inflight: InFlight) -> dict[int, Report]:
        return self._publisher.settle_reports(inflight)

    def _settle(self, held: Held, decisions: list[Decision]) -> None:
        """Write the decisions under the batch's token, then count and log them."""
        self._settled(held, decisions, self._write(held, decisions))

    def _write(self, held: Held, decisions: list[Decision]) -> FinalizeResult:
        return finalize(
            self._engine,
            self._settings.table,
            held.batch,
            decisions,
            backoff=self._backoff,
            delete_on_deliver=self._settings.delete_on_deliver,
        )

    def _settled(self, held: Held, decisions: list[Decision], result: FinalizeResult) -> None:
        self._forget(held)
        self._account(held.batch, decisions, result)

    def _account(self, batch: Batch, decisions: list[Decision], result: FinalizeResult) -> None:
        """Count a finalized batch and act on its outcomes (see relay/accounting.py).

        The exit record comes first: it is what an operator reads after a drain,
        and a failure in the metrics below must not drop the batch from it. The
        outcome counters come last (a scrape that counts a row delivered also
        finds its latency observed), and count what was written even when
        something before them failed."""
        if self._lifecycle.draining.is_set():
            self._exit.add(len(batch), result)
        lost = set(result.lease_lost)
        try:
            for d in decisions:
                # Reported even when the lease was lost: the copy is in the partition.
                accounting.warn_acked_out_of_order(self._metrics, d)
                if d.row.id not in lost and d.fate is Fate.DELIVERED:
                    accounting.delivered(self._metrics, self._paused, batch, d)
            accounting.pause_topics(self._paused, decisions, lost)
            self._retries.report(decisions, lost)
        finally:
            accounting.count_outcomes(self._metrics, result)

    def _short_partitions(self, topic: str) -> list[dict[str, Any]] | None:
        """The topic's partitions without a leader or with replicas out of sync, as
        the cluster reports them now (one metadata request, at most 2 s; None if
        no broker answered). For the ``delivery-retry`` line, once per topic per
        10 s at most."""
        try:
            meta = self._publisher.producer.list_topics(topic, timeout=2.0).topics.get(topic)
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

    def _drop_written(self) -> tuple[Held, ...]:
        """Forget the batches the finalizer wrote (their rows are no longer under
        their tokens: nothing is left to settle or release); return the rest,
        oldest first."""
        for held in self._held:
            if held.written:
                self._forget(held)
        return self._held

    def _forget(self, held: Held) -> None:
        """``held`` is settled: no longer ours (only the loop thread replaces ``_held``)."""
        self._held = tuple(h for h in self._held if h is not held)

    def _guard(self, held: Held, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` for ``held``; on an unexpected exception salvage every batch
        held (this one without refund unless a dependency failed) and re-raise."""
        try:
            return fn()
        except Exception as exc:
            self.salvage_all(exc, culprit=held)
            raise

    def salvage_all(self, exc: Exception, *, culprit: Held | None) -> None:
        """Salvage every batch held, oldest first. Only ``culprit`` (the batch whose
        work raised) loses its attempt, and only if no dependency failed. A batch
        the finalizer already wrote (what raised came after its commit, e.g. while
        counting) is only forgotten: its rows are no longer under its token."""
        for held in self._drop_written():
            refund = held is not culprit or is_infrastructure_error(exc)
            self._salvage(held, refund=refund)

    def _salvage(self, held: Held, *, refund: bool) -> None:
        """After an unexpected exception inside a batch: finalize known outcomes,
        release the rest **without** refund (a row that always crashes the relay
        must still reach ``failed``), unless a dependency failed (the database or
        Kafka went away: not the rows' fault). A failure before the write leaves
        the rows leased; the drain tries again (``drain.release_leftover``). A
        failure counting what was written is logged as such: the rows are settled."""
        held.refund = refund
        try:
            reports: dict[int, Report] = {}
            if held.inflight is not None:
                self._publisher.wait(held.inflight, lambda: self._deadline(held.batch))
                reports = self._reports(held.inflight)
            decisions = decide(
                held.batch.rows,
                reports,
                max_attempts=self._settings.max_attempts,
                refund_unknown=refund,
                failed_holds=self._settings.failed_rows_hold(),
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
        released again (:meth:`settle_leftover`)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.shutdown(wait=True)

    def settle_leftover(self) -> None:
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
                self._engine, self._settings.table, held.batch, held.batch.rows, refund=held.refund
            )
            self._settled(held, [], result)


def _log_salvage_error(event: str, held: Held, exc: Exception, effect: str) -> None:
    log_event(
        log,
        event,
        level=logging.ERROR,
        rows=len(held.batch),
        error=redact(f"{type(exc).__name__}: {exc}"),
        effect=effect,
    )
