"""``outboxkit schema apply|sql`` on a real database.

Tests marked ``on_both_databases`` run on MariaDB and on PostgreSQL; the upgrade
of release-1 tables (collations) is MariaDB/MySQL only.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases
from support.waiting import wait_for

import outboxkit
from outboxkit import Event, enqueue_many
from outboxkit.errors import SchemaError
from outboxkit.relay.claim import claim_batch
from outboxkit.schema import (
    apply_schema,
    inbox_table,
    meta_table,
    outbox_table,
    read_shard_count,
    recovery_table,
    schema_sql,
)

pytestmark = pytest.mark.integration


def cli(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxkit", "schema", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def table_shape(engine: sa.Engine) -> tuple[list[str], list[str]]:
    insp = sa.inspect(engine)
    cols = [c["name"] for c in insp.get_columns("outbox_events")]
    idx = sorted(str(i["name"]) for i in insp.get_indexes("outbox_events"))
    return cols, idx


@on_both_databases
def test_apply_twice_is_idempotent(engine: sa.Engine, db_url: str) -> None:
    first = cli("apply", "--db-url", db_url, "--shards", "16")
    assert first.returncode == 0, first.stderr
    assert "created table outbox_events" in first.stdout
    second = cli("apply", "--db-url", db_url, "--shards", "16")
    assert second.returncode == 0, second.stderr
    assert "schema up to date" in second.stdout
    cols, idx = table_shape(engine)
    assert cols == [c.name for c in outbox_table().columns]
    assert {"ix_outbox_events_status_id", "ix_outbox_events_key_status"} <= set(idx)
    with engine.connect() as conn:
        assert read_shard_count(conn, "outbox_events") == 16
        assert sa.inspect(conn).has_table("outbox_inbox")


@on_both_databases
def test_concurrent_apply_from_three_processes(engine: sa.Engine, db_url: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outboxkit", "schema", "apply", "--db-url", db_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], results
    created = [r for r in results if "created table outbox_events" in r[1]]
    assert len(created) == 1, results  # one created, the other found it in place
    with engine.connect() as conn:
        assert read_shard_count(conn, "outbox_events") == 64
        n = conn.execute(sa.text("SELECT COUNT(*) FROM outboxkit_meta")).scalar()
    assert n == 1


@on_both_databases
def test_apply_waits_for_the_schema_lock_and_gives_up_naming_it(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process applying holds the lock: apply waits, then fails cleanly."""
    from outboxkit.schema import apply as apply_module

    monkeypatch.setattr(apply_module, "_LOCK_TIMEOUT_S", 1)
    with engine.connect() as holder, apply_module._schema_lock(holder):
        with pytest.raises(SchemaError, match="could not take the schema lock within 1 s"):
            apply_schema(engine, shards=4)
        assert not sa.inspect(engine).has_table("outbox_events")  # nothing done without it
    assert apply_schema(engine, shards=4).shard_count == 4  # released: apply goes through


@on_both_databases
def test_shard_count_is_fixed_at_creation(engine: sa.Engine) -> None:
    assert apply_schema(engine, shards=4).shard_count == 4
    assert apply_schema(engine, shards=32).shard_count == 4


@on_both_databases
def test_upgrade_adds_a_missing_column_and_index(engine: sa.Engine) -> None:
    apply_schema(engine, shards=4)
    [index] = [i for i in outbox_table().indexes if i.name == "ix_outbox_events_key_status"]
    with engine.begin() as conn:
        conn.execute(sa.schema.DropIndex(index))
        conn.execute(sa.text("ALTER TABLE outbox_events DROP COLUMN kafka_offset"))
    report = apply_schema(engine, shards=4)
    assert "added column outbox_events.kafka_offset" in report.actions
    assert "added index ix_outbox_events_key_status" in report.actions
    cols, idx = table_shape(engine)
    assert "kafka_offset" in cols and "ix_outbox_events_key_status" in idx


def _session_lock_bound(conn: sa.Connection) -> tuple[str, str]:
    """The session's wait for a table lock, and the server's default for it."""
    if conn.dialect.name == "postgresql":
        row = conn.execute(
            sa.text("SELECT setting, reset_val FROM pg_settings WHERE name = 'lock_timeout'")
        ).one()
    else:
        row = conn.execute(
            sa.text("SELECT @@SESSION.lock_wait_timeout, @@GLOBAL.lock_wait_timeout")
        ).one()
    return str(row[0]), str(row[1])


