"""The writer API against a real database: what a service sees in its table.

Tests marked ``on_both_databases`` run on MariaDB and on PostgreSQL. The table of
bad inputs and the producer-size check stay on MariaDB: they are refused (or
sized) before any database is touched, by code that does not know the dialect.
"""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session
from support.databases import on_both_databases

import outboxkit
from outboxkit import Event, enqueue, enqueue_many
from outboxkit.schema import apply_schema, decode_headers, outbox_rows_query, outbox_table
from outboxkit.schema.codec import kafka_headers, shard_for

pytestmark = pytest.mark.integration


def rows(engine: sa.Engine, table: str = "outbox_events") -> list[sa.Row[Any]]:
    """Every row of the outbox ``table``, payload and headers wherever kept."""
    t = outbox_table(table)
    with engine.connect() as conn:
        return list(conn.execute(outbox_rows_query(table).order_by(t.c.id)))


@on_both_databases
def test_committed_enqueue_writes_a_pending_row(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        event_id = enqueue(
            conn, topic="orders", payload={"order": 1}, key="order-1", headers={"h": "v"}
        )
    [row] = rows(engine)
    assert row.event_id == event_id
    assert uuid.UUID(event_id).version == 7
    assert row.status == "pending"
    assert row.attempts == 0
    assert row.topic == "orders"
    assert row.message_key == b"order-1"
    assert row.payload == b'{"order":1}'
    assert decode_headers(row.headers) == {"h": "v"}
    assert row.shard == zlib.crc32(b"order-1") % 8
    assert row.next_attempt_at is not None and row.created_at is not None
    assert row.lease_owner is None and row.delivered_at is None


@on_both_databases
def test_keyless_event_shards_by_event_id(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        event_id = enqueue(conn, topic="orders", payload=b"raw")
    [row] = rows(engine)
    assert row.message_key is None
    assert row.shard == zlib.crc32(event_id.encode()) % 8


@on_both_databases
def test_rollback_leaves_no_row(engine: sa.Engine, outbox: str) -> None:
    with engine.connect() as conn:
        trans = conn.begin()
        enqueue(conn, topic="orders", payload="x", key="k")
        trans.rollback()
    assert rows(engine) == []


@on_both_databases
def test_session_joins_the_business_transaction(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id INT PRIMARY KEY, total INT)"))
    with Session(engine) as session:
        session.execute(sa.text("INSERT INTO orders VALUES (1, 100)"))
        enqueue(session, topic="orders", payload={"id": 1}, key="1")
        session.rollback()
    assert rows(engine) == []
    with Session(engine) as session, session.begin():
        session.execute(sa.text("INSERT INTO orders VALUES (2, 200)"))
        enqueue(session, topic="orders", payload={"id": 2}, key="2")
    assert [r.payload for r in rows(engine)] == [b'{"id":2}']


@on_both_databases
def test_enqueue_does_not_commit_on_its_own(engine: sa.Engine, outbox: str) -> None:
    with engine.connect() as conn:
        enqueue(conn, topic="orders", payload="x")
        # another connection must not see it before the caller commits
        assert rows(engine) == []
        conn.commit()
    assert len(rows(engine)) == 1


@on_both_databases
def test_enqueue_many_ten_thousand_in_one_transaction(engine: sa.Engine, outbox: str) -> None:
    events = [
        Event(topic="orders", payload={"n": i}, key=f"k{i % 97}", headers={"seq": str(i)})
        for i in range(10_000)
    ]
    with engine.begin() as conn:
        ids = enqueue_many(conn, events)
    assert len(set(ids)) == 10_000
    got = rows(engine)
    assert len(got) == 10_000
    # id order is the order given, which is what per-key ordering builds on
    assert [json.loads(r.payload)["n"] for r in got] == list(range(10_000))
    assert [r.event_id for r in got] == ids
    assert all(r.status == "pending" for r in got)


@pytest.mark.parametrize("count", [1, 5, 100, 1000, 1001])
def test_enqueue_many_sends_a_few_multi_row_inserts_not_one_per_row(
    engine: sa.Engine, outbox: str, count: int
) -> None:
    # Each row was its own INSERT (PyMySQL sends an executemany row by row when
    # VALUES holds SQL functions): 1,000 events, 1,000 round trips.
    events = [Event(topic="orders", payload={"n": i}, key=f"k{i % 7}") for i in range(count)]
    with engine.begin() as conn:
        enqueue(conn, topic="orders", payload="warm-up")  # reads the shard count once

        def inserts() -> int:
            status = conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Com_insert'")).one()
            return int(status[1])

        before = inserts()
        ids = enqueue_many(conn, events)
        sent = inserts() - before
    # One per power of two in each chunk of at most 1,000 rows: 1000 = 512+256+128+64+32+8,
    # into the outbox table and again into its payload table.
    per_table = sum(bin(n).count("1") for n in (min(count, 1000), count - min(count, 1000)))
    assert sent == 2 * per_table
    got = rows(engine)[1:]
    assert [json.loads(r.payload)["n"] for r in got] == list(range(count))
    assert [r.event_id for r in got] == ids
    assert {(r.status, r.attempts) for r in got} == {("pending", 0)}


def test_enqueue_many_keeps_each_insert_under_a_mebibyte(engine: sa.Engine, outbox: str) -> None:
    # Escaped binary payloads may double on the wire: one multi-row INSERT stays
    # under 1 MiB of payload, so under MySQL 5.7's default max_allowed_packet (4 MiB).
    payloads = [bytes([n]) * 300_000 for n in range(10)]
    with engine.begin() as conn:
        enqueue(conn, topic="orders", payload="warm-up")
        before = conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Com_insert'")).one()
        enqueue_many(conn, [Event(topic="orders", payload=p) for p in payloads])
        after = conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Com_insert'")).one()
    # 3 rows (900 KB) per statement at most: chunks of 3, 3, 3, 1 -> 2+1, 2+1, 2+1, 1,
    # each into the outbox table and into its payload table.
    assert int(after[1]) - int(before[1]) == 2 * 7
    assert [r.payload for r in rows(engine)[1:]] == payloads


@on_both_databases
def test_caller_supplied_event_id_is_kept(engine: sa.Engine, outbox: str) -> None:
    u = uuid.uuid4()
    with engine.begin() as conn:
        a = enqueue(conn, topic="t", payload="1", event_id="order-42:created")
        b = enqueue(conn, topic="t", payload="2", event_id=u)
    assert (a, b) == ("order-42:created", str(u))
    assert [r.event_id for r in rows(engine)] == [a, b]


@on_both_databases
def test_duplicate_event_id_is_refused_by_the_database(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        enqueue(conn, topic="t", payload="1", event_id="same")
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        enqueue(conn, topic="t", payload="2", event_id="same")
    assert len(rows(engine)) == 1


@on_both_databases
def test_duplicate_event_ids_in_one_batch_write_nothing(engine: sa.Engine, outbox: str) -> None:
    # 1,001 events, the last repeating the first id: the statements would be split
    # in two chunks, so a database-level refusal of the second could leave the
    # first 1,000 rows in a transaction a careless caller then commits.
    events = [Event(topic="t", payload=i, event_id=f"ev-{i}") for i in range(1000)]
    events.append(Event(topic="t", payload="again", event_id="ev-0"))
    with engine.connect() as conn:
        try:
            enqueue_many(conn, events)
        except Exception as exc:  # what a careless caller does: swallow and commit
            caught: Exception = exc
        conn.commit()
    assert len(rows(engine)) == 0
    assert isinstance(caught, outboxkit.EnqueueError), repr(caught)
    assert isinstance(caught, outboxkit.DuplicateEventIdError)
    assert "ev-0" in str(caught) and "0 and 1000" in str(caught)


@on_both_databases
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(
        st.one_of(st.sampled_from(["a", "b", "c"]), st.uuids().map(str), st.uuids()),
        min_size=1,
        max_size=12,
    )
)
def test_batches_with_repeated_ids_raise_before_writing(
    engine: sa.Engine, outbox: str, ids: list[str | uuid.UUID]
) -> None:
    events = [Event(topic="t", payload=n, event_id=e) for n, e in enumerate(ids)]
    repeated = len({str(e) for e in ids}) < len(ids)
    with engine.connect() as conn:
        if repeated:
            with pytest.raises(outboxkit.DuplicateEventIdError, match="more than once"):
                enqueue_many(conn, events)
        else:
            assert enqueue_many(conn, events) == [str(e) for e in ids]
        conn.rollback()
    assert rows(engine) == []


#: Two outboxes of one PostgreSQL database, in two schemas, with their shard counts.
SCHEMA_SHARDS = {"svc_a": 4, "svc_b": 64}


def make_schemas(pg_url: str) -> None:
    """Create the schemas of ``SCHEMA_SHARDS`` in the database of ``pg_url``."""
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for schema in SCHEMA_SHARDS:
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    finally:
        admin.dispose()


def set_search_path_on_connect(engine: sa.Engine, schema: str) -> None:
    """Set ``search_path`` by a connect event, as the SQLAlchemy docs show."""

    @sa.event.listens_for(engine, "connect", insert=True)
    def set_path(dbapi_connection: Any, _record: Any) -> None:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        cursor.execute(f"SET SESSION search_path = {schema}")
        cursor.close()
        dbapi_connection.autocommit = autocommit


def assert_rows_sharded_by_their_own_table(engines: dict[str, sa.Engine]) -> None:
    """Every row of each schema's outbox has the shard of its own table's count."""
    for schema, engine in engines.items():
        found = rows(engine)
        assert len(found) == 50, schema
        wrong = [
            r.event_id
            for r in found
            if r.shard != shard_for(r.message_key, r.event_id, SCHEMA_SHARDS[schema])
        ]
        assert wrong == [], f"{len(wrong)} rows of {schema} sharded by another table's count"


def test_two_schemas_behind_one_url_each_shard_by_their_own_count(pg_url: str) -> None:
    """One URL, two outboxes: ``search_path`` set in ``connect_args`` for one
    engine and by a connect event for the other. The writer's layout cache was
    keyed by the URL and table name, so the first table's shard count (4) was
    used for the second's rows (64 shards), silently."""
    make_schemas(pg_url)
    engines = {
        "svc_a": sa.create_engine(pg_url, connect_args={"options": "-csearch_path=svc_a"}),
        "svc_b": sa.create_engine(pg_url),
    }
    set_search_path_on_connect(engines["svc_b"], "svc_b")
    try:
        for schema, engine in engines.items():
            apply_schema(engine, shards=SCHEMA_SHARDS[schema])
        for engine in engines.values():
            with engine.begin() as conn:
                enqueue_many(conn, [Event(topic="t", payload="1", key=f"k{n}") for n in range(49)])
            with engine.begin() as conn:
                enqueue(conn, topic="t", payload="1", key="one")
        assert_rows_sharded_by_their_own_table(engines)
    finally:
        for engine in engines.values():
            engine.dispose()


@on_both_databases
def test_missing_schema_is_a_clear_error(engine: sa.Engine) -> None:
    with (
        pytest.raises(outboxkit.SchemaNotAppliedError, match="schema apply"),
        engine.begin() as conn,
    ):
        enqueue(conn, topic="t", payload="1")


BAD_INPUTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"topic": ""}, outboxkit.InvalidTopicError, "non-empty"),
    ({"topic": "."}, outboxkit.InvalidTopicError, "illegal"),
    ({"topic": ".."}, outboxkit.InvalidTopicError, "illegal"),
    ({"topic": "has space"}, outboxkit.InvalidTopicError, "illegal"),
    ({"topic": "ümlaut"}, outboxkit.InvalidTopicError, "illegal"),
    ({"topic": "a" * 250}, outboxkit.InvalidTopicError, "249"),
    ({"topic": None}, outboxkit.InvalidTopicError, "non-empty"),
    ({"payload": b"x" * 1_000_000}, outboxkit.PayloadTooLargeError, "message.max.bytes"),
    ({"payload": {"x": {1, 2}}}, outboxkit.UnserializablePayloadError, "JSON"),
    ({"payload": float("nan")}, outboxkit.UnserializablePayloadError, "JSON"),
    ({"payload": None}, outboxkit.UnserializablePayloadError, "required"),
    ({"payload": "\ud800"}, outboxkit.UnserializablePayloadError, "UTF-8"),
    ({"headers": {"": "v"}}, outboxkit.InvalidHeadersError, "non-empty"),
    ({"headers": {1: "v"}}, outboxkit.InvalidHeadersError, "non-empty"),
    ({"headers": {"h": 1}}, outboxkit.InvalidHeadersError, "str or bytes"),
    ({"headers": {"a\x00b": "v"}}, outboxkit.InvalidHeadersError, "NUL"),
    ({"headers": {"\ud800": "v"}}, outboxkit.InvalidHeadersError, "UTF-8"),
    ({"headers": {"h": "\udfff"}}, outboxkit.InvalidHeadersError, "UTF-8"),
    ({"headers": {b"h": "v"}}, outboxkit.InvalidHeadersError, "non-empty str"),
    ({"headers": {"event_id": "x"}}, outboxkit.InvalidHeadersError, "outboxkit"),
    ({"headers": ["h", "v"]}, outboxkit.InvalidHeadersError, "mapping"),
    ({"key": "k" * 513}, outboxkit.InvalidKeyError, "limit"),
    ({"key": 12}, outboxkit.InvalidKeyError, "str, bytes"),
    ({"event_id": "has space"}, outboxkit.InvalidEventIdError, "malformed"),
    ({"event_id": ""}, outboxkit.InvalidEventIdError, "malformed"),
    ({"event_id": "x" * 65}, outboxkit.InvalidEventIdError, "malformed"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_INPUTS)
