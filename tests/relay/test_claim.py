"""The claim: cost, per-key hold-back, reclaims, and the shard-ownership contract.

Tests marked ``on_both_databases`` run on MariaDB and on PostgreSQL; the cost
checks read each database's own plan.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from foreign import insert_foreign
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql as psycopg_sql
from relay_support import (
    EmbeddedRelay,
    add_events,
    db_time,
    fast_settings,
    pg_positional,
    pg_rows_touched,
    rows,
    wait_for,
)
from sqlalchemy.dialects import postgresql
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.admin import Selection, discard, requeue
from outboxkit.relay.claim import _claim_statements, claim_batch
from outboxkit.relay.claim_sql import candidates, candidates_query, scheduled_below
from outboxkit.relay.engine import create_engine
from outboxkit.relay.finalize import Decision, Fate, finalize
from outboxkit.relay.metrics import (
    keys_held_by_failed_query,
    ordering_blocked_query,
    sample_backlog,
    sample_keys_held_by_failed,
    sample_ordering_blocked,
)
from outboxkit.relay.rows import Batch
from outboxkit.relay.settings import RelaySettings
from outboxkit.schema import Status, apply_schema, outbox_table, recovery_table, shard_for

pytestmark = pytest.mark.integration

ALL = range(8)


def _literal_sql(engine: sa.Engine, query: sa.Select[Any]) -> str:
    """``query`` as the SQL text the database runs, values inlined (for EXPLAIN)."""
    return str(query.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True}))


def _handler_reads(conn: sa.Connection, query: sa.Select[tuple[int, bytes | None]]) -> int:
    def reads() -> int:
        result = conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Handler_read%'"))
        return sum(int(v) for _, v in result)

    before = reads()
    conn.execute(query).all()
    return reads() - before


def test_claim_cost_does_not_grow_with_delivered_history(engine: sa.Engine, outbox: str) -> None:
    add_events(
        engine, outbox, [Event(topic="t", key=f"k{i % 500}", payload=b"x") for i in range(60_000)]
    )
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.update().values(status="delivered"))
    add_events(
        engine, outbox, [Event(topic="t", key=f"n{i % 50}", payload=b"x") for i in range(100)]
    )
    with engine.begin() as conn:
        conn.execute(sa.text(f"ANALYZE TABLE {outbox}"))
    # As the relay claims: every shard (one relay), some shards (Redis leases: rows
    # with an out-of-range shard are matched by their key's hash), paused topics,
    # and beside a leased batch (the pipeline: bounded by id, here past the
    # backlog's first half).
    with engine.connect() as conn:
        first_pending = conn.execute(
            sa.select(sa.func.min(t.c.id)).where(t.c.status == "pending")
        ).scalar_one()
    for query in (
        candidates_query(outbox, ALL, 50),
        candidates_query(outbox, ALL, 50, shard_count=8),
        candidates_query(outbox, range(4), 50, ("p",), shard_count=8),
        *(
            candidates_query(outbox, shards, 50, shard_count=8, bounded=True).params(
                id_upper=first_pending + 50
            )
            for shards in (ALL, range(4))
        ),
    ):
        with engine.connect() as conn:
            sql = _literal_sql(engine, query)
            plan = conn.execute(sa.text("EXPLAIN " + sql)).mappings().all()
            reads = _handler_reads(conn, query)
        per_status = [p for p in plan if p["table"] == outbox]
        assert len(per_status) == 3
        assert all(p["key"] == f"ix_{outbox}_status_id" for p in per_status), plan
        assert all("filesort" not in (p["Extra"] or "") for p in per_status), plan
        # 20,000 delivered rows, 50 claimed: a few hundred index reads, not a scan.
        assert reads < 1_000, reads
    # Whether a pending row not yet due may hold a candidate's key: the 100
    # pending rows through (status, id), never the delivered history.
    ahead = scheduled_below(outbox, range(4), shard_count=8, dialect=engine.dialect.name).params(
        below=first_pending + 100
    )
    with engine.connect() as conn:
        plan = conn.execute(sa.text("EXPLAIN " + _literal_sql(engine, ahead))).mappings().all()
        reads = _handler_reads(conn, ahead)
    assert [p["key"] for p in plan] == [f"ix_{outbox}_status_id"], plan
    assert reads <= 200, reads


def _probe_loops(conn: sa.Connection, sql: str) -> dict[str, int]:
    """MariaDB's ``ANALYZE FORMAT=JSON`` of ``sql``: how many times each table alias
    of the claim's per-key probes (``earlier``) was read, by the index it used."""
    (text,) = conn.execute(sa.text("ANALYZE FORMAT=JSON " + sql.replace(":", r"\:"))).one()
    loops: dict[str, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            table = node.get("table")
            if isinstance(table, dict) and table.get("table_name") == "earlier":
                key = str(table.get("key"))
                loops[key] = loops.get(key, 0) + int(table.get("r_loops") or 0)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(text))
    return loops


def test_no_candidate_probes_its_key_in_a_status_no_row_is_in(
    engine: sa.Engine, outbox: str
) -> None:
    """MariaDB: the per-key probe of a status runs only while some row is in that
    status. In a healthy drain (nothing retryable, nothing leased, nothing
    failed) no candidate pays for one; with one retryable, one leased and one
    failed row anywhere, every candidate probes its key in all three statuses
    again, and the leased and the failed row still hold their keys' later rows
    back."""
    add_events(
        engine, outbox, [Event(topic="t", key=f"k{i % 50}", payload=b"x") for i in range(150)]
    )
    t = outbox_table(outbox)
    key_index = f"ix_{outbox}_key_status"
    query = candidates_query(outbox, ALL, 100, dialect=engine.dialect.name)
    with engine.connect() as conn:
        healthy = _probe_loops(conn, _literal_sql(engine, query))
        found = candidates(conn, outbox, shards=ALL, limit=100)
    assert sum(healthy.values()) == 0, healthy
    assert len(found) == 100
    ids = [r.id for r in rows(engine, outbox)]
    with engine.begin() as conn:  # the last row of key k49 waits for its retry
        conn.execute(
            t.update()
            .where(t.c.id == ids[-1])
            .values(status="retryable", attempts=1, next_attempt_at=db_time(600))
        )
        # and k0's first row is leased to another relay
        conn.execute(
            t.update()
            .where(t.c.id == ids[0])
            .values(
                status="delivering",
                attempts=1,
                lease_owner="other",
                lease_token="t" * 32,
                lease_expires_at=db_time(600),
            )
        )
        # and k1's first row failed
        conn.execute(t.update().where(t.c.id == ids[1]).values(status="failed", attempts=10))
    with engine.connect() as conn:
        busy = _probe_loops(conn, _literal_sql(engine, query))
        found = candidates(conn, outbox, shards=ALL, limit=100)
    # All three statuses probed, by the key index, once for each candidate at least.
    assert busy.get(key_index, 0) >= 3 * 100, busy
    keys = {k for _, k in found}
    assert b"k0" not in keys, "k0's later rows wait for its leased row"
    assert b"k1" not in keys, "k1's later rows wait for its failed row"
    assert len(found) == 100


