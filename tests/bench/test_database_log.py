"""The benchmark's replication-log meter (``bench/dblog.py``): what a phase adds
to MariaDB's binary log, with the binary log on as production runs it (row
format, full row images: ``mariadb.sh --binlog on``), or to PostgreSQL's WAL;
with the binary log off it says there is no log (None), never 0 bytes."""

from __future__ import annotations

import secrets
import shutil
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from support.services import MariaDBInstance, PostgresInstance, free_port

from bench.dblog import LogMeter, log_bytes, log_settings, purge_old_logs

pytestmark = pytest.mark.integration

ROWS, PAYLOAD = 100, 2_000


@pytest.fixture
def binlog_mariadb() -> Iterator[sa.Engine]:
    db = MariaDBInstance(f"binlog-{uuid.uuid4().hex[:6]}", free_port(), binlog=True)
    db.start(fresh=True)
    engine = sa.create_engine(db.url)
    try:
        yield engine
    finally:
        engine.dispose()
        db.stop()
        shutil.rmtree(db.state_dir, ignore_errors=True)


def _phase(engine: sa.Engine, table: str) -> tuple[int | None, int | None]:
    """Bytes logged by inserting ROWS rows (random payloads: nothing compresses
    them), then by changing one small column of each."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        conn.execute(
            sa.text(f"CREATE TABLE {table} (id INT PRIMARY KEY, state INT NOT NULL, p TEXT)")
        )
    inserted = LogMeter(engine).begin()
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} VALUES (:id, 0, :p)"),
            [{"id": i, "p": secrets.token_hex(PAYLOAD // 2)} for i in range(ROWS)],
        )
    insert_bytes = inserted.bytes()
    updated = LogMeter(engine).begin()
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {table} SET state = 1"))
    update_bytes = updated.bytes()
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table}"))
    return insert_bytes, update_bytes


def test_binary_log_bytes_of_each_phase_with_full_row_images(binlog_mariadb: sa.Engine) -> None:
    assert log_settings(binlog_mariadb) == {
        "log": "binlog",
        "log_bin": "ON",
        "binlog_format": "ROW",
        "binlog_row_image": "FULL",
    }
    inserted, updated = _phase(binlog_mariadb, "bench_log_meter")
    assert inserted is not None and updated is not None
    # Every inserted row's image holds its payload ...
    assert inserted >= ROWS * PAYLOAD
    # ... and a change of one small column logs the whole row twice (before and after).
    assert updated >= 2 * ROWS * PAYLOAD

    # Between scenarios the bench drops the files before the current one: run
    # after run, a bench instance's row images had filled the disk (70 GB).
    with binlog_mariadb.connect() as conn:
        conn.execute(sa.text("FLUSH BINARY LOGS"))  # a new current file
        before = [str(row[0]) for row in conn.execute(sa.text("SHOW BINARY LOGS"))]
    assert len(before) >= 2
    left = purge_old_logs(binlog_mariadb)
    with binlog_mariadb.connect() as conn:
        after = [str(row[0]) for row in conn.execute(sa.text("SHOW BINARY LOGS"))]
    assert after == left == before[-1:]
    assert log_bytes(binlog_mariadb) is not None  # the meter still reads the log


def test_no_binary_log_is_none_not_zero(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            if int(conn.execute(sa.text("SELECT @@log_bin")).scalar_one()):
                pytest.fail("the tests' MariaDB is expected to run with the binary log off")
        assert log_settings(engine) == {"log": "none", "log_bin": "OFF"}
        assert log_bytes(engine) is None
        assert _phase(engine, f"bench_log_meter_{uuid.uuid4().hex[:6]}") == (None, None)
    finally:
        engine.dispose()


def test_postgresql_wal_bytes_of_each_phase(pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    try:
        assert log_settings(engine)["log"] == "wal"
        inserted, updated = _phase(engine, f"bench_log_meter_{uuid.uuid4().hex[:6]}")
        assert inserted is not None and inserted >= ROWS * PAYLOAD
        assert updated is not None and updated > 0
    finally:
        engine.dispose()


def test_postgresql_as_production_runs_it_logs_whole_pages_at_the_level_asked() -> None:
    """``postgres.sh --wal-level logical --full-page-writes on`` (the benchmark's
    ``bench-wal`` instance, at the level a logical-decoding reader needs): the
    report names both settings, and the meter reads that server's WAL."""
    db = PostgresInstance(
        f"wal-{uuid.uuid4().hex[:6]}", free_port(), wal_level="logical", full_page_writes=True
    )
    db.start(fresh=True)
    engine = sa.create_engine(db.url)
    try:
        assert log_settings(engine) == {
            "log": "wal",
            "wal_level": "logical",
            "full_page_writes": "on",
        }
        table = "bench_log_meter"
        inserted, updated = _phase(engine, table)
        assert inserted is not None and inserted >= ROWS * PAYLOAD
        assert updated is not None and updated > 0
    finally:
        engine.dispose()
        db.stop()
        shutil.rmtree(db.state_dir, ignore_errors=True)