def test_bad_input_raises_before_anything_is_written(
    engine: sa.Engine, outbox: str, override: dict[str, Any], error: type[Exception], message: str
) -> None:
    kwargs: dict[str, Any] = {"topic": "orders", "payload": {"ok": True}, **override}
    with engine.connect() as conn:
        with pytest.raises(error, match=message) as info:
            enqueue(conn, **kwargs)
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, outboxkit.EnqueueError)
        conn.commit()
    assert rows(engine) == []


@on_both_databases
def test_one_bad_event_in_a_batch_writes_none(engine: sa.Engine, outbox: str) -> None:
    events = [Event(topic="ok", payload=i) for i in range(5)] + [
        Event(topic="bad topic", payload=1)
    ]
    with engine.connect() as conn:
        with pytest.raises(outboxkit.InvalidTopicError):
            enqueue_many(conn, events)
        conn.commit()
    assert rows(engine) == []


@on_both_databases
def test_payload_limit_is_configurable(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        with pytest.raises(outboxkit.PayloadTooLargeError):
            enqueue(conn, topic="t", payload=b"12345", max_payload_bytes=4)
        enqueue(conn, topic="t", payload=b"1234", max_payload_bytes=4)
        # a relay whose message.max.bytes was raised: the writer is told the same
        with pytest.raises(outboxkit.PayloadTooLargeError, match="at most 1000000"):
            enqueue(conn, topic="t", payload=b"x" * 1_000_000)
        enqueue(conn, topic="t", payload=b"x" * 1_000_000, max_message_bytes=2_000_000)
    assert [len(r.payload) for r in rows(engine)] == [4, 1_000_000]


@pytest.fixture(scope="module")
def relay_producer(kafka_bootstrap: str) -> Iterator[Any]:
    """A producer configured exactly as the relay configures its own (default settings).

    ``produce`` checks a record's size against ``message.max.bytes`` before
    anything is sent, so no broker is needed to learn what it accepts.
    """
    from confluent_kafka import Producer

    from outboxkit.relay.publish import producer_config
    from outboxkit.relay.settings import RelaySettings

    settings = RelaySettings(
        db_url="mysql+pymysql://u@127.0.0.1/db", kafka_bootstrap=kafka_bootstrap
    )
    producer = Producer(producer_config(settings, error_cb=lambda err: None))
    yield producer
    producer.purge()


def _largest_payload_produced(
    producer: Any, key: bytes | None, headers: dict[str, str | bytes], event_id: str
) -> int:
    """Binary search of the largest payload the producer takes with this key and headers."""
    from confluent_kafka import KafkaException

    pairs = [(k, v.encode() if isinstance(v, str) else v) for k, v in headers.items()]
    pairs.append(("event_id", event_id.encode()))
    lo, hi = 0, 1_100_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            producer.produce("t", value=b"x" * mid, key=key, headers=pairs)
        except KafkaException:
            hi = mid - 1
        else:
            lo = mid
            producer.purge(in_queue=True)
            producer.poll(0)  # serve the purge's reports, which frees the queue
    return lo


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    key=st.one_of(st.none(), st.binary(max_size=512)),
    headers=st.dictionaries(
        st.text(alphabet="abcé-", min_size=1, max_size=200),
        st.one_of(st.text(max_size=300), st.binary(max_size=20_000)),
        max_size=4,
    ),
    event_id=st.one_of(st.uuids().map(str), st.text(alphabet="ab0:", min_size=0, max_size=63)),
)
def test_the_size_limit_is_what_the_relays_producer_accepts(
    engine: sa.Engine,
    outbox: str,
    relay_producer: Any,
    key: bytes | None,
    headers: dict[str, str | bytes],
    event_id: str,
) -> None:
    event_id = "e" + event_id  # must start with a letter or digit
    limit = _largest_payload_produced(relay_producer, key, headers, event_id)
    with engine.connect() as conn:
        try:
            enqueue(
                conn, topic="t", payload=b"x" * limit, key=key, headers=headers, event_id=event_id
            )
        except outboxkit.EnqueueError as exc:
            pytest.fail(f"refused a payload of {limit} bytes the relay can send: {exc}")
        with pytest.raises(outboxkit.PayloadTooLargeError) as info:
            other_id = event_id[:-1] + ("a" if event_id[-1] != "a" else "b")  # same length
            enqueue(
                conn,
                topic="t",
                payload=b"x" * (limit + 1),
                key=key,
                headers=headers,
                event_id=other_id,
            )
        conn.rollback()
    message = str(info.value)
    assert "message.max.bytes" in message and "headers" in message and "key" in message