@on_both_databases
def test_a_claim_beside_many_leased_rows_reads_only_their_keys(
    engine: sa.Engine, outbox: str
) -> None:
    """Three pipelined relays hold up to 3,000 rows leased. Each candidate's
    per-key check must read its own key's leased rows, not all of them. On a
    table that grew since the server opened it (a new outbox filling up; no
    ``ANALYZE`` here) both databases knew no rows per key and read every leased
    row for each candidate: a claim took seconds, outlived the relay's statement
    timeout and was retried while its batches were in flight (rows sent twice)."""
    keys = 2_000
    add_events(
        engine, outbox, [Event(topic="t", key=f"k{i % keys}", payload=b"x") for i in range(60_000)]
    )
    t = outbox_table(outbox)
    shard_of = {f"k{i}": shard_for(f"k{i}".encode(), "", 8) for i in range(keys)}
    mine, theirs = range(4), range(4, 8)
    with engine.begin() as conn:
        ids = {
            part: [
                r.id
                for r in conn.execute(
                    sa.select(t.c.id).where(t.c.shard.in_(list(part))).order_by(t.c.id).limit(n)
                )
            ]
            for part, n in ((mine, 900), (theirs, 2_100))
        }
        # Another relay's batches, and one of ours still in flight.
        conn.execute(
            t.update()
            .where(t.c.id.in_(ids[mine] + ids[theirs]))
            .values(
                status="delivering", lease_owner="x", lease_token="x", lease_expires_at=db_time(600)
            )
        )
        leased_keys = {
            r.message_key.decode()
            for r in conn.execute(sa.select(t.c.message_key).where(t.c.status == "delivering"))
        }
    query = candidates_query(outbox, mine, 100, shard_count=8, dialect=engine.dialect.name)
    plan = None
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = _literal_sql(engine, query)
            (plan,) = conn.execute(sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)).scalar_one()
            read = _pg_rows_read(plan, "earlier")  # the per-key checks
        else:
            read = _handler_reads(conn, query)  # the whole query
    # About 1,000 of our pending rows are scanned to find 100 of a key not held
    # back, a few reads each: 3,703 on MariaDB, 8,000 on PostgreSQL. Reading
    # every leased row for each was 188,603 and 32.5 million.
    assert read < 30_000, (read, plan)
    batch = claim_batch(
        engine, outbox, owner="a", shards=mine, limit=100, lease_ttl=30, shard_count=8
    )
    assert batch is not None and len(batch) == 100
    assert all(shard_of[r.key.decode()] in mine for r in batch.rows if r.key)
    assert not {r.key.decode() for r in batch.rows if r.key} & leased_keys


@on_both_databases
def test_the_ordering_blocked_sample_reads_the_blockers_keys_not_the_backlog(
    engine: sa.Engine, outbox: str
) -> None:
    """``outbox_ordering_blocked_rows`` is sampled in the relay's loop. Five keys
    are held back by a retry not yet due, in a 60,000-row backlog on a table
    without statistics: the sample must read those keys' rows, not the backlog.
    It joined blockers to waiting rows, and PostgreSQL then read the whole
    backlog into a hash table on every sample (120,015 rows read here, index
    and table scans counted)."""
    keys = 2_000
    add_events(
        engine, outbox, [Event(topic="t", key=f"k{i % keys}", payload=b"x") for i in range(60_000)]
    )
    t = outbox_table(outbox)
    with engine.begin() as conn:
        first = [r.id for r in conn.execute(sa.select(t.c.id).order_by(t.c.id).limit(5))]
        conn.execute(
            t.update()
            .where(t.c.id.in_(first))
            .values(status="retryable", next_attempt_at=db_time(600))
        )
    query = ordering_blocked_query(outbox, (), engine.dialect.name)
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = _literal_sql(engine, query)
            (plan,) = conn.execute(sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)).scalar_one()
            read = _pg_rows_read(plan)
        else:
            plan, read = None, _handler_reads(conn, query)
        # The keys' other 29 rows each wait behind their first.
        assert sample_ordering_blocked(conn, outbox) == 5 * 29
    # About 30 rows per blocking key, a few reads each: 189 on MariaDB.
    assert read < 2_000, (read, plan)


def test_the_ordering_blocked_sample_reads_the_blockers_keys_under_statistics_taken_before(
    pg_url: str,
) -> None:
    """Statistics taken while every row was delivered, then a backlog whose first
    rows wait for a retry: the sample still counts each blocking key's rows
    through the key index. Believing no row pending, PostgreSQL could read every
    pending row through ``(status, id)`` for each blocking key."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        outbox = "outbox_events"
        t = outbox_table(outbox)
        with engine.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {outbox} SET (autovacuum_enabled = false)"))
        history = [Event(topic="t", key=f"h{i % 2_000}", payload=b"x") for i in range(20_000)]
        add_events(engine, outbox, history)
        with engine.begin() as conn:
            conn.execute(t.update().values(status="delivered"))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text(f"ANALYZE {outbox}"))  # every row delivered
        backlog = [Event(topic="t", key=f"k{i % 2_000}", payload=b"x") for i in range(20_000)]
        add_events(engine, outbox, backlog)
        with engine.begin() as conn:
            first = [
                r.id
                for r in conn.execute(
                    sa.select(t.c.id).where(t.c.status == "pending").order_by(t.c.id).limit(5)
                )
            ]
            conn.execute(
                t.update()
                .where(t.c.id.in_(first))
                .values(status="retryable", next_attempt_at=db_time(600))
            )
        with engine.connect() as conn:
            sql = _literal_sql(engine, ordering_blocked_query(outbox, (), "postgresql"))
            (plan,) = conn.execute(sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)).scalar_one()
            assert sample_ordering_blocked(conn, outbox) == 5 * 9
        probes = [s for s in _pg_scans(plan["Plan"]) if s.get("Alias") == "later"]
        assert probes and all(_pg_index_of(s) == f"ix_{outbox}_key_status" for s in probes), plan
        touched = pg_rows_touched(plan)
        assert touched < 2_000, (touched, plan)
    finally:
        engine.dispose()


#: The states a row can be in, for the sample's model below:
#: (status, next_attempt_at, lease_expires_at), in seconds from now (None: not set).
_ROW_STATES = {
    "pending": ("pending", -1, None),
    "retry-due": ("retryable", -1, None),
    "retry-later": ("retryable", 600, None),
    "leased": ("delivering", -1, 600),
    "lease-over": ("delivering", -1, -1),
    "delivered": ("delivered", -1, None),
    "failed": ("failed", -1, None),
}


@on_both_databases
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    rows_=st.lists(
        st.tuples(
            st.sampled_from(["t", "p"]),
            st.sampled_from([None, "a", "b", "c"]),
            st.sampled_from(sorted(_ROW_STATES)),
        ),
        min_size=1,
        max_size=25,
    ),
    paused=st.sampled_from([(), ("p",)]),
)
def test_the_ordering_blocked_sample_counts_what_the_claim_holds_back(
    engine: sa.Engine,
    outbox: str,
    rows_: list[tuple[str, str | None, str]],
    paused: tuple[str, ...],
) -> None:
    """Generated tables: the sample equals a model of the claim's per-key rule
    (a waiting row is held back by an earlier row of its key that is retryable
    and not due, leased, failed, or waiting in a paused topic)."""
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(sa.delete(t))
    event_ids = add_events(
        engine, outbox, [Event(topic=tp, key=k, payload=b"x") for tp, k, _ in rows_]
    )
    row_id = {r.event_id: r.id for r in rows(engine, outbox)}
    ids = [row_id[e] for e in event_ids]
    with engine.begin() as conn:
        for name, (status, due_in, lease_in) in _ROW_STATES.items():
            chosen = [i for i, (_, _, state) in zip(ids, rows_, strict=True) if state == name]
            if chosen:
                values: dict[str, Any] = {"status": status, "next_attempt_at": db_time(due_in)}
                if lease_in is not None:
                    values.update(
                        lease_owner="x", lease_token="x", lease_expires_at=db_time(lease_in)
                    )
                conn.execute(t.update().where(t.c.id.in_(chosen)).values(**values))

    def holds(topic: str, state: str) -> bool:
        if topic in paused and _ROW_STATES[state][0] in ("pending", "retryable", "delivering"):
            return True
        return state in ("retry-later", "leased", "failed")  # failed: --failed-rows hold

    first_blocker: dict[str, int] = {}
    for i, (topic, key, state) in zip(ids, rows_, strict=True):
        if key is not None and holds(topic, state):
            first_blocker.setdefault(key, i)
    expected = sum(
        1
        for i, (_, key, state) in zip(ids, rows_, strict=True)
        if key in first_blocker
        and i > first_blocker[key]
        and _ROW_STATES[state][0] in ("pending", "retryable")
    )
    with engine.connect() as conn:
        assert sample_ordering_blocked(conn, outbox, set(paused)) == expected


def _pg_scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a PostgreSQL JSON plan that reads a relation or an index."""
    found = [plan] if "Relation Name" in plan or "Index Name" in plan else []
    for child in plan.get("Plans", []):
        found += _pg_scans(child)
    return found


