"""A model-based test of the row protocol on the real database.

Hypothesis drives several simulated relays through random interleavings of the
relay's own protocol functions (``claim_batch``, ``decide``, ``finalize``,
``release``) against a real outbox table: writes, claims, publishes with any mix
of outcomes (acknowledged, retriable error, row fault, configuration fault, no
report), finalizes, drains, crashes (a batch abandoned as it is), lease expiry,
time passing, paused and resumed topics, and operator requeues. A simulated
Kafka log records every acknowledgement in the order a partition would hold it.

After every step it checks what the relay promises:

- **one holder**: a batch whose lease has not expired still holds every row it
  claimed and has not settled (no row is held under two live tokens);
- **claim order**: a claimed row's earlier rows of its key are delivered (or
  failed, with ``--failed-rows skip``) or in the same batch, and one batch
  carries a key to one topic only; a ``pending`` row not yet due (another
  writer's scheduled row) holds its key like any other;
- **no delivery without an acknowledgement**: a ``delivered`` row was
  acknowledged, at the partition and offset the row records;
- **per-key order**: when a row is first acknowledged, every earlier row of its
  key was acknowledged before, or (with ``--failed-rows skip`` only) was
  ``failed`` at some point, or the relay reports it (``acked-out-of-order``); a crash
  between the acknowledgement and the finalize loses that report, which is the
  one exception, counted as such;
- **attempts**: a claim adds one, a release on drain or an unknown outcome
  refunds it, a crash never does, a requeue resets to zero;
- **nothing lost**: every written row still exists, and at the end, once leases
  expire and failed rows are requeued, every row is delivered.

Two limits of production are part of the moves: the table's ids may jump to
the last ones a BIGINT holds (up to 2^63-1, the row a long-lived outbox ends
on), and the producer's queue is bounded (``queue.buffering.max.messages`` /
``kbytes``): a publish may find it full part way through a batch, which hands
that row and every later one back unsent (``NOT_SENT``), or find a row larger
than the whole empty queue (a fault of the row).

The suite runs a bounded number of examples; ``OUTBOXKIT_MODEL_EXAMPLES`` and
``OUTBOXKIT_MODEL_SECONDS`` run it longer (docs/relay.md, "Testing the protocol").
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from relay_support import db_time
from support.databases import on_both_databases

import outboxkit
from outboxkit.admin.requeue import Selection, requeue
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.claim import claim_batch
from outboxkit.relay.delivery import TOO_LARGE_FOR_QUEUE, not_sent, row_fault
from outboxkit.relay.drain import release
from outboxkit.relay.finalize import Decision, Fate, decide, finalize, spent_rows
from outboxkit.relay.publish import ErrorKind, Report
from outboxkit.relay.rows import Batch
from outboxkit.schema import apply_schema
from outboxkit.schema.table import outbox_table, recovery_table

pytestmark = pytest.mark.integration

TABLE = "outbox_events"
SHARDS = 4
KEYS = ("k0", "k1", "k2")
TOPICS = ("ta", "tb")
RELAYS = ("r0", "r1", "r2")
MAX_ATTEMPTS = 4
# Long enough that a lease only expires when the model says so.
LEASE_TTL = 600.0

ACK, RETRIABLE, ROW_FAULT, CONFIG_FAULT, NO_REPORT = "ack", "retriable", "row", "config", "none"
#: A row larger than the producer's whole (empty) queue: the publisher fails it.
TOO_LARGE = "too-large-for-queue"
#: The largest id a BIGINT column holds.
MAX_ID = 2**63 - 1
#: Rows one example can write at most (40 steps of at most 3 rows): an id jump
#: leaves at least this many ids when it is meant to leave room for all of them.
MAX_ROWS = 40 * 3
#: (column, value as SQL text) a foreign writer may store, per database: zero dates
#: (MariaDB without strict mode), infinities (PostgreSQL), times years ahead, a
#: status outside the enum (MariaDB stores it as ''; PostgreSQL's enum refuses it).
EDGES: dict[str, tuple[tuple[str, str], ...]] = {
    "mariadb": (
        ("created_at", "0000-00-00 00:00:00"),
        ("next_attempt_at", "0000-00-00 00:00:00"),
        ("next_attempt_at", "9999-12-31 23:59:59"),
        ("lease_expires_at", "0000-00-00 00:00:00"),
        ("lease_expires_at", "9999-12-31 23:59:59"),
        ("status", "sent"),
    ),
    "postgresql": (
        ("created_at", "infinity"),
        ("created_at", "-infinity"),
        ("next_attempt_at", "-infinity"),
        ("next_attempt_at", "infinity"),
        ("lease_expires_at", "-infinity"),
        ("lease_expires_at", "infinity"),
    ),
}
OUTCOMES = (ACK, ACK, ACK, RETRIABLE, ROW_FAULT, CONFIG_FAULT, NO_REPORT, TOO_LARGE)


@dataclass(eq=False)
class SimBatch:
    """One claim of a simulated relay."""

    relay: str
    batch: Batch
    reports: dict[int, Report] | None = None  # set once published
    expired: bool = False
    #: Rows this batch's publish acknowledged ahead of earlier rows of their key:
    #: row id -> the earlier rows it overtook.
    acked_ahead: dict[int, list[int]] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return [r.id for r in self.batch.rows]


def set_next_id(engine: sa.Engine, next_id: int) -> None:
    """Make ``next_id`` the id the table gives its next row (1 on an empty table
    starts it over)."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(
                sa.text("SELECT setval(pg_get_serial_sequence(:t, 'id'), :n, false)"),
                {"t": TABLE, "n": next_id},
            )
        else:
            conn.exec_driver_sql(f"ALTER TABLE {TABLE} AUTO_INCREMENT = {int(next_id)}")