def _upgrade_to_do(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, *, table_lock_timeout_s: int
) -> sa.Engine:
    """An applied schema missing a column (the next apply adds it with an ALTER
    TABLE), apply's bound on table locks set, and an engine of one connection
    for apply to run on."""
    from outboxkit.schema import apply as apply_module

    apply_schema(engine, shards=4)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_events DROP COLUMN kafka_offset"))
    monkeypatch.setattr(apply_module, "_TABLE_LOCK_TIMEOUT_S", table_lock_timeout_s)
    return sa.create_engine(engine.url, pool_size=1, max_overflow=0)


@on_both_databases
def test_an_upgrade_waits_for_a_busy_table_only_so_long_and_says_so(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade's ``ALTER TABLE`` on a table another session holds (a transaction
    that read it and stays open) waits at most the bound, then ``apply`` fails
    naming the table; once that session is done, ``apply`` goes through. The
    bound is reset before the connection goes back to the pool. Before, the
    statement waited as long as the other transaction lasted (MariaDB: up to
    ``lock_wait_timeout``, a day; PostgreSQL: for ever)."""
    own = _upgrade_to_do(engine, monkeypatch, table_lock_timeout_s=1)
    try:
        with engine.connect() as holder, ThreadPoolExecutor(1) as pool:
            holder.execute(sa.text("SELECT COUNT(*) FROM outbox_events")).one()
            waiting = pool.submit(apply_schema, own, shards=4)
            try:
                error = waiting.exception(timeout=60)
            except TimeoutError:
                holder.rollback()  # let the waiting statement finish
                pytest.fail("apply still waited for the table after 60 s")
            assert isinstance(error, SchemaError), error
            assert str(error) == (
                "could not lock table outbox_events within 1 s to change it: another session "
                "holds it (a long transaction; on PostgreSQL also a VACUUM run to prevent "
                "wraparound, which does not give way). Done before: nothing. Run `outboxkit "
                "schema apply` again once it is over"
            )
        assert "kafka_offset" not in table_shape(engine)[0]
        with own.connect() as conn:
            session, default = _session_lock_bound(conn)
            assert session == default
        report = apply_schema(own, shards=4)
        assert report.actions == ["added column outbox_events.kafka_offset"]
    finally:
        own.dispose()


def _session_id(conn: sa.Connection) -> int:
    query = (
        "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    )
    return int(conn.execute(sa.text(query)).scalar_one())


def _waits_for_a_lock(conn: sa.Connection, session: int) -> bool:
    if conn.dialect.name == "postgresql":
        query = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :s"
    else:
        query = (
            "SELECT state LIKE 'Waiting for table metadata lock%' "
            "FROM information_schema.processlist WHERE id = :s"
        )
    return bool(conn.execute(sa.text(query), {"s": session}).scalar())


@on_both_databases
def test_a_session_killed_while_apply_waits_for_a_table_shows_its_own_error(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If apply's session dies while its ``ALTER TABLE`` waits for the table (an
    operator kills it), the error apply raises is that statement's, not one from
    the clean-up that resets the lock bound and releases the schema lock (those
    run on a new session: the pool replaces the dead one), and the next apply
    goes through: the server dropped the dead session's locks."""
    own = _upgrade_to_do(engine, monkeypatch, table_lock_timeout_s=60)
    try:
        with own.connect() as conn:
            session = _session_id(conn)
        with engine.connect() as holder, ThreadPoolExecutor(1) as pool:
            holder.execute(sa.text("SELECT COUNT(*) FROM outbox_events")).one()
            waiting = pool.submit(apply_schema, own, shards=4)
            with engine.connect() as watcher:
                wait_for(
                    lambda: waiting.done() or _waits_for_a_lock(watcher, session),
                    timeout=10,
                    what="apply to wait for the table",
                )
                assert not waiting.done(), waiting.exception()
                kill = (
                    "SELECT pg_terminate_backend(:s)"
                    if engine.dialect.name == "postgresql"
                    else "KILL CONNECTION :s"
                )
                watcher.execute(sa.text(kill), {"s": session})
                watcher.commit()
            error = waiting.exception(timeout=60)
            holder.rollback()
        assert isinstance(error, sa.exc.OperationalError), repr(error)
        assert error.statement is not None and error.statement.startswith("ALTER TABLE"), error
        report = apply_schema(own, shards=4)
        assert report.actions == ["added column outbox_events.kafka_offset"]
    finally:
        own.dispose()


