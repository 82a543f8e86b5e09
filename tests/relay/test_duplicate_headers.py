"""Stored headers that repeat a name: ``{"type":"A","type":"B"}`` from another writer.

The ``headers`` column is TEXT on both databases (not PostgreSQL's ``jsonb``,
which would keep only the last ``type``, nor MySQL's JSON type): the stored text
keeps both names, and the relay must either send both or refuse the row. It
refuses it (docs/relay.md, "Rows from other writers"): a JSON object with a
repeated name has no agreed meaning, and the tools reading the row disagree on
it, so no reading of it is "the headers intact".
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from foreign import insert_foreign
from relay_support import EmbeddedRelay, consume, fast_settings, rows, status_counts, wait_for
from support.databases import on_both_databases

from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, on_both_databases]

#: Stored texts that repeat a name, at the top level or inside a ``{"b64": ...}``.
DUPLICATES = {
    "top-level": ('{"type":"A","type":"B"}', "'type'"),
    "spaced-and-escaped": ('{"type": "A", "ty\\u0070e": "B", "x": "1"}', "'type'"),
    "inside-b64": ('{"blob":{"b64":"QQ==","b64":"Qg=="}}', "'b64'"),
}
SECRET_PAYLOAD = b"payload-bytes-that-must-not-show"


def test_a_header_name_stored_twice_fails_the_row_alone(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Each such row sits between two good rows of its key: it fails with a reason
    that names the header (and holds no payload bytes); the good rows arrive in
    key order and nothing reaches Kafka with one of the two values dropped."""
    topic = kafka_topics(partitions=1)
    t = outbox_table(outbox)
    bad: dict[int, str] = {}
    for i, (text, named) in enumerate(DUPLICATES.values()):
        key = f"k{i}".encode()
        insert_foreign(engine, outbox, topic=topic, key=key, payload=b"before")
        row_id = insert_foreign(
            engine, outbox, topic=topic, key=key, payload=SECRET_PAYLOAD, headers=text
        )
        bad[row_id] = named
        insert_foreign(engine, outbox, topic=topic, key=key, payload=b"after")
        with engine.connect() as conn:  # the column kept the text as written
            stored = conn.execute(sa.select(t.c.headers).where(t.c.id == row_id)).scalar_one()
        assert stored == text
    # skip: the good rows after a failed one go on (the hold rule: test_foreign_rows.py).
    embedded(fast_settings(db_url, kafka_bootstrap, failed_rows="skip"))
    n = len(DUPLICATES)
    wait_for(
        lambda: (
            sum(status_counts(engine, outbox).get(s, 0) for s in ("delivered", "failed")) == 3 * n
        ),
        timeout=30,
        what="every row delivered or failed",
    )
    messages = consume(kafka_bootstrap, topic, expected=2 * n)
    sent = [m.headers for m in messages if m.value == SECRET_PAYLOAD]
    assert not sent, f"sent with a header value dropped: {sent}"
    assert status_counts(engine, outbox) == {"delivered": 2 * n, "failed": n}
    for row in rows(engine, outbox):
        if row.id not in bad:
            continue
        assert row.status == "failed", row
        error = row.last_error or ""
        assert "more than once" in error and bad[row.id] in error, error
        assert SECRET_PAYLOAD.decode() not in error
        assert row.attempts == 1 and row.lease_owner is None
    by_key: dict[bytes | None, list[bytes]] = {}
    for m in messages:
        by_key.setdefault(m.key, []).append(m.value)
    assert by_key == {f"k{i}".encode(): [b"before", b"after"] for i in range(n)}