@on_both_databases
def test_the_keys_held_by_failed_sample_reads_the_failed_keys_not_the_backlog(
    engine: sa.Engine, outbox: str
) -> None:
    """``outbox_keys_held_by_failed`` is sampled in the relay's loop: five keys
    whose first row failed, in a 20,000-row backlog on a table without
    statistics. The sample starts from the failed rows and probes their keys,
    so it reads those, not the backlog."""
    keys = 1_000
    add_events(
        engine, outbox, [Event(topic="t", key=f"k{i % keys}", payload=b"x") for i in range(20_000)]
    )
    t = outbox_table(outbox)
    with engine.begin() as conn:
        first = [r.id for r in conn.execute(sa.select(t.c.id).order_by(t.c.id).limit(6))]
        conn.execute(t.update().where(t.c.id.in_(first[:5])).values(status="failed"))
        # A failed row whose key has nothing left behind it holds nothing.
        conn.execute(t.update().where(t.c.message_key == b"k5").values(status="delivered"))
        conn.execute(t.update().where(t.c.id == first[5]).values(status="failed"))
    query = keys_held_by_failed_query(outbox, engine.dialect.name)
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = _literal_sql(engine, query)
            (plan,) = conn.execute(sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)).scalar_one()
            read = _pg_rows_read(plan)
        else:
            plan, read = None, _handler_reads(conn, query)
        assert sample_keys_held_by_failed(conn, outbox) == 5
        assert sample_ordering_blocked(conn, outbox) == 5 * 19
    assert read < 1_000, (read, plan)


def _pg_rows_read(plan: dict[str, Any], alias: str = "") -> int:
    """Rows a PostgreSQL ``EXPLAIN (ANALYZE, FORMAT JSON)`` plan read, returned or
    filtered out, over its relation and index scans (of aliases starting ``alias``)."""
    return sum(
        (s.get("Actual Rows", 0) + s.get("Rows Removed by Filter", 0)) * s.get("Actual Loops", 1)
        for s in _pg_scans(plan["Plan"])
        if s.get("Alias", "").startswith(alias)
    )


def _pg_index_of(scan: dict[str, Any]) -> str | None:
    """The index a scan node reads (a bitmap heap scan's: its bitmap index scan's)."""
    if "Index Name" in scan:
        return str(scan["Index Name"])
    children = [_pg_index_of(child) for child in scan.get("Plans", [])]
    return children[0] if len(children) == 1 else None