@on_both_databases
def test_custom_table_name(engine: sa.Engine, db_url: str) -> None:
    ok = cli("apply", "--db-url", db_url, "--table", "orders_outbox", "--shards", "2")
    assert ok.returncode == 0, ok.stderr
    assert sa.inspect(engine).has_table("orders_outbox")
    with engine.connect() as conn:
        assert read_shard_count(conn, "orders_outbox") == 2


def test_bad_names_exit_2(db_url: str) -> None:
    bad = cli("apply", "--db-url", db_url, "--table", "x; DROP TABLE y")
    assert bad.returncode == 2
    assert "invalid table name" in bad.stderr
    bad_shards = cli("apply", "--db-url", db_url, "--shards", "0")
    assert bad_shards.returncode == 2
    assert "shard count" in bad_shards.stderr


@pytest.mark.parametrize("server", ["db_server_url", "pg_server_url"])
def test_unreachable_database_exits_3_without_password(
    server: str, request: pytest.FixtureRequest
) -> None:
    url = sa.make_url(request.getfixturevalue(server)).set(port=1, password="hunter2-secret")
    res = cli("apply", "--db-url", url.render_as_string(hide_password=False))
    assert res.returncode == 3
    assert "hunter2-secret" not in res.stderr + res.stdout
    assert "cannot reach" in res.stderr
    # The driver's own words, not only its class name.
    assert "Connection refused" in res.stderr or "Can't connect" in res.stderr, res.stderr


@pytest.mark.parametrize("server", ["db_server_url", "pg_server_url"])
def test_a_database_that_does_not_exist_exits_2_naming_the_fix(
    server: str, request: pytest.FixtureRequest
) -> None:
    """On main: "cannot reach ...: OperationalError", exit 3, as for a server that
    is down, though the server answered that the database does not exist."""
    url = sa.make_url(request.getfixturevalue(server)).set(database="okt_no_such_database")
    res = cli("apply", "--db-url", url.render_as_string(hide_password=False))
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(
        "outboxkit schema apply: invalid --db-url / OUTBOXKIT_DB_URL: database "
        f"'okt_no_such_database' does not exist on {url.host}:{url.port} ("
    ), res.stderr
    assert "create it (CREATE DATABASE okt_no_such_database)" in res.stderr
    # The driver's own words: MySQL/MariaDB's error 1049, PostgreSQL's FATAL line.
    assert "Unknown database 'okt_no_such_database'" in res.stderr or (
        'FATAL: database "okt_no_such_database" does not exist' in res.stderr
    ), res.stderr


@pytest.mark.parametrize("server", ["db_server_url", "pg_server_url"])
def test_a_wrong_password_exits_2_naming_the_fix_without_the_password(
    server: str, request: pytest.FixtureRequest
) -> None:
    """On main: "cannot reach ...: OperationalError", exit 3."""
    url = sa.make_url(request.getfixturevalue(server)).set(password="Wr0ng-Hunter2-pw")
    res = cli("apply", "--db-url", url.render_as_string(hide_password=False))
    assert res.returncode == 2, res.stderr
    assert (
        "invalid --db-url / OUTBOXKIT_DB_URL: the server at "
        f"{url.host}:{url.port} refused the login of user '{url.username}'"
    ) in res.stderr, res.stderr
    assert "correct the user and password in the URL" in res.stderr
    assert "Access denied for user" in res.stderr or (
        "password authentication failed" in res.stderr
    ), res.stderr
    assert "Wr0ng-Hunter2-pw" not in res.stderr + res.stdout


def test_missing_db_url_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOXKIT_DB_URL", raising=False)
    res = cli("apply")
    assert res.returncode == 2
    assert "OUTBOXKIT_DB_URL" in res.stderr