topics = st.one_of(
    st.text(alphabet="abcXYZ019._-", min_size=1, max_size=20),
    st.text(alphabet=st.sampled_from("abcXYZ019._-") | st.characters(), min_size=0, max_size=260),
)
# Every code point, lone surrogates included, and NUL often: names and values
# that cannot travel to Kafka intact must be refused, not stored.
any_text = st.one_of(
    st.text(alphabet="\x00ab\ud800\udfff", min_size=1, max_size=4),
    st.text(alphabet=st.characters(codec=None, categories=None), max_size=12),
)
header_values = st.one_of(any_text, st.binary(max_size=30))
headers = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(
            st.text(alphabet="\x00ab", min_size=1, max_size=4),
            any_text,
            st.integers(),
            st.binary(max_size=4),
        ),
        header_values,
        min_size=1,
        max_size=3,
    ),
)
payloads = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100),
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=5),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3),
)


@on_both_databases
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    topic=topics, hdrs=headers, payload=payloads, key=st.one_of(st.none(), st.binary(max_size=40))
)
@example(topic="t", hdrs={"a\x00b": "v"}, payload=b"", key=None)
def test_arbitrary_input_round_trips_or_raises_documented_error(
    engine: sa.Engine, outbox: str, topic: str, hdrs: Any, payload: Any, key: bytes | None
) -> None:
    with engine.connect() as conn:
        try:
            event_id = enqueue(conn, topic=topic, payload=payload, key=key, headers=hdrs)
        except outboxkit.EnqueueError:
            conn.rollback()
            return
        conn.commit()
    t = outbox_table(outbox)
    with engine.connect() as conn:
        row = conn.execute(outbox_rows_query(outbox).where(t.c.event_id == event_id)).one()
    assert row.topic == topic
    assert row.message_key == key
    expected = (
        payload
        if isinstance(payload, bytes)
        else payload.encode()
        if isinstance(payload, str)
        else json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    )
    assert row.payload == expected
    assert decode_headers(row.headers) == (hdrs or {})
    # What the relay hands to librdkafka: names are C strings there (a NUL would
    # cut them short) and everything is UTF-8 on the wire.
    for name, value in kafka_headers(row.headers, event_id):
        assert "\x00" not in name
        assert name.encode("utf-8").decode("utf-8") == name
        assert isinstance(value, bytes)
