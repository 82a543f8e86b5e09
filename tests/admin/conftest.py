"""Fixtures for the admin tests: rows in given states, and the CLI run in-process.

Rows are made the way a service makes them (``enqueue``), then moved to the state
under test with plain UPDATEs, the way a relay would leave them.
"""

from __future__ import annotations

import contextlib
import io
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
import sqlalchemy as sa
from support.dbsql import db_time

from outboxkit import Event, enqueue_many
from outboxkit.cli import main
from outboxkit.schema import outbox_table

TABLE = "outbox_events"


class MakeRows(Protocol):
    def __call__(
        self,
        n: int = 1,
        *,
        status: str = "pending",
        topic: str = "orders",
        key: str | None = None,
        age_s: float = 0.0,
        lease_s: float = 30.0,
        **values: Any,
    ) -> list[int]: ...


@pytest.fixture
def make_rows(engine: sa.Engine, outbox: str) -> MakeRows:
    """``make_rows(n, status=..., age_s=...)``: n new rows in that state; returns their ids.

    ``age_s`` back-dates created_at/updated_at (and delivered_at for delivered rows)
    by that many seconds of the database clock. ``delivering`` rows get a lease that
    expires ``lease_s`` from now (negative: already expired).
    """
    t = outbox_table(outbox)

    def make(
        n: int = 1,
        *,
        status: str = "pending",
        topic: str = "orders",
        key: str | None = None,
        age_s: float = 0.0,
        lease_s: float = 30.0,
        **values: Any,
    ) -> list[int]:
        with engine.begin() as conn:
            event_ids = enqueue_many(
                conn,
                [Event(topic=topic, payload={"n": i}, key=key) for i in range(n)],
                table=outbox,
            )
            ids = list(conn.execute(sa.select(t.c.id).where(t.c.event_id.in_(event_ids))).scalars())
            then = db_time(conn, -age_s)
            changes: dict[str, Any] = {
                "status": status,
                "created_at": then,
                "updated_at": then,
            }
            if status == "delivered":
                changes.update(delivered_at=then, kafka_partition=0, kafka_offset=1)
            if status == "delivering":
                changes.update(
                    lease_owner="relay-a",
                    lease_token=secrets.token_hex(16),
                    lease_expires_at=db_time(conn, lease_s),
                    attempts=1,
                )
            if status in ("failed", "retryable"):
                changes.update(attempts=5, last_error="KafkaError: MSG_SIZE_TOO_LARGE")
            changes.update(values)
            conn.execute(t.update().where(t.c.id.in_(ids)).values(**changes))
        return ids

    return make


@pytest.fixture
def read_rows(engine: sa.Engine, outbox: str) -> Callable[..., dict[int, sa.Row[Any]]]:
    t = outbox_table(outbox)

    def read(ids: list[int] | None = None) -> dict[int, sa.Row[Any]]:
        query = sa.select(t).order_by(t.c.id)
        if ids is not None:
            query = query.where(t.c.id.in_(ids))
        with engine.connect() as conn:
            return {row.id: row for row in conn.execute(query)}

    return read


@dataclass
class Result:
    code: int
    out: str
    err: str


AdminCli = Callable[..., Result]


@pytest.fixture
def admin(db_url: str, outbox: str) -> AdminCli:
    """Run ``outboxkit admin ARGS`` in this process against the test database."""

    def run(*args: str, db: str | None = db_url) -> Result:
        argv = ["admin", *args]
        if db is not None and "--help" not in args:
            argv += ["--db-url", db]
        return run_cli(argv)

    return run


@pytest.fixture
def cli() -> Callable[[list[str]], Result]:
    """Run ``outboxkit ARGV`` in this process (no database prepared)."""
    return run_cli


def run_cli(argv: list[str]) -> Result:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: --help, or a rejected argument
            code = exc.code if isinstance(exc.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def secret_db_url(db_url: str) -> Iterator[str]:
    """The test database through a user whose password appears nowhere else."""
    url = sa.make_url(db_url)
    user = f"adm_{secrets.token_hex(4)}"
    password = f"Pw-{secrets.token_hex(8)}"
    root = sa.create_engine(db_url)
    with root.begin() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'"))
        conn.execute(sa.text(f"GRANT ALL ON {url.database}.* TO '{user}'@'%'"))
    try:
        yield url.set(username=user, password=password).render_as_string(hide_password=False)
    finally:
        with root.begin() as conn:
            conn.execute(sa.text(f"DROP USER IF EXISTS '{user}'@'%'"))
        root.dispose()