@pytest.mark.unit
def test_schema_sql_prints_ddl_for_each_dialect() -> None:
    mysql = schema_sql("mysql")
    assert "CREATE TABLE IF NOT EXISTS outbox_events" in mysql
    exact = "VARCHAR(64) CHARACTER SET utf8mb4 COLLATE {} NOT NULL"
    assert f"event_id {exact.format('utf8mb4_0900_bin')}" in mysql
    assert f"event_id {exact.format('utf8mb4_nopad_bin')}" in schema_sql("mariadb")
    assert "ENUM('pending','delivering','delivered','retryable','failed')" in mysql
    assert "DATETIME(6)" in mysql
    assert "CREATE INDEX ix_outbox_events_status_id ON outbox_events (status, id)" in mysql
    pg = schema_sql("postgresql")
    assert "BYTEA" in pg and "CREATE INDEX IF NOT EXISTS" in pg
    # the status type first, and a second run of the script does not trip on it
    assert pg.startswith("DO $$ BEGIN CREATE TYPE outbox_status AS ENUM ('pending', ")
    assert "EXCEPTION WHEN duplicate_object THEN NULL" in pg
    res = cli("sql", "--dialect", "mariadb")
    assert res.returncode == 0 and "outbox_inbox" in res.stdout


@pytest.mark.unit
def test_sqlite_round_trip(tmp_path: object) -> None:
    """The same definition works on SQLite (embedded, single relay)."""
    import outboxkit

    eng = sa.create_engine(f"sqlite:///{tmp_path}/o.db")
    apply_schema(eng, shards=4)
    with eng.begin() as conn:
        outboxkit.enqueue(conn, topic="t", payload={"a": 1}, key="k")
    with eng.connect() as conn:
        row = conn.execute(sa.select(outbox_table())).one()
    assert row.status == "pending" and row.payload == b'{"a":1}'
    eng.dispose()


@on_both_databases
def test_recovery_log_is_bounded(engine: sa.Engine) -> None:
    from outboxkit.schema import record_recovery, recovery_table, trim_recovery

    apply_schema(engine, shards=2)
    with engine.begin() as conn:
        for i in range(30):
            record_recovery(
                conn,
                kind="lease-reclaimed",
                node_id="n1",
                table="outbox_events",
                detail={"ids": [i]},
                keep=10_000,
            )
        assert trim_recovery(conn, keep=10) == 20
        kept = conn.execute(sa.select(recovery_table().c.detail)).scalars().all()
    assert kept[0] == '{"ids":[20]}' and len(kept) == 10


# -- upgrading tables made by an older release ------------------------------------------

OLD_DDL = Path(__file__).parent / "data" / "schema_v1_mariadb.sql"
META = meta_table.name


def _identifier_columns() -> dict[str, list[str]]:
    """The columns that hold identifiers, so compare byte for byte."""
    return {
        meta_table.name: ["table_name"],
        recovery_table().name: ["kind", "node_id", "table_name"],
        outbox_table().name: ["event_id", "topic", "lease_owner", "lease_token"],
        inbox_table().name: ["group_id", "event_id", "topic"],
    }


def _collations(engine: sa.Engine) -> dict[tuple[str, str], str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA = DATABASE() AND COLLATION_NAME IS NOT NULL"
            )
        ).all()
    return {(r[0], r[1]): r[2] for r in rows}