def _pg_analyzed_backlog(engine: sa.Engine, outbox: str, *, rows: int, keys: int) -> None:
    """``rows`` pending events over ``keys`` keys, analyzed now, on a table that
    autovacuum leaves alone: statistics taken before what the test does next."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {outbox} SET (autovacuum_enabled = false)"))
    add_events(
        engine, outbox, [Event(topic="t", key=f"k{i % keys}", payload=b"x") for i in range(rows)]
    )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"ANALYZE {outbox}"))


def _bounded(query: sa.Select[Any]) -> bool:
    return "id_upper" in query.compile(dialect=postgresql.dialect()).binds


def _pg_literal_plan(conn: sa.Connection, query: sa.Select[Any]) -> dict[str, Any]:
    """The plan of ``query`` with every value written into its text (``id_upper``:
    10**12, no bound)."""
    sql = _literal_sql(conn.engine, query.params(id_upper=10**12) if _bounded(query) else query)
    (plan,) = conn.execute(sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)).scalar_one()
    return plan  # type: ignore[no-any-return]


def _pg_generic_plan(conn: sa.Connection, query: sa.Select[Any]) -> dict[str, Any]:
    """The plan of ``query`` sent as the relay sends it (the text and parameters
    psycopg gets), prepared, and run with the *generic* plan: the plan PostgreSQL
    may keep for a statement psycopg prepared (after its fifth run), made for
    any parameter values. ``id_upper`` is 10**12 (no bound)."""
    compiled = query.compile(dialect=conn.engine.dialect)
    sent = compiled.construct_expanded_state({"id_upper": 10**12} if _bounded(query) else None)
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", number, sent.statement)
    values = sent.parameters

    def sql_type(name: str) -> str:  # an expanded IN's names end in _1, _2, ...
        bind = compiled.binds[name if name in compiled.binds else name.rsplit("_", 1)[0]]
        return str(conn.engine.dialect.type_compiler_instance.process(bind.type))

    types = f"({', '.join(sql_type(n) for n in names)})" if names else ""
    raw = conn.connection.dbapi_connection
    assert raw is not None
    with raw.cursor() as cur:
        cur.execute(f"PREPARE outboxkit_candidates {types} AS " + text)
        try:
            cur.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            args = ", ".join(
                psycopg_sql.Literal(values[n]).as_string(raw) for n in names
            )  # written in: a utility statement's parameters have no type
            execute = "EXECUTE outboxkit_candidates" + (f"({args})" if names else "")
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + execute)
            row = cur.fetchone()
        finally:
            cur.execute("DEALLOCATE outboxkit_candidates")
    assert row is not None
    (plan,) = row[0]
    return plan  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "plan_of", [_pg_literal_plan, _pg_generic_plan], ids=["literal", "generic"]
)
def test_claim_cost_does_not_grow_with_delivered_history_on_postgresql(
    pg_url: str, plan_of: Callable[[sa.Connection, sa.Select[Any]], dict[str, Any]]
) -> None:
    """PostgreSQL's plan of the same claims: each status is an index scan of
    ``(status, id)`` that reads the due rows and stops, never a scan of the table
    (delivered rows, also of the same keys, are not read).

    Also with the generic plan of the prepared statement: with the statuses
    bound as parameters, that plan walked the primary key through every
    delivered row and scanned the table for the per-key checks (a relay that
    settled on it spent 4-8 ms per claim, for its whole life)."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        outbox = "outbox_events"
        # Delivered history on the same keys as the backlog, and on others.
        add_events(
            engine,
            outbox,
            [Event(topic="t", key=f"k{i % 500}", payload=b"x") for i in range(60_000)],
        )
        t = outbox_table(outbox)
        with engine.begin() as conn:
            conn.execute(t.update().values(status="delivered"))
        add_events(
            engine, outbox, [Event(topic="t", key=f"k{i % 50}", payload=b"x") for i in range(100)]
        )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text(f"VACUUM ANALYZE {outbox}"))
        pg = "postgresql"
        for query in (
            candidates_query(outbox, ALL, 50, dialect=pg),
            candidates_query(outbox, ALL, 50, shard_count=8, dialect=pg),
            candidates_query(outbox, range(4), 50, ("p",), shard_count=8, dialect=pg),
            candidates_query(outbox, range(4), 50, shard_count=8, bounded=True, dialect=pg),
        ):
            with engine.begin() as conn:
                plan = plan_of(conn, query)
            scans = _pg_scans(plan["Plan"])
            assert not [s for s in scans if s["Node Type"] == "Seq Scan"], plan
            # The three per-status scans (aliases outbox_events, outbox_events_1, ...);
            # the per-key checks read the table as "earlier".
            per_status = [s for s in scans if s.get("Alias", "").startswith(outbox)]
            assert len(per_status) == 3, plan
            assert all(s["Node Type"] in ("Index Scan", "Index Only Scan") for s in per_status)
            assert all(s["Index Name"] == f"ix_{outbox}_status_id" for s in per_status), plan
            # 20,000 delivered rows, 50 claimed: rows read (returned or filtered
            # out) stay in the hundreds, by status scans and per-key checks alike.
            read = _pg_rows_read(plan)
            assert read < 1_000, (read, plan)
        # Whether a pending row not yet due may hold a candidate's key: the pending
        # rows below the bound through (status, id), never the delivered history.
        ahead = scheduled_below(outbox, range(4), shard_count=8, dialect=pg)
        with engine.begin() as conn:
            plan = plan_of(conn, ahead.params(below=10**12))
        scans = _pg_scans(plan["Plan"])
        assert [s.get("Index Name") for s in scans] == [f"ix_{outbox}_status_id"], plan
        assert _pg_rows_read(plan) <= 100, plan
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "plan_of", [_pg_literal_plan, _pg_generic_plan], ids=["literal", "generic"]
)
def test_claim_stays_flat_while_a_backlog_drains_under_statistics_taken_before(
    pg_url: str, plan_of: Callable[[sa.Connection, sa.Select[Any]], dict[str, Any]]
) -> None:
    """Statistics taken while the backlog was pending (all of it), then most of it
    delivered and not analyzed again, as in a drain faster than autovacuum: the
    claim still reads the due rows through ``(status, id)``. With ``status =
    'pending'`` PostgreSQL walked the primary key through every delivered row
    instead (it believed nearly every row was pending), so each claim of the
    drain cost more than the one before."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        outbox = "outbox_events"
        t = outbox_table(outbox)
        _pg_analyzed_backlog(engine, outbox, rows=20_000, keys=500)  # every row pending
        with engine.begin() as conn:
            (last,) = conn.execute(sa.select(sa.func.max(t.c.id))).one()
            conn.execute(t.update().where(t.c.id <= last - 100).values(status="delivered"))
        pg = "postgresql"
        for query in (
            candidates_query(outbox, ALL, 50, dialect=pg),
            candidates_query(outbox, range(4), 50, shard_count=8, dialect=pg),
            candidates_query(outbox, range(4), 50, shard_count=8, bounded=True, dialect=pg),
        ):
            with engine.begin() as conn:
                plan = plan_of(conn, query)
            per_status = [
                s for s in _pg_scans(plan["Plan"]) if s.get("Alias", "").startswith(outbox)
            ]
            assert all(s.get("Index Name") == f"ix_{outbox}_status_id" for s in per_status), plan
            # 19,900 delivered rows before the 100 due ones: a claim of 50 reads
            # a few hundred rows, not the history.
            read = _pg_rows_read(plan)
            assert read < 1_000, (read, plan)
    finally:
        engine.dispose()


def test_a_relays_prepared_statements_read_only_their_rows_after_the_table_grew_unanalyzed(
    pg_url: str,
) -> None:
    """A relay's session on a table that had no statistics yet (new, or grown
    faster than autovacuum analyzes it): psycopg prepares each statement it ran
    five times, and PostgreSQL may then keep a plan made for any values, planned
    for the table as it was. On a table of a few rows that plan scanned the whole
    table to lock and lease a batch by primary key, and kept doing so as the table
    grew: claims went from 2 to 6 ms over the first 10,000 rows of a new table,
    until autovacuum analyzed it. Each statement the relay's session prepared
    must read only the rows it is about, however the table grew since."""
    admin = sa.create_engine(pg_url)
    relay_engine = create_engine(RelaySettings(db_url=pg_url, kafka_bootstrap="-"))
    outbox = "outbox_events"
    t = outbox_table(outbox)
    try:
        apply_schema(admin, shards=8)
        with admin.begin() as conn:  # no autoanalyze may replan in between
            conn.execute(sa.text(f"ALTER TABLE {outbox} SET (autovacuum_enabled = false)"))

        def cycle() -> None:
            batch = claim_batch(relay_engine, outbox, owner="r", shards=ALL, limit=50, lease_ttl=30)
            assert batch is not None
            decisions = [Decision(r, Fate.DELIVERED, partition=0, offset=r.id) for r in batch.rows]
            finalize(relay_engine, outbox, batch, decisions, backoff=None, delete_on_deliver=False)

        # Enough runs for psycopg to prepare each statement and for PostgreSQL
        # to choose between its plans, on a table of a few dozen rows.
        few = [Event(topic="t", key=f"k{j}", payload=b"x") for j in range(5)]
        for _ in range(15):
            add_events(admin, outbox, few)
            cycle()
        history = [Event(topic="t", key=f"k{i % 500}", payload=b"x") for i in range(20_000)]
        add_events(admin, outbox, history)
        with admin.begin() as conn:
            conn.execute(t.update().where(t.c.status == "pending").values(status="delivered"))
        add_events(admin, outbox, [Event(topic="t", key=f"k{j}", payload=b"x") for j in range(10)])
        sent: list[tuple[str, dict[str, Any]]] = []

        def capture(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
            sent.append((statement, dict(params or {})))

        sa.event.listen(relay_engine, "before_cursor_execute", capture)
        cycle()
        sa.event.remove(relay_engine, "before_cursor_execute", capture)

        with relay_engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert raw is not None
            prepared = dict(
                conn.execute(sa.text("SELECT statement, name FROM pg_prepared_statements")).all()
            )
            checked = 0
            for statement, params in sent:
                numbered, names = pg_positional(statement)
                if not names or numbered not in prepared:
                    continue  # not prepared: planned for its values on every run
                args = ", ".join(psycopg_sql.Literal(params[n]).as_string(raw) for n in names)
                with raw.cursor() as cur:
                    cur.execute(
                        f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {prepared[numbered]}({args})"
                    )
                    row = cur.fetchone()
                assert row is not None
                plan = row[0][0]
                touched = pg_rows_touched(plan)
                # 20,085 rows; the statement is about 10 of them.
                assert touched < 1_000, (statement, touched, plan)
                checked += 1
            # Rolled back once, at the end: psycopg forgets its prepared
            # statements on a rollback.
            conn.rollback()
            # The lock, the lease and finalize's write, at least.
            assert checked >= 3, (sorted(prepared), [s for s, _ in sent])
    finally:
        relay_engine.dispose()
        admin.dispose()


@pytest.mark.parametrize(
    "plan_of", [_pg_literal_plan, _pg_generic_plan], ids=["literal", "generic"]
)
def test_a_claim_beside_a_leased_batch_checks_each_key_by_its_index_under_statistics_taken_before(
    pg_url: str, plan_of: Callable[[sa.Connection, sa.Select[Any]], dict[str, Any]]
) -> None:
    """Statistics taken while every row was pending, then one batch leased, as the
    pipelined relay's claim of batch N+1 meets batch N: each candidate's per-key
    check still seeks its key's rows. Believing no row ``delivering``,
    PostgreSQL read the leased rows once and compared every candidate with each
    of them (500 x 500 join filter rows per claim, 32 ms of the relay's 50 ms
    per batch), and the pipelined relay was slower than the plain one."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        outbox = "outbox_events"
        _pg_analyzed_backlog(engine, outbox, rows=20_000, keys=10_000)  # every row pending
        leased = claim_batch(engine, outbox, owner="a", shards=ALL, limit=500, lease_ttl=60.0)
        assert leased is not None and len(leased) == 500
        t = outbox_table(outbox)
        with engine.begin() as conn:  # a few retries waiting: every candidate's key is probed
            last = conn.execute(sa.select(sa.func.max(t.c.id))).scalar_one()
            conn.execute(
                t.update()
                .where(t.c.id > last - 5)
                .values(status="retryable", next_attempt_at=db_time(600))
            )
        pg = "postgresql"
        for query in (
            candidates_query(outbox, ALL, 500, dialect=pg),
            candidates_query(outbox, range(4), 500, shard_count=8, bounded=True, dialect=pg),
        ):
            with engine.begin() as conn:
                plan = plan_of(conn, query)
            # The scans run for each candidate (more than once) seek the key index;
            # the leased rows' keys are read once (a hashed subplan).
            checks = [
                s
                for s in _pg_scans(plan["Plan"])
                if s.get("Alias", "").startswith("earlier") and s.get("Actual Loops", 1) > 1
            ]
            assert checks, plan
            assert all(_pg_index_of(s) == f"ix_{outbox}_key_status" for s in checks), plan
            # 500 candidates (fewer for 4 shards of 8), a check or two each that
            # find nothing: a few thousand rows, not one per candidate and leased row.
            touched = pg_rows_touched(plan)
            assert touched < 10_000, (touched, plan)
    finally:
        engine.dispose()