class ProtocolModel(RuleBasedStateMachine):
    engine: sa.Engine  # set by the test before the machine runs
    #: ``--failed-rows``: hold (True, the default) or skip.
    failed_holds = True
    #: An earlier example moved the ids to the top of the range: start them over.
    ids_moved = False

    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DELETE FROM {TABLE}"))
            conn.execute(sa.text(f"DELETE FROM {recovery_table().name}"))
        if ProtocolModel.ids_moved:
            set_next_id(self.engine, 1)
            ProtocolModel.ids_moved = False
        #: Ids the table can still give after a jump to the top (None: no jump).
        self.ids_left: int | None = None
        self.t = outbox_table(TABLE)
        self.rows: dict[int, tuple[str, str]] = {}  # id -> (key, topic)
        self.attempts: dict[int, int] = {}
        self.live: list[SimBatch] = []
        self.paused: set[str] = set()
        self.failed_ever: set[int] = set()
        #: Rows with a fault of their own (too large, invalid): every send fails the
        #: same way until an operator fixes and requeues them.
        self.row_faulty: set[int] = set()
        self.acks: dict[int, set[tuple[int | None, int | None]]] = {}  # id -> {(partition, offset)}
        self.first_acked: set[int] = set()
        self.offsets = itertools.count()
        #: First acknowledgements ahead of an earlier row: id -> the batch that made it.
        self.ahead_unreported: dict[int, SimBatch] = {}
        self.lost_reports = 0  # reorders whose report a crash lost
        #: Pending rows written with ``next_attempt_at`` ahead, until time passes.
        self.scheduled: set[int] = set()
        self.backoff = Backoff(base=0.001, cap=0.002)

    # ------------------------------------------------------------------ writes

    @precondition(lambda self: self.ids_left is None)
    @rule(room=st.one_of(st.integers(1, 4), st.just(MAX_ROWS)))
    def ids_at_the_top(self, room: int) -> None:
        """The table's next ids are the last ``room`` a BIGINT holds: rows end on
        id 2^63-1 (a small ``room``), or get ids above 2^63-1-MAX_ROWS. The
        relay's arithmetic on ids (claim order, batches, the payload table, the
        recovery events) must hold there as anywhere; once the ids run out a
        write is not attempted (the database refuses it, not the relay)."""
        set_next_id(self.engine, MAX_ID - room + 1)
        ProtocolModel.ids_moved = True
        self.ids_left = room

    @rule(key=st.sampled_from(KEYS), topic=st.sampled_from(TOPICS), n=st.integers(1, 3))
    def write(self, key: str, topic: str, n: int) -> None:
        if self.ids_left is not None:
            if self.ids_left < n:
                return
            self.ids_left -= n
        with self.engine.begin() as conn:
            ids = [
                outboxkit.enqueue(conn, topic=topic, key=key, payload={"n": i}) for i in range(n)
            ]
            found = conn.execute(
                sa.select(self.t.c.id).where(self.t.c.event_id.in_(ids)).order_by(self.t.c.id)
            ).scalars()
            for row_id in found:
                self.rows[row_id] = (key, topic)
                self.attempts[row_id] = 0

    @rule(
        key=st.sampled_from(KEYS),
        topic=st.sampled_from(TOPICS),
        edge=st.integers(0, len(EDGES["mariadb"]) - 1),
        later=st.integers(0, 2),
    )
    def write_at_an_edge(self, key: str, topic: str, edge: int, later: int) -> None:
        """A row another writer stored with a column at its type's edge: a zero
        date or an infinity in a time, a time years ahead, a status outside the
        enum (docs/operations.md, *What a foreign row turns into*), then ``later``
        rows of its key, which it must not be overtaken by. The relay's rules must
        keep every promise with it in the table."""
        dialect = "postgresql" if self.engine.dialect.name == "postgresql" else "mariadb"
        column, value = EDGES[dialect][edge % len(EDGES[dialect])]
        if self.ids_left is not None:
            if self.ids_left < 1 + later:
                return
            self.ids_left -= 1  # write() below counts the later ones
        with self.engine.begin() as conn:
            event_id = outboxkit.enqueue(conn, topic=topic, key=key, payload={"edge": value})
            row_id = conn.execute(
                sa.select(self.t.c.id).where(self.t.c.event_id == event_id)
            ).scalar_one()
            if dialect == "mariadb":
                conn.exec_driver_sql("SET SESSION sql_mode = ''")  # zero dates, bad enums
            sets = f"{column} = '{value}'"
            if column == "lease_expires_at":
                sets += ", status = 'delivering', lease_owner = 'gone'"
            conn.exec_driver_sql(f"UPDATE {TABLE} SET {sets} WHERE id = {int(row_id)}")
            if dialect == "mariadb":
                conn.exec_driver_sql("SET SESSION sql_mode = DEFAULT")
        self.rows[row_id] = (key, topic)
        self.attempts[row_id] = 0
        if later:
            self.write(key, topic, later)

    @rule(key=st.sampled_from(KEYS), topic=st.sampled_from(TOPICS), later=st.integers(1, 2))
    def write_scheduled(self, key: str, topic: str, later: int) -> None:
        """A ``pending`` row not yet due (another writer's scheduled row, a database
        clock stepped back), then ``later`` due rows of its key: they must wait."""
        if self.ids_left is not None:
            if self.ids_left < 1 + later:
                return
            self.ids_left -= 1  # write() below counts the later ones
        with self.engine.begin() as conn:
            event_id = outboxkit.enqueue(conn, topic=topic, key=key, payload={"at": "later"})
            row_id = conn.execute(
                sa.select(self.t.c.id).where(self.t.c.event_id == event_id)
            ).scalar_one()
            conn.execute(
                self.t.update().where(self.t.c.id == row_id).values(next_attempt_at=db_time(600))
            )
        self.rows[row_id] = (key, topic)
        self.attempts[row_id] = 0
        self.scheduled.add(row_id)
        self.write(key, topic, later)

    # ------------------------------------------------------------------ claims

    @rule(
        target=batches,
        relay=st.sampled_from(RELAYS),
        limit=st.integers(1, 6),
        reclaim=st.booleans(),
    )
    def claim(self, relay: str, limit: int, reclaim: bool = True) -> object:
        # reclaim=False: the pipelined relay's claim beside its batch in flight,
        # which leaves expired leases to a later claim.
        batch = claim_batch(
            self.engine,
            TABLE,
            owner=relay,
            shards=range(SHARDS),
            limit=limit,
            lease_ttl=LEASE_TTL,
            excluded_topics=frozenset(self.paused),
            reclaim=reclaim,
            failed_holds=self.failed_holds,
        )
        if batch is None:
            return multiple()
        assert reclaim or all(r.reclaimed_from is None for r in batch.rows), (
            f"a claim without reclaims took delivering rows from {batch.rows}"
        )
        sim = SimBatch(relay, batch)
        # The batch it replaces (a reclaim) no longer holds these rows.
        taken = set(sim.ids)
        for other in self.live:
            assert other.expired or not taken & set(other.ids), (
                f"rows {sorted(taken & set(other.ids))} claimed by {relay} while "
                f"{other.relay}'s live lease holds them"
            )
        self._check_claim_order(batch)
        for row_id in sim.ids:
            self.attempts[row_id] += 1
        self.live.append(sim)
        return sim

    def _check_claim_order(self, batch: Batch) -> None:
        in_batch = {r.id for r in batch.rows}
        status = self._statuses()
        passed = ("delivered",) if self.failed_holds else ("delivered", "failed")
        topic_of_key: dict[str, str] = {}
        for r in batch.rows:
            key, topic = self.rows[r.id]
            assert topic_of_key.setdefault(key, topic) == topic, (
                f"one batch carries key {key} to two topics"
            )
            for earlier, (k, _) in self.rows.items():
                if k != key or earlier >= r.id or earlier in in_batch:
                    continue
                assert status[earlier] in passed, (
                    f"row {r.id} (key {key}) claimed while earlier row {earlier} "
                    f"is {status[earlier]} and not in the batch"
                )

    # ------------------------------------------------------------------ publish

    @rule(sim=batches, data=st.data())
    def publish(self, sim: SimBatch, data: st.DataObject) -> None:
        """Send the batch's rows; the simulated partitions record what was acked."""
        if sim.reports is not None or sim not in self.live:
            return
        reports: dict[int, Report] = {}
        unreported_keys: set[str] = set()
        failed_keys: set[str] = set()
        unsent, to_send = spent_rows(sim.batch.rows, MAX_ATTEMPTS, failed_holds=self.failed_holds)
        for d in unsent:
            if d.fate is Fate.FAILED:
                # The relay fails it without sending; it can only come back by a
                # requeue (with hold its key's later rows in the batch stay unsent).
                self.failed_ever.add(d.row.id)
        # The producer's bounded queue: room for this many of the rows sent, then
        # full until the produce deadline (None: room for all of them).
        room = data.draw(st.one_of(st.none(), st.integers(0, len(to_send))))
        produced = 0
        queue_full = False
        for r in to_send:
            key, _ = self.rows[r.id]
            queue_full = queue_full or (room is not None and produced >= room)
            if queue_full:
                # This row and every later one are never handed to the producer.
                reports[r.id] = not_sent(r.id, "the producer's queue stayed full")
                failed_keys.add(key)
                continue
            produced += 1
            # A message behind one still queued (no report yet) has no report either:
            # one key goes to one partition, and a partition's reports come in order.
            if key in unreported_keys:
                outcome = NO_REPORT
            elif r.id in self.row_faulty:
                outcome = ROW_FAULT
            else:
                outcome = data.draw(st.sampled_from(OUTCOMES))
            if outcome in (ROW_FAULT, TOO_LARGE):
                # It ends failed whichever relay sends it (with skip, later rows
                # may then go ahead of it).
                self.row_faulty.add(r.id)
                self.failed_ever.add(r.id)
            if outcome == NO_REPORT:
                unreported_keys.add(key)
                continue
            report = reports[r.id] = self._report(r.id, outcome)
            if report.ok:
                self._acked(sim, report, ahead=key in failed_keys)
            else:
                failed_keys.add(key)
        sim.reports = reports

    def _report(self, row_id: int, outcome: str) -> Report:
        now = time.monotonic()
        if outcome == ACK:
            return Report(row_id, None, None, None, 0, next(self.offsets), now)
        if outcome == TOO_LARGE:
            return row_fault(row_id, TOO_LARGE_FOR_QUEUE)
        code, kind = {
            RETRIABLE: (KafkaError._MSG_TIMED_OUT, ErrorKind.RETRIABLE),
            ROW_FAULT: (KafkaError.MSG_SIZE_TOO_LARGE, ErrorKind.ROW_FAULT),
            CONFIG_FAULT: (KafkaError.UNKNOWN_TOPIC_OR_PART, ErrorKind.CONFIG_FAULT),
        }[outcome]
        return Report(row_id, code, f"simulated {outcome}", kind, None, None, now)

    def _acked(self, sim: SimBatch, report: Report, *, ahead: bool) -> None:
        row_id = report.row_id
        self.acks.setdefault(row_id, set()).add((report.partition, report.offset))
        if row_id in self.first_acked:
            return
        key, _ = self.rows[row_id]
        overtaken = [
            e
            for e, (k, _) in self.rows.items()
            if k == key
            and e < row_id
            and e not in self.first_acked
            and (self.failed_holds or e not in self.failed_ever)
        ]
        self.first_acked.add(row_id)
        if overtaken:
            # Only an earlier row of the same batch whose send failed can be
            # overtaken: the claim rules keep everything else out of the way.
            assert ahead, (
                f"row {row_id} (key {key}) first acknowledged before earlier rows {overtaken}"
            )
            sim.acked_ahead[row_id] = overtaken
            self.ahead_unreported[row_id] = sim

    # ------------------------------------------------------------------ settle

    @rule(sim=consumes(batches))
    def finalize_batch(self, sim: SimBatch) -> None:
        """The relay's normal path: decide on the reports, write under the token."""
        if sim.reports is None or sim not in self.live:
            return
        spent, to_send = spent_rows(sim.batch.rows, MAX_ATTEMPTS, failed_holds=self.failed_holds)
        decisions = [
            *spent,
            *decide(
                to_send,
                sim.reports,
                max_attempts=MAX_ATTEMPTS,
                refund_unknown=True,
                failed_holds=self.failed_holds,
            ),
        ]
        self._write(sim, decisions)
        for d in decisions:
            if d.fate is Fate.PAUSED:
                self.paused.add(d.row.topic)

    @rule(sim=consumes(batches))
    def drain(self, sim: SimBatch) -> None:
        """A drain before any report: every row released, attempt refunded."""
        if sim.reports is not None or sim not in self.live:
            return
        before = self._snapshot()
        result = release(self.engine, TABLE, sim.batch, sim.batch.rows, refund=True)
        self.live.remove(sim)
        self._settled(
            sim,
            [Decision(r, Fate.RELEASED, refund=True) for r in sim.batch.rows],
            result.lease_lost,
            before,
        )

    @rule(sim=consumes(batches))
    def salvage(self, sim: SimBatch) -> None:
        """An unexpected exception in the batch: known outcomes written, the rest
        released without refund."""
        if sim not in self.live:
            return
        decisions = decide(
            sim.batch.rows,
            sim.reports or {},
            max_attempts=MAX_ATTEMPTS,
            refund_unknown=False,
            failed_holds=self.failed_holds,
        )
        self._write(sim, decisions)

    @rule(sim=consumes(batches))
    def crash(self, sim: SimBatch) -> None:
        """The relay dies holding the batch: nothing is written, the attempt is kept."""
        if sim not in self.live:
            return
        self.live.remove(sim)
        for row_id in sim.acked_ahead:
            if self.ahead_unreported.pop(row_id, None) is sim:
                self.lost_reports += 1

    def _write(self, sim: SimBatch, decisions: list[Decision]) -> None:
        before = self._snapshot()
        result = finalize(
            self.engine, TABLE, sim.batch, decisions, backoff=self.backoff, delete_on_deliver=False
        )
        self.live.remove(sim)
        self._settled(sim, decisions, result.lease_lost, before)

    def _settled(
        self,
        sim: SimBatch,
        decisions: list[Decision],
        lease_lost: list[int],
        before: dict[int, tuple[object, ...]],
    ) -> None:
        lost = set(lease_lost)
        after = self._snapshot()
        for d in decisions:
            row_id = d.row.id
            if row_id in lost:
                assert before[row_id] == after[row_id], (
                    f"a stale finalize by {sim.relay} changed row {row_id}: "
                    f"{before[row_id]} -> {after[row_id]}"
                )
                continue
            if d.refund and self.attempts[row_id] > 0:
                self.attempts[row_id] -= 1
            if d.fate is Fate.FAILED:
                self.failed_ever.add(row_id)
        reported = self._reported_ahead()
        for row_id, overtaken in sim.acked_ahead.items():
            if self.ahead_unreported.get(row_id) is sim:
                if self.failed_holds or not all(e in self.failed_ever for e in overtaken):
                    # (With skip, overtaking rows that failed is allowed: a failed row
                    # does not hold its key.) Reported even when another relay took the rows
                    # over meanwhile: what Kafka holds does not depend on the lease.
                    assert row_id in reported, (
                        f"row {row_id} was acknowledged ahead of an earlier row of its key "
                        "and finalized without an acked-out-of-order report"
                    )
                del self.ahead_unreported[row_id]

    # ------------------------------------------------------------------ time and operators

    @rule(sim=batches)
    def expire(self, sim: SimBatch) -> None:
        """The batch's lease runs out (its relay stalled): others may reclaim its rows."""
        with self.engine.begin() as conn:
            conn.execute(
                self.t.update()
                .where(self.t.c.lease_token == sim.batch.token)
                .values(lease_expires_at=db_time(-1))
            )
        sim.expired = True

    @rule()
    def time_passes(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                self.t.update()
                .where(self.t.c.status == "retryable")
                .values(next_attempt_at=db_time(-1))
            )
            if self.scheduled:
                conn.execute(
                    self.t.update()
                    .where(self.t.c.id.in_(sorted(self.scheduled)), self.t.c.status == "pending")
                    .values(next_attempt_at=db_time(-1))
                )
        self.scheduled.clear()

    @precondition(lambda self: bool(self.paused))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        self.paused.discard(data.draw(st.sampled_from(sorted(self.paused))))

    @rule(topic=st.sampled_from(TOPICS))
    def pause(self, topic: str) -> None:
        self.paused.add(topic)

    @rule()
    def requeue_failed(self) -> None:
        result = requeue(self.engine, table=TABLE, selection=Selection(all_failed=True))
        for row_id in result.ids:
            self.attempts[row_id] = 0
            self.row_faulty.discard(row_id)  # the operator fixed it

    # ------------------------------------------------------------------ invariants

    def _snapshot(self) -> dict[int, tuple[object, ...]]:
        t = self.t
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    t.c.id,
                    t.c.status,
                    t.c.attempts,
                    t.c.lease_token,
                    t.c.kafka_partition,
                    t.c.kafka_offset,
                )
            ).all()
        return {
            r.id: (r.status, r.attempts, r.lease_token, r.kafka_partition, r.kafka_offset)
            for r in rows
        }

    def _statuses(self) -> dict[int, str]:
        return {i: str(v[0]) for i, v in self._snapshot().items()}

    def _reported_ahead(self) -> set[int]:
        t = recovery_table()
        with self.engine.connect() as conn:
            details = conn.execute(
                sa.select(t.c.detail).where(t.c.kind == "acked-out-of-order")
            ).scalars()
            return {row["row_id"] for d in details for row in json.loads(d)["rows"]}

    @invariant()
    def protocol_holds(self) -> None:
        snap = self._snapshot()
        assert set(snap) == set(self.rows), f"rows lost: {sorted(set(self.rows) - set(snap))}"
        for row_id, (status, attempts, _, partition, offset) in snap.items():
            assert attempts == self.attempts[row_id], (
                f"row {row_id}: attempts {attempts}, expected {self.attempts[row_id]}"
            )
            if status == "delivered":
                assert (partition, offset) in self.acks.get(row_id, set()), (
                    f"row {row_id} delivered at {(partition, offset)} without that acknowledgement"
                )
        for sim in self.live:
            if sim.expired:
                continue
            for row_id in sim.ids:
                status, _, token, _, _ = snap[row_id]
                assert (status, token) == ("delivering", sim.batch.token), (
                    f"row {row_id} of {sim.relay}'s live batch is {status} under another token"
                )

    def teardown(self) -> None:
        """Liveness: with leases expired, topics resumed and failed rows requeued,
        a healthy relay delivers every row."""
        if not self.rows:
            return
        self.paused.clear()
        for sim in list(self.live):
            self.crash(sim)
        with self.engine.begin() as conn:  # every lease runs out
            conn.execute(
                self.t.update()
                .where(self.t.c.status == "delivering")
                .values(lease_expires_at=db_time(-1))
            )
        for _ in range(4 * len(self.rows) + 10):
            self.time_passes()
            self.requeue_failed()
            claimed = self.claim("r0", 50)
            if not isinstance(claimed, SimBatch):
                if all(s == "delivered" for s in self._statuses().values()):
                    break
                continue
            claimed.reports = {r.id: self._report(r.id, ACK) for r in claimed.batch.rows}
            for report in claimed.reports.values():
                self._acked(claimed, report, ahead=False)
            self.finalize_batch(claimed)
        statuses = self._statuses()
        stuck = {i: s for i, s in statuses.items() if s != "delivered"}
        assert not stuck, f"rows never delivered: {stuck}"
        assert set(self.rows) <= self.first_acked