def _dump(engine: sa.Engine) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every table (the meta table without its schema version)."""
    with engine.connect() as conn:
        return {
            name: [
                tuple(r)
                for r in conn.execute(
                    sa.text(
                        f"SELECT {'table_name, shard_count, created_at' if name == META else '*'} "
                        f"FROM {name} ORDER BY 1, 2"
                    )
                )
            ]
            for name in _identifier_columns()
        }


def _binary_collation(engine: sa.Engine) -> str:
    """MariaDB's and MySQL's names for the binary NO PAD utf8mb4 collation."""
    with engine.connect() as conn:
        version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
    return "utf8mb4_nopad_bin" if "mariadb" in version.lower() else "utf8mb4_0900_bin"


def _create_v1_tables_with_rows(engine: sa.Engine) -> None:
    """The tables exactly as release 1 created them (its DDL, saved), with rows in them."""
    with engine.begin() as conn:
        for statement in OLD_DDL.read_text().split(";\n"):
            if statement.strip():  # MySQL 8 has no CREATE INDEX IF NOT EXISTS
                conn.execute(sa.text(statement.replace("INDEX IF NOT EXISTS", "INDEX")))
        conn.execute(
            sa.text("INSERT INTO outboxkit_meta VALUES ('outbox_events', 8, 1, UTC_TIMESTAMP(6))")
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_events (event_id, topic, message_key, payload, headers, "
                "shard, status, attempts, next_attempt_at, lease_owner, lease_token, "
                "created_at, updated_at) VALUES "
                "('order-1', 'orders', 'k', 'p1', NULL, 1, 'pending', 0, UTC_TIMESTAMP(6), "
                "NULL, NULL, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)), "
                "('Café-2', 'ORDERS', NULL, 'p2', '{\"a\":\"b\"}', 2, 'delivering', 1, "
                "UTC_TIMESTAMP(6), 'relay-a', 'ab12', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_inbox VALUES "
                "('billing', 'ev-1', 'orders', 0, 5, UTC_TIMESTAMP(6)), "
                "('billing', 'orders/0/6', 'orders', 0, 6, UTC_TIMESTAMP(6))"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outboxkit_recovery_events (at, kind, node_id, table_name, detail) "
                "VALUES (UTC_TIMESTAMP(6), 'requeue', 'admin@h', 'outbox_events', '{}')"
            )
        )


def test_apply_upgrades_release_1_tables_to_byte_exact_identifiers(
    engine: sa.Engine, db_url: str
) -> None:
    _create_v1_tables_with_rows(engine)
    before = _dump(engine)
    old = _collations(engine)
    expected = _identifier_columns()

    first = cli("apply", "--db-url", db_url, "--shards", "8")

    assert first.returncode == 0, first.stderr
    changed = [line for line in first.stdout.splitlines() if line.startswith("changed column")]
    binary = _binary_collation(engine)
    assert sorted(changed) == sorted(
        f"changed column {t}.{c}: collation {old[(t, c)]} -> {binary}"
        for t, columns in expected.items()
        for c in columns
    ), first.stdout
    assert "schema version of outbox_events -> 3" in first.stdout
    assert "column outbox_events.payload takes NULL" in first.stdout
    assert "created table outbox_events_payload" in first.stdout
    now = _collations(engine)
    for t, columns in expected.items():
        for c in columns:
            assert now[(t, c)] == binary, (t, c)
    assert _dump(engine) == before  # every row kept, every value unchanged
    with engine.begin() as conn:  # and ids that differ only in case are now two events
        conn.execute(
            sa.text(
                "INSERT INTO outbox_inbox VALUES ('billing', 'EV-1', 'orders', 0, 7, "
                "UTC_TIMESTAMP(6)), ('BILLING', 'ev-1', 'orders', 0, 5, UTC_TIMESTAMP(6))"
            )
        )

    second = cli("apply", "--db-url", db_url, "--shards", "8")
    assert second.returncode == 0, second.stderr
    assert "schema up to date" in second.stdout, second.stdout


def test_an_upgrade_that_times_out_on_a_table_lock_reports_only_what_it_changed(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release-1 tables to upgrade while another session holds outbox_events: the
    tables before it are changed, its own ALTER gives up after the bound. On main
    the message's "Done before" also listed every "changed column outbox_events.…"
    of that ALTER, which never ran: they were recorded before it."""
    from outboxkit.schema import apply as apply_module

    _create_v1_tables_with_rows(engine)
    old = _collations(engine)
    monkeypatch.setattr(apply_module, "_TABLE_LOCK_TIMEOUT_S", 1)
    own = sa.create_engine(engine.url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("SELECT COUNT(*) FROM outbox_events")).one()  # holds it
            with pytest.raises(SchemaError) as caught:
                apply_schema(own, shards=8)
            holder.rollback()
    finally:
        own.dispose()
    message = str(caught.value)
    assert message.startswith("could not lock table outbox_events within 1 s"), message
    done = message.split("Done before: ", 1)[1].split(". Run `outboxkit", 1)[0].split("; ")
    now = _collations(engine)
    changed = [
        f"changed column {t}.{c}: collation {old[(t, c)]} -> {now[(t, c)]}"
        for (t, c) in old
        if now[(t, c)] != old[(t, c)]
    ]
    assert changed, "the tables before outbox_events were to be changed"
    assert sorted(x for x in done if x.startswith("changed column")) == sorted(changed)
    assert not [x for x in done if "outbox_events." in x], message


def test_concurrent_upgrade_from_two_processes_changes_once(engine: sa.Engine, db_url: str) -> None:
    _create_v1_tables_with_rows(engine)
    before = _dump(engine)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outboxkit", "schema", "apply", "--db-url", db_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [r[0] for r in results] == [0, 0], results
    outputs = sorted(r[1] for r in results)
    assert "schema up to date" in outputs[1], results  # the second found it done
    assert "changed column outbox_events.topic" in outputs[0], results
    assert _dump(engine) == before


