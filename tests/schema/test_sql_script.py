"""``outboxkit schema sql`` prints a complete script: run by hand with the
database's own client on an empty database, ``enqueue`` and the relay work.

The script goes through the real clients (``mariadb``, ``psql``) as a DBA or a
migration tool would run it, not through SQLAlchemy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.naming import missing_service
from support.procs import run_captured
from support.waiting import wait_for

import outboxkit
from outboxkit.schema import read_shard_count

REPO = Path(__file__).resolve().parents[2]


def schema_sql(*args: str) -> subprocess.CompletedProcess[str]:
    return run_captured([sys.executable, "-P", "-m", "outboxkit", "schema", "sql", *args], cwd=REPO)


def table_names(db_url: str) -> list[str]:
    engine = sa.create_engine(db_url)
    try:
        return sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def client_command(url: str) -> tuple[list[str], dict[str, str]]:
    """The database's own command-line client for ``url`` (password in its
    environment variable, never on the command line)."""
    u = sa.make_url(url)
    env = dict(os.environ)
    if u.get_backend_name() == "postgresql":
        tool = "psql"
        env["PGPASSWORD"] = u.password or ""
        args = ["-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or ""]
        args += ["-d", u.database or "", "-v", "ON_ERROR_STOP=1", "-q"]
    else:
        tool = "mariadb"
        env["MYSQL_PWD"] = u.password or ""
        args = ["-h", u.host or "127.0.0.1", "-P", str(u.port or 3306), "-u", u.username or ""]
        args += [u.database or ""]
    path = shutil.which(tool)
    if path is None:
        missing_service(f"the {tool} client is not installed")
    return [path, *args], env


def run_script(url: str, script: str) -> subprocess.CompletedProcess[str]:
    command, env = client_command(url)
    return subprocess.run(
        command, input=script, capture_output=True, text=True, env=env, timeout=120, check=False
    )


def deliver_one(db_url: str, topic: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """``enqueue`` one event and run ``outboxkit relay`` until the row is delivered."""
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            event_id = outboxkit.enqueue(conn, topic=topic, key="k-1", payload={"n": 1})
        log = (tmp_path / "relay.log").open("w")
        relay = subprocess.Popen(
            [sys.executable, "-P", "-m", "outboxkit", "relay", "--db-url", db_url,
             "--kafka-bootstrap", kafka_bootstrap, "--health-port", "0", "--poll-interval", "0.2"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO,
            env={k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")},
        )  # fmt: skip
        try:

            def delivered() -> bool:
                assert relay.poll() is None, (tmp_path / "relay.log").read_text()
                with engine.connect() as conn:
                    row = conn.execute(
                        sa.text(
                            "SELECT status, kafka_offset FROM outbox_events WHERE event_id = :e"
                        ),
                        {"e": event_id},
                    ).one()
                return row.status == "delivered" and row.kafka_offset is not None

            wait_for(delivered, timeout=60, what="the relay to deliver the row")
        finally:
            relay.send_signal(signal.SIGTERM)
            assert relay.wait(60) == 0, (tmp_path / "relay.log").read_text()
            log.close()
    finally:
        engine.dispose()


@pytest.mark.parametrize(("fixture", "dialect"), [("db_url", "mariadb"), ("pg_url", "postgresql")])
def test_the_printed_script_makes_a_schema_the_writer_and_the_relay_accept(
    fixture: str,
    dialect: str,
    request: pytest.FixtureRequest,
    kafka_topics: Callable[..., str],
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    db_url: str = request.getfixturevalue(fixture)
    printed = schema_sql("--dialect", dialect, "--shards", "16")
    assert printed.returncode == 0, printed.stderr
    for attempt in (1, 2):  # a re-run finds everything in place and keeps the meta row
        ran = run_script(db_url, printed.stdout)
        assert ran.returncode == 0, f"run {attempt}: {ran.stderr}"
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            assert read_shard_count(conn, "outbox_events") == 16
    finally:
        engine.dispose()
    deliver_one(db_url, kafka_topics(partitions=1), kafka_bootstrap, tmp_path)


def test_the_mysql_script_run_on_mariadb_names_the_right_dialect(db_url: str) -> None:
    printed = schema_sql("--dialect", "mysql")
    assert printed.returncode == 0, printed.stderr
    ran = run_script(db_url, printed.stdout)
    assert ran.returncode != 0
    assert "For MariaDB print it with: outboxkit schema sql --dialect mariadb" in ran.stderr
    assert "utf8mb4_0900_bin" not in ran.stderr, ran.stderr
    assert table_names(db_url) == []


def test_the_dialect_help_says_which_server_each_is_for() -> None:
    shown = run_captured(
        [sys.executable, "-P", "-m", "outboxkit", "schema", "sql", "--help"], cwd=REPO
    )
    text = " ".join(shown.stdout.split())
    assert "mysql = MySQL 8" in text and "mariadb = MariaDB" in text, text


@pytest.mark.parametrize(
    ("fixture", "dialect", "collation"),
    [("db_url", "mariadb", "utf8mb4_nopad_bin"), ("pg_url", "postgresql", "outboxkit_crc32")],
)
def test_given_the_server_the_script_is_in_its_dialect(
    fixture: str, dialect: str, collation: str, request: pytest.FixtureRequest
) -> None:
    """``--db-url`` without ``--dialect``: the server is asked (a mysql+pymysql URL
    names MySQL and MariaDB alike), and nothing is written to it."""
    db_url: str = request.getfixturevalue(fixture)
    printed = schema_sql("--db-url", db_url)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == schema_sql("--dialect", dialect).stdout
    assert collation in printed.stdout
    assert f"--dialect {dialect}, the server at" in printed.stderr
    assert f":{sa.make_url(db_url).password}@" not in printed.stderr
    assert table_names(db_url) == []


def test_a_server_that_cannot_be_reached_is_exit_3() -> None:
    printed = schema_sql("--db-url", "mysql+pymysql://app:hunter2@127.0.0.1:1/shop")
    assert printed.returncode == 3, printed.stderr
    assert "cannot reach mysql+pymysql://app:***@127.0.0.1:1/shop" in printed.stderr
    assert "hunter2" not in printed.stderr and printed.stdout == ""