def _examples() -> int:
    return int(os.environ.get("OUTBOXKIT_MODEL_EXAMPLES", "25"))


@pytest.fixture
def model_engine(engine: sa.Engine) -> Iterator[sa.Engine]:
    apply_schema(engine, shards=SHARDS)
    ProtocolModel.failed_holds = True
    yield engine
    ProtocolModel.failed_holds = True


@on_both_databases
@pytest.mark.parametrize("failed_rows", ["hold", "skip"])
def test_row_protocol_model(model_engine: sa.Engine, failed_rows: str) -> None:
    ProtocolModel.engine = model_engine
    ProtocolModel.failed_holds = failed_rows == "hold"
    budget = float(os.environ.get("OUTBOXKIT_MODEL_SECONDS", "0"))
    deadline = time.monotonic() + budget
    runs = 0
    while True:
        run_state_machine_as_test(
            ProtocolModel,
            settings=settings(
                max_examples=_examples(),
                stateful_step_count=40,
                deadline=None,
                derandomize=budget == 0,
                database=None,
                phases=[Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
        runs += 1
        if time.monotonic() >= deadline:
            break


def test_model_catches_a_key_overtaking_an_expired_row_of_a_paused_topic(
    model_engine: sa.Engine,
) -> None:
    """The model's claim-order check finds a known defect: a row of a paused topic
    whose lease expired must still hold back its key's later rows."""
    ProtocolModel.engine = model_engine
    m = ProtocolModel()
    m.write("k0", "ta", 1)
    first = m.claim("r0", 5)
    assert isinstance(first, SimBatch)
    m.pause("ta")
    m.expire(first)
    m.write("k0", "tb", 1)
    m.claim("r1", 5)
    m.protocol_holds()


def test_model_catches_an_unreported_reorder_by_a_relay_that_lost_its_lease(
    model_engine: sa.Engine,
) -> None:
    """A relay whose lease expired while a later row of a key was acknowledged
    ahead of a failed earlier one still reports it when it finalizes."""
    ProtocolModel.engine = model_engine
    m = ProtocolModel()
    m.write("k0", "ta", 2)
    stale = m.claim("r0", 5)
    assert isinstance(stale, SimBatch)
    first, second = stale.batch.rows
    stale.reports = {
        first.id: m._report(first.id, RETRIABLE),
        second.id: m._report(second.id, ACK),
    }
    m._acked(stale, stale.reports[second.id], ahead=True)
    m.expire(stale)
    taken_over = m.claim("r1", 5)
    assert isinstance(taken_over, SimBatch)
    m.finalize_batch(stale)
    m.protocol_holds()


def test_model_walks_the_last_ids_a_bigint_holds(model_engine: sa.Engine) -> None:
    """The id jump the model draws: rows on ids 2^63-2 and 2^63-1 are claimed in
    order, one fails to send, and all end delivered; no write is tried past the
    last id."""
    ProtocolModel.engine = model_engine
    m = ProtocolModel()
    m.ids_at_the_top(2)
    m.write("k0", "ta", 2)
    m.write("k0", "ta", 1)  # no id left: not attempted
    assert sorted(m.rows) == [MAX_ID - 1, MAX_ID]
    sim = m.claim("r0", 5)
    assert isinstance(sim, SimBatch) and sim.ids == [MAX_ID - 1, MAX_ID]
    sim.reports = {MAX_ID - 1: m._report(MAX_ID - 1, RETRIABLE), MAX_ID: m._report(MAX_ID, ACK)}
    m._acked(sim, sim.reports[MAX_ID], ahead=True)
    m.finalize_batch(sim)
    m.protocol_holds()
    m.teardown()
    again = ProtocolModel()  # the next example starts the ids over
    again.write("k1", "tb", 1)
    assert max(again.rows) < MAX_ROWS


def test_model_full_producer_queue_hands_the_rest_of_the_batch_back(
    model_engine: sa.Engine,
) -> None:
    """A queue with room for one row: the batch's later rows come back unsent,
    released with their attempt refunded, and are delivered by a later claim."""
    ProtocolModel.engine = model_engine
    m = ProtocolModel()
    m.write("k0", "ta", 3)
    sim = m.claim("r0", 5)
    assert isinstance(sim, SimBatch)
    first, *rest = sim.ids
    sim.reports = {first: m._report(first, ACK)}
    m._acked(sim, sim.reports[first], ahead=False)
    sim.reports |= {i: not_sent(i, "the producer's queue stayed full") for i in rest}
    m.finalize_batch(sim)
    m.protocol_holds()
    assert [m.attempts[i] for i in rest] == [0, 0]
    assert {s for i, s in m._statuses().items() if i in rest} == {"retryable"}
    m.teardown()


# ---------------------------------------------------------------------------------
# Two outboxes sharing one Redis and one database server
# ---------------------------------------------------------------------------------

#: Relays of each outbox: r0, r1 serve outbox "a"; r2, r3 serve outbox "b".
OWNERS = {"r0": "a", "r1": "a", "r2": "b", "r3": "b"}


class SharedInfrastructureModel(RuleBasedStateMachine):
    """Relays of two outboxes, each with the default table name, sharing one Redis
    and prefix (two databases of one MariaDB server, or two schemas of one
    PostgreSQL database). Their shard leases (the real ``RedisShardLeases``,
    ticked by the model instead of their thread) join, renew, hand over and
    leave in random interleavings with writes and claims.

    After every step: within one outbox no shard is claimable by two relays,
    and every claim delivers its key's rows in id order. At the end: each
    outbox's live relays together own every shard of their outbox, and deliver
    every row (on names that carry only the table, the two outboxes split one
    member set and each left part of its table undelivered).
    """

    engines: dict[str, sa.Engine]  # set by the test
    redis_url: str
    prefix: str

    def __init__(self) -> None:
        super().__init__()
        from outboxkit.relay.ownership.redis_leases import LeaseSettings
        from outboxkit.runtime.identity import read_identity

        self.t = outbox_table(TABLE)
        self.keys: dict[str, str] = {}
        for name, engine in self.engines.items():
            with engine.begin() as conn:
                conn.execute(sa.text(f"DELETE FROM {TABLE}"))
                self.keys[name] = read_identity(conn, TABLE).key
        self.settings = LeaseSettings(
            ttl=60.0, renew_interval=1.0, batch_budget=1.0, prefix=self.prefix
        )
        self.rows: dict[str, dict[int, str]] = {"a": {}, "b": {}}  # outbox -> id -> key
        self.sent: dict[str, dict[str, list[int]]] = {"a": {}, "b": {}}  # key -> first sends
        self.leases: dict[str, Any] = {}
        self.uid = itertools.count()

    def _leases(self, relay: str) -> Any:
        from outboxkit.relay.ownership.redis_leases import RedisShardLeases

        outbox = OWNERS[relay]
        leases = RedisShardLeases(
            self.redis_url,
            table=TABLE,
            node_id=f"{relay}-{next(self.uid)}",
            shard_count=SHARDS,
            settings=self.settings,
            outbox=self.keys[outbox],
        )
        leases._inflight = frozenset  # the model settles every claim inside its block
        return leases

    @rule(outbox=st.sampled_from(("a", "b")), key=st.sampled_from(KEYS), n=st.integers(1, 3))
    def write(self, outbox: str, key: str, n: int) -> None:
        engine = self.engines[outbox]
        with engine.begin() as conn:
            ids = [outboxkit.enqueue(conn, topic="t", key=key, payload=i) for i in range(n)]
            found = conn.execute(
                sa.select(self.t.c.id).where(self.t.c.event_id.in_(ids)).order_by(self.t.c.id)
            ).scalars()
            for row_id in found:
                self.rows[outbox][row_id] = key

    @rule(relay=st.sampled_from(sorted(OWNERS)))
    def join(self, relay: str) -> None:
        if relay not in self.leases:
            self.leases[relay] = self._leases(relay)
        self.leases[relay]._tick()

    @rule(relay=st.sampled_from(sorted(OWNERS)))
    def tick(self, relay: str) -> None:
        if relay in self.leases:
            self.leases[relay]._tick()

    @rule(relay=st.sampled_from(sorted(OWNERS)))
    def leave(self, relay: str) -> None:
        leases = self.leases.pop(relay, None)
        if leases is not None:
            leases.release_all()
            leases.close()

    @rule(relay=st.sampled_from(sorted(OWNERS)), limit=st.integers(1, 6))
    def claim_and_deliver(self, relay: str, limit: int) -> None:
        leases = self.leases.get(relay)
        if leases is not None:
            self._deliver(relay, leases, limit)

    def _deliver(self, relay: str, leases: Any, limit: int) -> int:
        outbox = OWNERS[relay]
        engine = self.engines[outbox]
        with leases.claiming() as shards:
            if not shards:
                return 0
            batch = claim_batch(
                engine, TABLE, owner=leases.node_id, shards=shards, limit=limit,
                lease_ttl=LEASE_TTL,
            )  # fmt: skip
            if batch is None:
                return 0
            reports = {}
            for r in batch.rows:
                key = self.rows[outbox][r.id]
                first = self.sent[outbox].setdefault(key, [])
                if r.id not in first:
                    first.append(r.id)
                    assert first == sorted(first), f"outbox {outbox} key {key} sent {first}"
                reports[r.id] = Report(r.id, None, None, None, 0, r.id, time.monotonic())
            decisions = decide(batch.rows, reports, max_attempts=MAX_ATTEMPTS, refund_unknown=True)
            finalize(
                engine, TABLE, batch, decisions, backoff=Backoff(base=0.001, cap=0.002),
                delete_on_deliver=False,
            )  # fmt: skip
            return len(batch.rows)

    @invariant()
    def one_relay_per_shard_of_an_outbox(self) -> None:
        for outbox in ("a", "b"):
            seen: dict[int, str] = {}
            for relay, leases in self.leases.items():
                if OWNERS[relay] != outbox:
                    continue
                for shard in leases.claimable():
                    assert shard not in seen, (
                        f"shard {shard} of outbox {outbox} claimable by {seen[shard]} and {relay}"
                    )
                    seen[shard] = relay

    def teardown(self) -> None:
        try:
            for relay, outbox in (("r0", "a"), ("r2", "b")):
                if not any(OWNERS[r] == outbox for r in self.leases):
                    self.join(relay)
            for _ in range(6):  # handovers finish within a few ticks
                for leases in self.leases.values():
                    leases._tick()
            for outbox in ("a", "b"):
                owned: set[int] = set()
                for relay, leases in self.leases.items():
                    if OWNERS[relay] == outbox:
                        owned |= leases.claimable()
                assert owned == set(range(SHARDS)), (
                    f"outbox {outbox}: its relays own shards {sorted(owned)} of {SHARDS}"
                )
            for _ in range(4 * sum(len(r) for r in self.rows.values()) + 10):
                if not any(self._deliver(r, leases, 50) for r, leases in self.leases.items()):
                    break
            for outbox, engine in self.engines.items():
                with engine.connect() as conn:
                    statuses = dict(conn.execute(sa.select(self.t.c.id, self.t.c.status)).all())
                stuck = {i: s for i, s in statuses.items() if s != "delivered"}
                assert not stuck, f"outbox {outbox}: rows never delivered: {stuck}"
        finally:
            for relay in list(self.leases):
                self.leave(relay)


def _in_schema(url: str, schema: str) -> str:
    return (
        sa.make_url(url)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


@pytest.fixture
def two_outboxes(db_url: str, request: pytest.FixtureRequest) -> Iterator[dict[str, sa.Engine]]:
    """Two outboxes named ``outbox_events`` on one server: two databases of MariaDB,
    two schemas of one PostgreSQL database."""
    if sa.make_url(db_url).get_backend_name() == "postgresql":
        admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            for schema in ("svc_a", "svc_b"):
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        admin.dispose()
        urls = [_in_schema(db_url, "svc_a"), _in_schema(db_url, "svc_b")]
    else:
        urls = [db_url, request.getfixturevalue("second_db_url")]
    engines = {name: sa.create_engine(url) for name, url in zip("ab", urls, strict=True)}
    for engine in engines.values():
        apply_schema(engine, shards=SHARDS)
    yield engines
    for engine in engines.values():
        engine.dispose()


@on_both_databases
def test_two_outboxes_sharing_one_redis_and_one_server_model(
    two_outboxes: dict[str, sa.Engine], redis_url: str, redis_prefix: str
) -> None:
    SharedInfrastructureModel.engines = two_outboxes
    SharedInfrastructureModel.redis_url = redis_url
    SharedInfrastructureModel.prefix = redis_prefix
    run_state_machine_as_test(
        SharedInfrastructureModel,
        settings=settings(
            max_examples=int(os.environ.get("OUTBOXKIT_MODEL_EXAMPLES", "4")),
            stateful_step_count=25,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