def _reloptions(engine: sa.Engine, table: str) -> dict[str, str]:
    with engine.connect() as conn:
        options = conn.execute(
            sa.text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"), {"t": table}
        ).scalar()
    return dict(o.split("=", 1) for o in options or ())


def test_the_postgresql_outbox_is_vacuumed_by_dead_rows_not_by_its_size(pg_url: str) -> None:
    """Every status change leaves a dead row version that the claim's scans step
    over until VACUUM: ``schema apply`` creates the outbox with autovacuum
    settings for a queue, adds them to a table made without them, and keeps a
    value an operator set."""
    engine = sa.create_engine(pg_url)
    wanted = {"autovacuum_vacuum_scale_factor": "0", "autovacuum_vacuum_threshold": "20000",
              "autovacuum_vacuum_cost_delay": "0"}  # fmt: skip
    try:
        apply_schema(engine, table="vac_outbox", shards=4)
        assert _reloptions(engine, "vac_outbox") == wanted
        assert _reloptions(engine, "outbox_inbox") == {}  # inserts, few updates
        with engine.begin() as conn:  # as a table of an earlier release, tuned by hand
            conn.execute(sa.text("ALTER TABLE vac_outbox RESET (autovacuum_vacuum_scale_factor, "
                                 "autovacuum_vacuum_cost_delay)"))  # fmt: skip
            conn.execute(sa.text("ALTER TABLE vac_outbox SET (autovacuum_vacuum_threshold = 500)"))
        report = apply_schema(engine, table="vac_outbox", shards=4)
        assert report.actions == [
            "set autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_cost_delay = 0 on vac_outbox"
        ]
        assert _reloptions(engine, "vac_outbox") == {**wanted, "autovacuum_vacuum_threshold": "500"}
        assert apply_schema(engine, table="vac_outbox", shards=4).actions == []
    finally:
        engine.dispose()


def _swap_statements(table: str) -> list[str]:
    """The online swap of docs/postgresql.md's "A partial key index", as written."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "postgresql.md").read_text()
    section = page[page.index("\n## A partial key index") :]
    block = re.search(r"^```sql\n(.*?)^```", section, re.S | re.M)
    assert block is not None
    return [line.replace("outbox_events", table) for line in block[1].splitlines() if line]


def _index_entries(engine: sa.Engine, table: str) -> dict[str, int]:
    """Entries of each index of ``table`` once VACUUM has counted them."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM {table}"))
        rows = conn.execute(
            sa.text("SELECT c.relname, c.reltuples FROM pg_index i JOIN pg_class c"
                    " ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass(:t)"),
            {"t": table},
        ).all()  # fmt: skip
    return {str(name): int(n) for name, n in rows}