def test_the_relays_postgresql_sessions_do_not_compile_its_claims(pg_url: str) -> None:
    """The candidates statement's per-key checks run once per candidate, so its
    estimated cost grows with the batch: past ``jit_above_cost`` at 5,000 rows
    here, and PostgreSQL compiled it to machine code on every claim (about a
    second, for a statement that runs in milliseconds). The relay's sessions run
    with ``jit = off``, after the URL's own ``options``, which still apply."""
    url = sa.make_url(pg_url).update_query_dict({"options": "-c lock_timeout=7000"})
    engine = create_engine(fast_settings(url.render_as_string(False), "127.0.0.1:1"))
    plain = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        add_events(
            engine,
            "outbox_events",
            [Event(topic="t", key=f"k{i}", payload=b"x") for i in range(6_000)],
        )
        with plain.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE outbox_events"))
        explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + _literal_sql(
            engine, candidates_query("outbox_events", ALL, 5_000, dialect="postgresql")
        )
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW jit")).scalar_one() == "off"
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar_one() == "7s"
            (plan,) = conn.execute(sa.text(explain)).scalar_one()
        assert "JIT" not in plan, plan["JIT"]
        with plain.connect() as conn:
            if conn.execute(sa.text("SELECT pg_jit_available()")).scalar_one():
                (plan,) = conn.execute(sa.text(explain)).scalar_one()
                assert "JIT" in plan  # what the relay's sessions no longer pay
    finally:
        engine.dispose()
        plain.dispose()


def test_claims_on_postgresql_send_few_parameters_and_one_text_per_statement(
    pg_url: str,
) -> None:
    """psycopg parses a statement anew on every call once it has more than 50
    parameters (its query cache stops there), and prepares one statement per
    text. With 64 shards an expanding ``IN`` made the candidates query 64
    parameters per arm, and the lock and lease statements a new text for every
    batch size: client CPU per claim that the relay spent at 1,000 events/s."""
    engine = create_engine(fast_settings(pg_url, "127.0.0.1:1"))
    sent: list[tuple[str, int]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        sent.append((statement, len(params or ())))

    try:
        apply_schema(engine, shards=64)
        add_events(
            engine,
            "outbox_events",
            [Event(topic="t", key=f"k{i}", payload=b"x") for i in range(150)],
        )
        sa.event.listen(engine, "before_cursor_execute", record)
        sizes = []
        for limit in (7, 60, 1, 82):  # half the shards, then all of them
            shards = range(0, 64, 2) if limit == 7 else range(64)
            batch = claim_batch(
                engine, "outbox_events", owner="a", shards=shards, limit=limit, lease_ttl=30,
                shard_count=64,
            )  # fmt: skip
            assert batch is not None
            sizes.append(len(batch))
        assert sizes[1:] == [60, 1, 82]
        assert max(n for _, n in sent) <= 50, sorted(n for _, n in sent)
        lock_texts = {text for text, _ in sent if "SKIP LOCKED" in text}
        lease_texts = {text for text, _ in sent if text.startswith("UPDATE")}
        assert len(lock_texts) == 1 and len(lease_texts) == 1, (lock_texts, lease_texts)
    finally:
        engine.dispose()


@on_both_databases
def test_a_claim_in_progress_does_not_hold_up_the_writers(
    engine: sa.Engine, db_url: str, outbox: str
) -> None:
    """While a relay's claim transaction holds its rows (READ COMMITTED, ``SKIP
    LOCKED``), a service's enqueue commits at once, and a second claim skips
    the locked rows instead of waiting for them."""
    add_events(engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"x") for i in range(10)])
    relay_engine = create_engine(fast_settings(db_url, "127.0.0.1:1"))
    committed = threading.Event()

    def write() -> None:
        add_events(engine, outbox, [Event(topic="t", key="new", payload=b"n")])
        committed.set()

    try:
        with relay_engine.begin() as conn:
            found = candidates(conn, outbox, shards=ALL, limit=5)
            lock, _ = _claim_statements(outbox, relay_engine.dialect.name)
            assert len(conn.execute(lock, {"ids": [i for i, _ in found]}).all()) == 5
            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            assert committed.wait(10), "the enqueue waited for the claim's transaction"
            other = claim_batch(
                relay_engine, outbox, owner="b", shards=ALL, limit=100, lease_ttl=30
            )
            assert other is not None
            assert {r.id for r in other.rows}.isdisjoint(i for i, _ in found)
            assert len(other) == 6, "the other five, and the row written meanwhile"
    finally:
        relay_engine.dispose()


