"""The benchmark's events: the same payloads, keys and headers for every scenario.

Payloads are JSON objects padded to ``payload_bytes`` with lowercase letters from
a fixed pseudo-random pool: as compressible as typical event JSON, not the
all-zero bytes that would flatter compression.  Keys cycle over ``keys``
distinct values, so consecutive rows hit different keys (and shards), as
independent writers would.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from outboxkit import Event, enqueue_many
from outboxkit.schema import apply_schema, outbox_table
from outboxkit.schema.table import payload_table_name

_POOL_SIZE = 1 << 16
_pool = "".join(random.Random(7).choices("abcdefghijklmnopqrstuvwxyz", k=_POOL_SIZE * 2))
#: Rows per transaction when filling a backlog: big enough that commits do not dominate.
FILL_CHUNK = 2_000
HEADERS = {"type": "BenchEvent"}


def key_for(i: int, keys: int) -> bytes:
    return f"key-{i % keys:06d}".encode()


def payload_for(i: int, size: int) -> bytes:
    head = f'{{"n":{i},"kind":"bench","pad":"'
    tail = '"}'
    pad_len = max(0, size - len(head) - len(tail))
    start = (i * 7919) % _POOL_SIZE
    pad = (_pool * (1 + pad_len // len(_pool)))[start : start + pad_len]
    return (head + pad + tail).encode()


@dataclass(frozen=True)
class Message:
    key: bytes
    value: bytes
    headers: list[tuple[str, str | bytes | None]]


def messages(n: int, *, keys: int, payload_bytes: int) -> list[Message]:
    """What the relay would publish for rows 0..n-1, built in memory."""
    out = []
    for i in range(n):
        event_id = f"bench-{i:012d}".encode()
        out.append(
            Message(
                key=key_for(i, keys),
                value=payload_for(i, payload_bytes),
                headers=[("type", b"BenchEvent"), ("event_id", event_id)],
            )
        )
    return out


def events(start: int, n: int, *, topic: str, keys: int, payload_bytes: int) -> Iterator[Event]:
    for i in range(start, start + n):
        yield Event(
            topic=topic,
            payload=payload_for(i, payload_bytes),
            key=key_for(i, keys),
            headers=HEADERS,
        )


@dataclass(frozen=True)
class FillResult:
    rows: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def fill(
    engine: sa.Engine,
    table: str,
    *,
    topic: str,
    rows: int,
    start: int = 0,
    keys: int,
    payload_bytes: int,
    shards: int,
) -> FillResult:
    """Pre-fill a backlog through the writer API, ``FILL_CHUNK`` events per transaction."""
    apply_schema(engine, table=table, shards=shards, inbox=None)
    began = time.perf_counter()
    done = 0
    while done < rows:
        n = min(FILL_CHUNK, rows - done)
        with engine.begin() as conn:
            enqueue_many(
                conn,
                events(start + done, n, topic=topic, keys=keys, payload_bytes=payload_bytes),
                table=table,
            )
        done += n
    return FillResult(rows, time.perf_counter() - began)


def copy_backlog(
    engine: sa.Engine,
    src: str,
    dst: str,
    *,
    topic: str,
    rows: int,
    shards: int,
    values: Mapping[str, str] | None = None,
    inline: bool = False,
) -> FillResult:
    """A fresh pending backlog in ``dst``: the first ``rows`` rows of ``src``, for ``topic``.

    Copying inside the server is several times faster than writing the rows again,
    and gives every run the very same rows. ``values``: SQL expressions some
    columns are copied as instead (as another writer would have stored them).
    The rows are laid out as ``enqueue`` writes them, the payload and headers in
    the payload table; ``inline``: in the row, as 0.2.0 kept them (and as
    another writer may).
    """
    apply_schema(engine, table=dst, shards=shards, inbox=None)
    cols = [c.name for c in outbox_table(dst).columns]
    stored = "COALESCE(o.payload, p.payload)", _HEADERS_SQL
    given = {
        "topic": ":topic",
        "payload": stored[0] if inline else "NULL",
        "headers": stored[1] if inline else "NULL",
        **(values or {}),
    }
    select_cols = [given.get(c, f"o.{c}") for c in cols]
    source = (
        f"{src} o LEFT JOIN {payload_table_name(src)} p ON p.event_id = o.event_id"
        " ORDER BY o.id LIMIT :rows"
    )
    start = time.perf_counter()
    with engine.begin() as conn:
        params = {"topic": topic, "rows": rows}
        conn.execute(
            sa.text(
                f"INSERT INTO {dst} ({', '.join(cols)})"
                f" SELECT {', '.join(select_cols)} FROM {source}"
            ),
            params,
        )
        if not inline:
            conn.execute(
                sa.text(
                    f"INSERT INTO {payload_table_name(dst)} (event_id, payload, headers)"
                    f" SELECT o.event_id, {', '.join(stored)} FROM {source}"
                ),
                params,
            )
        if engine.dialect.name == "postgresql":
            # Rows copied with their ids: move the id sequence past them, so rows
            # a writer adds later get new ids.
            conn.execute(
                sa.text(
                    f"SELECT setval(pg_get_serial_sequence('{dst}', 'id'), "
                    f"(SELECT COALESCE(MAX(id), 0) + 1 FROM {dst}), false)"
                )
            )
    analyze(engine, dst, vacuum=True)
    if not inline:
        analyze(engine, payload_table_name(dst), vacuum=True)
    return FillResult(rows, time.perf_counter() - start)


#: A row's headers wherever it keeps them (``schema.table.stored_payload``).
_HEADERS_SQL = "CASE WHEN o.payload IS NULL THEN p.headers ELSE o.headers END"


def analyze(engine: sa.Engine, table: str, *, vacuum: bool = False) -> None:
    """Fresh planner statistics for ``table`` (its index choices depend on them).

    ``vacuum``: on PostgreSQL also VACUUM it first. A backlog that built up while
    the relays were down has been vacuumed by autovacuum long before they drain
    it; one copied in a single statement a moment ago has not, and autovacuum's
    first pass over it (for the inserts: to set the visibility map) then ran
    beside the first seconds of the drain in some runs and not in others.
    MySQL/MariaDB: no such pass (InnoDB purges as it goes)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(sa.text(f"{'VACUUM (ANALYZE)' if vacuum else 'ANALYZE'} {table}"))
        else:
            conn.execute(sa.text(f"ANALYZE TABLE {table}")).all()


def drop_table(engine: sa.Engine, table: str) -> None:
    """Drop the outbox ``table``, its payload table and its meta row."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {payload_table_name(table)}"))
        conn.execute(sa.text("DELETE FROM outboxkit_meta WHERE table_name = :t"), {"t": table})


def count_by_status(engine: sa.Engine, table: str) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT status, COUNT(*) FROM {table} GROUP BY status"))
        return {str(status): int(n) for status, n in rows}