def test_the_postgresql_key_index_leaves_delivered_rows_out(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On PostgreSQL marking a row delivered adds no entry to the per-key index,
    which holds the backlog, not the history. A table of an earlier release keeps
    its whole index (an apply drops none) with a warning, until the online swap
    of docs/postgresql.md, run here as written, makes it partial."""
    engine = sa.create_engine(pg_url)
    table, index = "pk_outbox", "ix_pk_outbox_key_status"
    try:
        apply_schema(engine, table=table, shards=4)
        with engine.begin() as conn:
            enqueue_many(
                conn, [Event(topic="t", key=f"k{i % 30}", payload=b"x") for i in range(300)],
                table=table,
            )  # fmt: skip
        t = outbox_table(table)
        with engine.begin() as conn:
            conn.execute(t.update().where(t.c.id <= 200).values(status="delivered"))
        entries = _index_entries(engine, table)
        assert entries[index] == 100, entries  # the backlog
        assert entries[f"ix_{table}_status_id"] == 300, entries  # whole: the purge reads it
        with engine.begin() as conn:  # as an earlier release made it
            conn.execute(sa.text(f"DROP INDEX {index}"))
            conn.execute(sa.text(f"CREATE INDEX {index} ON {table} (message_key, status, id)"))
        assert _index_entries(engine, table)[index] == 300
        # The relay works with the whole index: it claims the 100 undelivered rows.
        batch = claim_batch(engine, table, owner="a", shards=range(4), limit=100, lease_ttl=30,
                            shard_count=4)  # fmt: skip
        assert batch is not None and sorted(r.id for r in batch.rows) == list(range(201, 301))
        with caplog.at_level(logging.WARNING, logger="outboxkit.schema"):
            assert apply_schema(engine, table=table, shards=4).actions == []
        assert [r.getMessage() for r in caplog.records] == [
            f"index {index} of {table} also holds delivered rows; outboxkit 0.2.0 and later "
            "make it partial, which writes less per delivered row: see 'A partial key index' in "
            "docs/postgresql.md to swap it online"
        ]
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for statement in _swap_statements(table):
                conn.exec_driver_sql(statement)
        assert _index_entries(engine, table)[index] == 100
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="outboxkit.schema"):
            assert apply_schema(engine, table=table, shards=4).actions == []
        assert caplog.records == []
    finally:
        engine.dispose()


def test_setting_the_vacuum_parameters_gives_up_on_a_running_vacuum(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting the outbox's autovacuum parameters on an upgraded table needs the
    lock a VACUUM holds; an autovacuum run to prevent wraparound does not give
    it up. ``apply`` waits at most the bound (here a session holds the lock as
    VACUUM does), and the table's writers never wait: the lock leaves them be."""
    from outboxkit.schema import apply as apply_module

    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, table="vac_busy", shards=4)
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE vac_busy RESET (autovacuum_vacuum_threshold)"))
        monkeypatch.setattr(apply_module, "_TABLE_LOCK_TIMEOUT_S", 1)
        with engine.connect() as vacuum, ThreadPoolExecutor(1) as pool:
            vacuum.execute(sa.text("LOCK TABLE vac_busy IN SHARE UPDATE EXCLUSIVE MODE"))
            waiting = pool.submit(apply_schema, engine, table="vac_busy", shards=4)
            with engine.begin() as writer:  # not blocked by the lock, nor by apply's wait
                writer.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
                outboxkit.enqueue(writer, topic="t", payload=b"{}", key="k", table="vac_busy")
            try:
                error = waiting.exception(timeout=60)
            except TimeoutError:
                vacuum.rollback()
                pytest.fail("apply still waited for the table after 60 s")
            assert isinstance(error, SchemaError), error
            assert "could not lock table vac_busy within 1 s" in str(error)
        report = apply_schema(engine, table="vac_busy", shards=4)
        assert report.actions == ["set autovacuum_vacuum_threshold = 20000 on vac_busy"]
    finally:
        engine.dispose()


def test_printed_postgresql_ddl_runs_twice(pg_url: str) -> None:
    """``schema sql --dialect postgresql`` is a script an operator can run, and run again."""
    engine = sa.create_engine(pg_url)
    ddl = schema_sql("postgresql", table="printed_outbox")
    try:
        for _ in range(2):
            with engine.begin() as conn:
                for statement in ddl.split(";\n\n"):
                    conn.exec_driver_sql(statement.strip().rstrip(";"))
        insp = sa.inspect(engine)
        assert insp.has_table("printed_outbox") and insp.has_table("outbox_inbox")
        assert {str(i.name) for i in outbox_table("printed_outbox").indexes} <= {
            i["name"] for i in insp.get_indexes("printed_outbox")
        }
        with engine.connect() as conn:  # the claim's CRC-32 function, as zlib's
            crc = conn.execute(sa.text("SELECT outboxkit_crc32(CAST('key-1' AS bytea))"))
            assert crc.scalar_one() == zlib.crc32(b"key-1")
    finally:
        engine.dispose()


@on_both_databases
def test_a_table_name_too_long_for_its_index_names_is_refused_before_anything(
    engine: sa.Engine, db_url: str, request: pytest.FixtureRequest
) -> None:
    """Index names are ``ix_<table>_key_status``: they, not the table, hit the limit first.

    MySQL/MariaDB allow 64 characters per identifier, PostgreSQL 63, so the
    longest table name is 50 there and 49 here; one more is refused with the
    limit named (exit 2), before any table is created.
    """
    longest = {"mariadb": 50, "postgresql": 49}[request.node.callspec.params["db_url"]]
    too_long = cli("apply", "--db-url", db_url, "--table", "t" * (longest + 1), "--shards", "2")
    assert too_long.returncode == 2, too_long.stderr
    assert f"at most {longest} characters" in too_long.stderr, too_long.stderr
    assert "Traceback" not in too_long.stderr
    assert sa.inspect(engine).get_table_names() == []
    report = apply_schema(engine, table="t" * longest, shards=2, inbox=None)
    assert report.shard_count == 2 and sa.inspect(engine).has_table("t" * longest)