@on_both_databases
def test_rows_another_claim_holds_cut_their_keys_and_nothing_else(
    engine: sa.Engine, db_url: str, outbox: str
) -> None:
    """A candidate another transaction holds is skipped, and so is every later
    row of its key; a locked keyless row holds nothing back; a key switching
    topics is cut at the switch."""
    events = [
        ("a1", "A", "t"),
        ("b1", "B", "t"),
        ("n1", None, "t"),
        ("a2", "A", "t"),
        ("b2", "B", "t"),
        ("n2", None, "t"),
        ("a3", "A", "t"),
        ("c1", "C", "t"),
        ("c2", "C", "u"),
        ("c3", "C", "t"),
        ("d1", "D", "u"),
    ]
    add_events(engine, outbox, [Event(topic=tp, key=k, payload=n.encode()) for n, k, tp in events])
    ids = {r.payload.decode(): r.id for r in rows(engine, outbox)}
    relay_engine = create_engine(fast_settings(db_url, "127.0.0.1:1"))
    held = [ids["a1"], ids["b2"], ids["n1"]]
    try:
        # Another relay's claim, still open: its lock statement holds three rows.
        with relay_engine.begin() as other:
            lock, _ = _claim_statements(outbox, relay_engine.dialect.name)
            assert len(other.execute(lock, {"ids": held}).all()) == 3
            batch = claim_batch(
                relay_engine, outbox, owner="r", shards=ALL, limit=100, lease_ttl=30
            )
            assert batch is not None
            assert [r.payload for r in batch.rows] == [b"b1", b"n2", b"c1", b"d1"]
        statuses = {r.payload.decode(): (r.status, r.attempts) for r in rows(engine, outbox)}
        leased = {n for n, (status, _) in statuses.items() if status == "delivering"}
        assert leased == {"b1", "n2", "c1", "d1"}
        assert all(attempts == 0 for n, (_, attempts) in statuses.items() if n not in leased)
    finally:
        relay_engine.dispose()


def test_the_relay_engine_bounds_statements_by_the_lease_on_postgresql(pg_url: str) -> None:
    """PostgreSQL: READ COMMITTED, and the server cancels a statement that outlives
    a lease (``statement_timeout``), added to the options the URL already gives."""
    url = sa.make_url(pg_url).update_query_dict({"options": "-c application_name=mine"})
    settings = fast_settings(url.render_as_string(hide_password=False), "127.0.0.1:1")
    relay_engine = create_engine(replace(settings, lease_ttl=1.2))
    try:
        with relay_engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "2s"
            assert conn.execute(sa.text("SHOW application_name")).scalar_one() == "mine"
            level = conn.execute(sa.text("SHOW transaction_isolation")).scalar_one()
            assert level == "read committed"
            with pytest.raises(sa.exc.OperationalError, match="statement timeout"):
                conn.execute(sa.text("SELECT pg_sleep(5)"))
    finally:
        relay_engine.dispose()


@on_both_databases
def test_backlog_age_is_measured_on_the_database_clock(engine: sa.Engine, outbox: str) -> None:
    add_events(engine, outbox, [Event(topic="t", key="k", payload=b"x") for _ in range(3)])
    t = outbox_table(outbox)
    with engine.begin() as conn:  # the oldest waiting row was written 30 s ago
        first = conn.execute(sa.select(sa.func.min(t.c.id))).scalar_one()
        conn.execute(t.update().where(t.c.id == first).values(created_at=db_time(-30)))
    with engine.connect() as conn:
        counts, age = sample_backlog(conn, outbox)
    assert counts[Status.PENDING] == 3
    assert 29 < age < 90, age


@on_both_databases
def test_a_claimed_row_carries_its_age_on_the_database_clock(
    engine: sa.Engine, outbox: str
) -> None:
    # The relay's enqueue-to-ack latency (outbox_publish_latency_seconds) starts
    # from this age: the server computes it at the claim, so the relay's clock
    # plays no part and a row written 30 s ago is 30 s old.
    add_events(engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"x") for i in range(2)])
    t = outbox_table(outbox)
    with engine.begin() as conn:
        first = conn.execute(sa.select(sa.func.min(t.c.id))).scalar_one()
        conn.execute(t.update().where(t.c.id == first).values(created_at=db_time(-30)))
    batch = claim_batch(engine, outbox, owner="a", shards=range(64), limit=10, lease_ttl=30)
    assert batch is not None
    old, new = batch.rows
    assert 29.9 < old.age_at_claim < 60, old.age_at_claim
    assert 0 <= new.age_at_claim < 10, new.age_at_claim
    later = batch.claimed_mono + 2.5
    assert batch.age(old, later) == pytest.approx(old.age_at_claim + 2.5)


@on_both_databases
def test_later_rows_of_a_key_wait_for_a_retryable_row_until_it_is_due(
    engine: sa.Engine, outbox: str
) -> None:
    add_events(engine, outbox, [Event(topic="t", key="k", payload=f"{i}") for i in range(4)])
    add_events(engine, outbox, [Event(topic="t", key="other", payload=b"o")])
    t = outbox_table(outbox)
    ids = [r.id for r in rows(engine, outbox)]
    with engine.begin() as conn:  # row 2 of key k failed retriably, due in 2 s
        conn.execute(
            t.update()
            .where(t.c.id == ids[1])
            .values(status="retryable", attempts=1, next_attempt_at=db_time(2))
        )
    first = claim_batch(engine, outbox, owner="r", shards=ALL, limit=100, lease_ttl=60)
    assert first is not None
    assert [r.id for r in first.rows] == [ids[0], ids[4]], "k's rows 3 and 4 are held back"
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.id.in_([ids[0], ids[4]])).values(status="delivered"))
    assert claim_batch(engine, outbox, owner="r", shards=ALL, limit=100, lease_ttl=60) is None
    time.sleep(2.1)
    second = claim_batch(engine, outbox, owner="r", shards=ALL, limit=100, lease_ttl=60)
    assert second is not None
    assert [r.id for r in second.rows] == ids[1:4], "due again: the key comes back in order"
    assert [r.attempts for r in second.rows] == [2, 1, 1]


@on_both_databases
def test_expired_lease_is_reclaimed_whole_and_recorded(engine: sa.Engine, outbox: str) -> None:
    add_events(engine, outbox, [Event(topic="t", key="k", payload=f"{i}") for i in range(20)])
    dead = claim_batch(engine, outbox, owner="dead", shards=ALL, limit=100, lease_ttl=0.3)
    assert dead is not None and len(dead) == 20
    assert claim_batch(engine, outbox, owner="alive", shards=ALL, limit=100, lease_ttl=60) is None
    time.sleep(0.4)
    alive = claim_batch(engine, outbox, owner="alive", shards=ALL, limit=100, lease_ttl=60)
    assert alive is not None
    assert [r.id for r in alive.rows] == [r.id for r in dead.rows], "one claim, in id order"
    assert {r.reclaimed_from for r in alive.rows} == {"dead"}
    assert {r.attempts for r in alive.rows} == {2}
    assert alive.token != dead.token
    with engine.connect() as conn:
        (event,) = conn.execute(sa.select(recovery_table())).all()
    assert event.kind == "lease-reclaimed" and event.node_id == "alive"
    assert json.loads(event.detail)["row_ids"] == [r.id for r in dead.rows]


class RecordingOwnership:
    """Owns the shards it is told to; records how the relay uses the contract."""

    def __init__(self, shards: set[int]) -> None:
        self.shards = set(shards)
        self.inflight: Callable[[], frozenset[int]] | None = None
        self.inflight_seen: set[int] = set()
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        self.calls.append("start")
        self.inflight = inflight_shards

    def claimable(self) -> frozenset[int]:
        assert self.inflight is not None
        with self._lock:
            self.inflight_seen |= self.inflight()
            return frozenset(self.shards)

    def release_all(self) -> None:
        self.calls.append("release_all")

    def close(self) -> None:
        self.calls.append("close")


