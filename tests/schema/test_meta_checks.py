"""A table's ``outboxkit_meta`` row is checked wherever it is read.

A shard count outside ``1..MAX_SHARDS`` (changed by hand: ``schema apply`` never
stores one) and a schema version newer than this code knows (a later outboxkit
upgraded the table) are refused with the row, the value and the fix named: the
relay exits 2 at start before it builds anything from the count, ``enqueue``
raises a schema error before it writes, ``admin status`` and ``schema apply``
exit 2.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

from outboxkit import __version__, enqueue
from outboxkit.errors import SchemaError, SchemaMetaError
from outboxkit.runtime import EXIT_CONFIG
from outboxkit.schema import apply_schema
from outboxkit.schema.table import MAX_SHARDS, SCHEMA_VERSION

pytestmark = [pytest.mark.integration, on_both_databases]

REPO = Path(__file__).resolve().parents[2]
TABLE = "outbox_events"
#: The relay's address space while it starts, at most: a relay that built a set of
#: 2**31-1 shards would need tens of GiB, and must not take a shared machine with it.
RELAY_MEMORY_LIMIT = 4 * 1024**3

BAD_SHARD_COUNTS = [0, -1, MAX_SHARDS + 1, 2**31 - 1]


def _set_meta(engine: sa.Engine, **values: int) -> None:
    sets = ", ".join(f"{k} = :{k}" for k in values)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE outboxkit_meta SET {sets} WHERE table_name = :t"),
            {**values, "t": TABLE},
        )


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (RELAY_MEMORY_LIMIT, RELAY_MEMORY_LIMIT))


def _outboxkit(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-P", "-m", "outboxkit", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=120,
        check=False,
        preexec_fn=_limit_memory,  # the child only: no threads are started before it
    )


def _relay(db_url: str, kafka_bootstrap: str) -> subprocess.CompletedProcess[str]:
    return _outboxkit(
        "relay", "--health-port", "0", "--connect-timeout", "2",
        env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
    )  # fmt: skip


def _shard_count_problem(value: int) -> str:
    return (
        f"outboxkit_meta row (table_name='{TABLE}') holds shard_count={value}, "
        f"outside 1..{MAX_SHARDS}"
    )


def _newer_schema_problem() -> str:
    return (
        f"outboxkit_meta row (table_name='{TABLE}') holds schema_version="
        f"{SCHEMA_VERSION + 1}: table '{TABLE}' was upgraded by a later outboxkit, and "
        f"outboxkit {__version__} reads and writes schema version {SCHEMA_VERSION} only. "
        "Upgrade the outboxkit package"
    )


@pytest.mark.parametrize("value", BAD_SHARD_COUNTS)
def test_the_relay_exits_2_naming_a_shard_count_out_of_range(
    engine: sa.Engine, db_url: str, kafka_bootstrap: str, value: int
) -> None:
    """2**31-1 included: the check comes before the relay builds its shard set, so it
    exits 2 at once rather than growing by gigabytes (and an address-space limit
    turns any such growth into a failure here)."""
    apply_schema(engine, shards=8)
    _set_meta(engine, shard_count=value)
    result = _relay(db_url, kafka_bootstrap)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert _shard_count_problem(value) in result.stderr, result.stderr
    assert "UPDATE outboxkit_meta SET shard_count = <n> WHERE table_name = 'outbox_events'" in (
        result.stderr
    )
    assert '"event": "relay-started"' not in result.stderr
    assert "Traceback" not in result.stderr


def test_the_relay_exits_2_on_a_table_of_a_newer_schema_version(
    engine: sa.Engine, db_url: str, kafka_bootstrap: str
) -> None:
    apply_schema(engine, shards=8)
    _set_meta(engine, schema_version=SCHEMA_VERSION + 1)
    result = _relay(db_url, kafka_bootstrap)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert _newer_schema_problem() in result.stderr, result.stderr
    assert "to the version that last ran `outboxkit schema apply` on it" in result.stderr
    with engine.begin() as conn:  # the later version recorded itself, as apply does
        conn.execute(sa.text("UPDATE outboxkit_meta SET package_version = '9.1.0'"))
    result = _relay(db_url, kafka_bootstrap)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert (
        _newer_schema_problem() + " to 9.1.0, which last ran `outboxkit schema apply` on it"
    ) in result.stderr, result.stderr
    assert '"event": "relay-started"' not in result.stderr


@pytest.mark.parametrize("value", BAD_SHARD_COUNTS)
def test_enqueue_raises_a_schema_error_for_a_shard_count_out_of_range(
    engine: sa.Engine, value: int
) -> None:
    apply_schema(engine, shards=8)
    _set_meta(engine, shard_count=value)
    with engine.connect() as conn:
        with pytest.raises(SchemaMetaError) as caught:
            enqueue(conn, topic="orders", payload={"n": 1}, key="k")
        conn.rollback()
    assert isinstance(caught.value, SchemaError)
    assert _shard_count_problem(value) in str(caught.value)
    with engine.connect() as conn:
        assert conn.execute(sa.text(f"SELECT COUNT(*) FROM {TABLE}")).scalar_one() == 0


def test_enqueue_raises_a_schema_error_on_a_table_of_a_newer_schema_version(
    engine: sa.Engine,
) -> None:
    apply_schema(engine, shards=8)
    _set_meta(engine, schema_version=SCHEMA_VERSION + 1)
    with engine.connect() as conn, pytest.raises(SchemaMetaError) as caught:
        enqueue(conn, topic="orders", payload={"n": 1}, key="k")
    assert _newer_schema_problem() in str(caught.value)


@pytest.mark.parametrize("value", [0, 2**31 - 1])
def test_admin_status_and_schema_apply_exit_2_naming_the_row(
    engine: sa.Engine, db_url: str, value: int
) -> None:
    apply_schema(engine, shards=8)
    _set_meta(engine, shard_count=value)
    for command in (("admin", "status"), ("schema", "apply")):
        result = _outboxkit(*command, env={"OUTBOXKIT_DB_URL": db_url})
        assert result.returncode == EXIT_CONFIG, (command, result.stderr)
        assert _shard_count_problem(value) in result.stderr, (command, result.stderr)
    with engine.connect() as conn:  # apply changed nothing
        assert conn.execute(sa.text("SELECT shard_count FROM outboxkit_meta")).scalar() == value


def test_schema_apply_of_an_older_package_leaves_a_newer_table_alone(
    engine: sa.Engine, db_url: str
) -> None:
    apply_schema(engine, shards=8)
    _set_meta(engine, schema_version=SCHEMA_VERSION + 1)
    result = _outboxkit("schema", "apply", env={"OUTBOXKIT_DB_URL": db_url})
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert _newer_schema_problem() in result.stderr, result.stderr
    with engine.connect() as conn:
        version = conn.execute(sa.text("SELECT schema_version FROM outboxkit_meta")).scalar()
    assert version == SCHEMA_VERSION + 1


def test_schema_apply_records_its_package_version_and_admin_status_shows_it(
    engine: sa.Engine, db_url: str
) -> None:
    """On a meta table of 0.3.0 (no ``package_version`` column), ``apply`` adds the
    column (NULL-able: 0.3.0's reads and inserts name their columns and go on
    working beside it), records its version once, and says so; ``admin status``
    prints and returns it."""
    apply_schema(engine, shards=8)
    with engine.begin() as conn:  # the meta table as 0.3.0 left it
        conn.execute(sa.text("ALTER TABLE outboxkit_meta DROP COLUMN package_version"))
    status = _outboxkit("admin", "status", env={"OUTBOXKIT_DB_URL": db_url})
    assert status.returncode == 0, status.stderr
    assert (
        "schema version 3, last applied by unknown (outboxkit before 0.4.0 did not record it)"
        in status.stdout
    )

    result = _outboxkit("schema", "apply", "--shards", "8", env={"OUTBOXKIT_DB_URL": db_url})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "added column outboxkit_meta.package_version",
        f"recorded {TABLE} as applied by outboxkit {__version__}",
        f"table {TABLE}: 8 shards",
    ]
    again = _outboxkit("schema", "apply", "--shards", "8", env={"OUTBOXKIT_DB_URL": db_url})
    assert again.stdout.splitlines() == ["schema up to date", f"table {TABLE}: 8 shards"]

    with engine.begin() as conn:  # what a 0.3.0 relay, writer and apply run on the meta table
        assert conn.execute(
            sa.text("SELECT shard_count, schema_version FROM outboxkit_meta WHERE table_name = :t"),
            {"t": TABLE},
        ).one() == (8, SCHEMA_VERSION)
        conn.execute(
            sa.text(
                "INSERT INTO outboxkit_meta (table_name, shard_count, schema_version, created_at)"
                " VALUES ('older_outbox', 4, 3, CURRENT_TIMESTAMP)"
            )
        )

    status = _outboxkit("admin", "status", env={"OUTBOXKIT_DB_URL": db_url})
    assert f"schema version 3, last applied by outboxkit {__version__}\n" in status.stdout
    as_json = _outboxkit("admin", "status", "--json", env={"OUTBOXKIT_DB_URL": db_url})
    document = json.loads(as_json.stdout)
    assert (document["schema_version"], document["applied_by"]) == (SCHEMA_VERSION, __version__)