@on_both_databases
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "no-pipeline"])
def test_relay_claims_only_from_shards_its_ownership_allows(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    pipeline: bool,
) -> None:
    topic = kafka_topics(partitions=1)
    keys = [f"key-{i}" for i in range(40)]
    add_events(engine, outbox, [Event(topic=topic, key=k, payload=b"p") for k in keys * 3])
    shard_of = {k: shard_for(k.encode(), "", 8) for k in keys}
    mine = {shard_of[keys[0]]}
    ownership = RecordingOwnership(mine)
    during: list[tuple[frozenset[int], frozenset[int]]] = []

    def look(batch: Batch) -> None:  # what an ownership thread sees mid-batch
        assert ownership.inflight is not None
        during.append((ownership.inflight(), batch.shards))

    relay = embedded(
        fast_settings(db_url, kafka_bootstrap, batch_size=5, pipeline=pipeline),
        ownership=ownership,
        on_batch=look,
    )
    expected = sum(3 for k in keys if shard_of[k] in mine)
    wait_for(
        lambda: relay.metric("outbox_rows_delivered_total") == expected, timeout=20, what="mine"
    )
    time.sleep(0.5)
    delivered = {r.message_key.decode() for r in rows(engine, outbox) if r.status == "delivered"}
    assert {shard_of[k] for k in delivered} == mine, "nothing from shards it does not own"
    assert relay.metric("outbox_shards_owned") == 1
    assert during and all(seen == shards == mine for seen, shards in during)
    if pipeline:  # the next claim runs beside the batch in flight: its shards are held
        assert ownership.inflight_seen <= mine
    else:
        assert not ownership.inflight_seen, "between batches the relay holds no shard"

    with ownership._lock:
        ownership.shards = set()  # owning nothing: no claim at all
    before = relay.metric("outbox_rows_claimed_total")
    time.sleep(0.5)
    assert relay.metric("outbox_rows_claimed_total") == before
    assert relay.stop() == 0
    assert ownership.calls == ["start", "release_all", "close"]


@on_both_databases
def test_a_key_switching_topics_is_cut_at_the_switch(engine: sa.Engine, outbox: str) -> None:
    """Kafka orders nothing across topics: the row to the second topic waits until
    the rows before it are settled, while other keys still fill the batch."""
    add_events(
        engine,
        outbox,
        [
            Event(topic="a", key="k", payload=b"1"),
            Event(topic="a", key="k", payload=b"2"),
            Event(topic="b", key="k", payload=b"3"),
            Event(topic="a", key="k", payload=b"4"),
            Event(topic="b", key="other", payload=b"5"),
        ],
    )
    first = claim_batch(engine, outbox, owner="n1", shards=ALL, limit=10, lease_ttl=30)
    assert first is not None
    assert [r.payload for r in first.rows] == [b"1", b"2", b"5"]
    assert claim_batch(engine, outbox, owner="n1", shards=ALL, limit=10, lease_ttl=30) is None
    t = outbox_table(outbox)
    with engine.begin() as conn:  # the first two are acknowledged
        conn.execute(
            t.update()
            .where(t.c.id.in_([r.id for r in first.rows]))
            .values(status="delivered", lease_owner=None, lease_token=None)
        )
    second = claim_batch(engine, outbox, owner="n1", shards=ALL, limit=10, lease_ttl=30)
    assert second is not None and [r.payload for r in second.rows] == [b"3"]


@on_both_databases
def test_a_paused_topics_row_left_delivering_holds_its_key_after_its_lease_expired(
    engine: sa.Engine, outbox: str
) -> None:
    """A killed relay left the key's first row (topic paused) ``delivering``; once its
    lease expired it is not reclaimed while the topic is paused, and it must still
    hold the key's next row (another topic) back."""
    add_events(
        engine,
        outbox,
        [
            Event(topic="paused", key="k", payload=b"1"),
            Event(topic="t", key="k", payload=b"2"),
            Event(topic="t", key="other", payload=b"o"),
        ],
    )
    dead = claim_batch(engine, outbox, owner="dead", shards=ALL, limit=1, lease_ttl=0.2)
    assert dead is not None and [r.payload for r in dead.rows] == [b"1"]
    time.sleep(0.3)
    kwargs = {"shards": ALL, "limit": 10, "lease_ttl": 30, "shard_count": 8}
    during = claim_batch(engine, outbox, owner="a", excluded_topics={"paused"}, **kwargs)
    assert during is not None
    assert [r.payload for r in during.rows] == [b"o"], "k's second row waits for its first"
    with engine.connect() as conn:
        assert sample_ordering_blocked(conn, outbox, {"paused"}) == 1
    # The probe: the paused topic's row is reclaimed; k's second row still waits
    # for it to be acknowledged (another topic).
    probe = claim_batch(engine, outbox, owner="a", **kwargs)
    assert probe is not None and [r.payload for r in probe.rows] == [b"1"]
    assert probe.rows[0].reclaimed_from == "dead"


@on_both_databases
def test_a_row_with_a_shard_out_of_range_is_claimed_by_its_keys_shard_owner(
    engine: sa.Engine, outbox: str
) -> None:
    """Stored shards 100 and -3 of an 8-shard table: each row belongs to the shard of
    its key's hash, so whoever owns that shard claims it in id order with the key's
    other rows, and the owner of ``100 mod 8`` does not."""
    home = shard_for(b"k", "", 8)
    wrong = next(s for s in range(100, 200) if s % 8 != home)
    first = insert_foreign(engine, outbox, topic="t", key=b"k", payload=b"1", shard=wrong)
    second = insert_foreign(engine, outbox, topic="t", key=b"k", payload=b"2")
    keyless = insert_foreign(engine, outbox, topic="t", key=None, event_id="e-1", shard=-3)
    keyless_home = shard_for(None, "e-1", 8)
    kwargs = {"limit": 10, "lease_ttl": 30, "shard_count": 8}
    others = set(ALL) - {home, keyless_home}
    assert claim_batch(engine, outbox, owner="b", shards=others, **kwargs) is None
    batch = claim_batch(engine, outbox, owner="a", shards={home, keyless_home}, **kwargs)
    assert batch is not None
    assert [r.id for r in batch.rows] == [first, second, keyless]
    by_id = {r.id: r for r in batch.rows}
    assert (by_id[first].shard, by_id[first].misplaced_shard) == (home, wrong)
    assert (by_id[second].shard, by_id[second].misplaced_shard) == (home, None)
    assert (by_id[keyless].shard, by_id[keyless].misplaced_shard) == (keyless_home, -3)
    assert batch.shards == {home, keyless_home}


@on_both_databases
def test_a_delivering_row_without_a_lease_expiry_is_reclaimed_in_key_order(
    engine: sa.Engine, outbox: str
) -> None:
    """Another writer stored ``delivering`` with no ``lease_expires_at``: no lease
    protects it, so it is reclaimed like an expired one, ahead of its key's next row
    (it used to be neither claimed nor holding its key back)."""
    first = insert_foreign(engine, outbox, topic="t", key=b"k", status="delivering")
    second = insert_foreign(engine, outbox, topic="t", key=b"k")
    batch = claim_batch(engine, outbox, owner="a", shards=ALL, limit=10, lease_ttl=30)
    assert batch is not None and [r.id for r in batch.rows] == [first, second]
    assert batch.rows[0].attempts == 1


#: Row states of the generated claims: (status, seconds until due / lease end).
_STATES = [
    ("pending", -1),
    ("retryable", -1),
    ("retryable", 60),
    ("delivering", 60),
    ("delivering", -1),
    ("delivered", 0),
    ("failed", 0),
]


@on_both_databases
def test_an_id_bounded_claim_never_lets_a_key_overtake_itself(
    engine: sa.Engine, outbox: str
) -> None:
    """The pipelined relay's claim beside a leased batch (``id_upper``, with or
    without reclaims): whatever the rows' states, a claimed row has no earlier
    unsettled row of its key left out of the batch, no row past the bound is
    claimed, and without reclaims no ``delivering`` row is."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    t = outbox_table(outbox)
    row = st.tuples(st.sampled_from(["a", "b", "c", None]), st.sampled_from(range(len(_STATES))))

    @settings(
        max_examples=40,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.lists(row, min_size=1, max_size=25),
        st.integers(0, 26),
        st.integers(1, 8),
        st.booleans(),
    )
    # A bound that cut each status on its own (the first n retryable rows, the
    # first n pending rows) would take b's pending row 3 without its retryable row 2.
    @example([("a", 1), ("b", 1), ("b", 0)], 3, 2, True)
    # Without reclaims, a's expired row is left: a's pending row must wait with it.
    @example([("a", 4), ("a", 0), ("b", 0)], 3, 8, False)
    def check(table: list[tuple[str | None, int]], bound: int, limit: int, reclaim: bool) -> None:
        with engine.begin() as conn:
            conn.execute(t.delete())
        add_events(engine, outbox, [Event(topic="t", key=k, payload=b"x") for k, _ in table])
        ids = [r.id for r in rows(engine, outbox)]
        with engine.begin() as conn:
            for row_id, (_, state) in zip(ids, table, strict=True):
                status, seconds = _STATES[state]
                conn.execute(
                    t.update()
                    .where(t.c.id == row_id)
                    .values(
                        status=status,
                        lease_token="x",
                        lease_owner="o",
                        next_attempt_at=db_time(seconds),
                        lease_expires_at=db_time(seconds),
                    )
                )
        id_upper = ids[0] - 1 + bound
        batch = claim_batch(
            engine,
            outbox,
            owner="r",
            shards=ALL,
            limit=limit,
            lease_ttl=60,
            id_upper=id_upper,
            reclaim=reclaim,
        )
        claimed = {r.id for r in batch.rows} if batch is not None else set()
        assert all(i <= id_upper for i in claimed), "nothing past the bound"
        assert len(claimed) <= limit
        state_of = dict(zip(ids, (state for _, state in table), strict=True))
        assert reclaim or not any(_STATES[state_of[i]][0] == "delivering" for i in claimed), (
            "a claim without reclaims took a delivering row"
        )
        for row_id, (key, _) in zip(ids, table, strict=True):
            if row_id not in claimed or key is None:
                continue
            for other_id, (other_key, state) in zip(ids, table, strict=True):
                if other_id >= row_id or other_key != key:
                    continue
                settled = _STATES[state][0] in ("delivered", "failed")
                assert settled or other_id in claimed, (
                    f"row {row_id} of key {key} claimed, its earlier row {other_id} "
                    f"({_STATES[state]}) left out"
                )

    check()


def _set_row(engine: sa.Engine, outbox: str, row_id: int, **values: Any) -> None:
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == row_id).values(**values))


@on_both_databases
def test_a_failed_row_holds_its_keys_later_rows_until_requeued_or_discarded(
    engine: sa.Engine, outbox: str
) -> None:
    """``--failed-rows hold`` (the default): no later row of a failed row's key is
    claimed, by any claimer, until the row is requeued (then it goes first) or
    discarded (deleted); other keys go on. ``skip`` claims them past it."""
    add_events(engine, outbox, [Event(topic="t", key=k, payload=b"x") for k in "aabaab"])
    ids = [r.id for r in rows(engine, outbox)]  # a: 0 1 3 4, b: 2 5
    _set_row(engine, outbox, ids[1], status="failed", attempts=10, last_error="too large")
    _set_row(engine, outbox, ids[0], status="delivered")
    claim = dict(shards=ALL, limit=100, lease_ttl=60)
    held = claim_batch(engine, outbox, owner="one", **claim)
    assert held is not None
    assert [r.id for r in held.rows] == [ids[2], ids[5]], "a's rows 3 and 4 wait behind 1"
    assert claim_batch(engine, outbox, owner="two", **claim) is None
    with engine.connect() as conn:
        assert sample_keys_held_by_failed(conn, outbox) == 1
        assert sample_ordering_blocked(conn, outbox) == 2
        assert sample_ordering_blocked(conn, outbox, failed_holds=False) == 0
    skipped = claim_batch(engine, outbox, owner="two", failed_holds=False, **claim)
    assert skipped is not None and [r.id for r in skipped.rows] == [ids[3], ids[4]]
    _set_row(engine, outbox, ids[3], status="pending", lease_owner=None, lease_token=None)
    _set_row(engine, outbox, ids[4], status="pending", lease_owner=None, lease_token=None)

    requeue(engine, table=outbox, selection=Selection(ids=(ids[1],)))
    again = claim_batch(engine, outbox, owner="two", **claim)
    assert again is not None
    assert [r.id for r in again.rows] == [ids[1], ids[3], ids[4]], "the requeued row first"
    with engine.connect() as conn:
        assert sample_keys_held_by_failed(conn, outbox) == 0

    # Discarded: the row is gone and holds nothing.
    _set_row(engine, outbox, ids[1], status="failed", lease_owner=None, lease_token=None)
    _set_row(engine, outbox, ids[3], status="pending", lease_owner=None, lease_token=None)
    _set_row(engine, outbox, ids[4], status="pending", lease_owner=None, lease_token=None)
    assert claim_batch(engine, outbox, owner="two", **claim) is None
    discard(engine, table=outbox, selection=Selection(ids=(ids[1],)))
    after = claim_batch(engine, outbox, owner="two", **claim)
    assert after is not None and [r.id for r in after.rows] == [ids[3], ids[4]]


@on_both_databases
def test_a_pending_row_not_yet_due_holds_its_keys_later_rows(
    engine: sa.Engine, outbox: str
) -> None:
    """A ``pending`` row whose ``next_attempt_at`` is ahead (another writer's
    scheduled row, a database clock stepped back) holds its key's later, due
    rows like a retryable row not yet due; behind many due rows too."""
    events = [Event(topic="t", key=f"d{i}", payload=b"x") for i in range(30)]
    events += [Event(topic="t", key=k, payload=b"x") for k in "kkok"]
    add_events(engine, outbox, events)
    ids = [r.id for r in rows(engine, outbox)]
    k0, k1, other, k2 = ids[30:]
    _set_row(engine, outbox, k1, next_attempt_at=db_time(2))
    claim = dict(shards=ALL, limit=100, lease_ttl=60)
    first = claim_batch(engine, outbox, owner="one", **claim)
    assert first is not None
    assert [r.id for r in first.rows] == [*ids[:30], k0, other], "k's last row waits"
    assert claim_batch(engine, outbox, owner="two", **claim) is None
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.id.not_in([k1, k2])).values(status="delivered"))
    wait_for(
        lambda: claim_batch(engine, outbox, owner="two", **claim),
        timeout=10,
        what="k's rows once due",
    )
    assert [r.status for r in rows(engine, outbox) if r.id in (k1, k2)] == ["delivering"] * 2
