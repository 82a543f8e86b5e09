"""Trace context writer -> row -> Kafka header -> consumer span, on the real services.

The OpenTelemetry SDK's in-memory exporter collects the spans. The global
tracer provider can be set only once per process, so the ``spans`` fixture
installs one for the test and takes it away again (as OpenTelemetry's own test
utilities do): a relay or consumer built afterwards sees no provider and traces
nothing, like every other test in the suite expects.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once
from support.waiting import wait_for

from outboxkit import Event, enqueue, enqueue_async, enqueue_many, enqueue_many_async
from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.errors import PayloadTooLargeError
from outboxkit.relay import Relay, RelaySettings
from outboxkit.runtime import tracing
from outboxkit.schema import decode_headers, outbox_rows_query, outbox_table
from outboxkit.writer import kafka_record_size

pytestmark = pytest.mark.integration

_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _traceparent(ctx: trace.SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def _ids(ctx: trace.SpanContext | None) -> tuple[int, int]:
    assert ctx is not None
    return ctx.trace_id, ctx.span_id


def _set_provider(provider: TracerProvider | None) -> None:
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    if provider is not None:
        trace.set_tracer_provider(provider)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _set_provider(provider)
    try:
        yield exporter
    finally:
        _set_provider(None)
        provider.shutdown()


@pytest.fixture
def app_tracer() -> trace.Tracer:
    """A tracer for the service's own spans that is not the global provider."""
    provider = TracerProvider()
    return provider.get_tracer("order-service")


def _stored_headers(engine: sa.Engine, table: str) -> list[dict[str, Any]]:
    t = outbox_table(table)
    with engine.connect() as conn:
        stored = conn.execute(outbox_rows_query(table).order_by(t.c.id))
        return [decode_headers(r.headers) for r in stored]


# -- the writer -------------------------------------------------------------------------


def test_enqueue_inside_a_span_stores_its_w3c_context(
    engine: sa.Engine, outbox: str, app_tracer: trace.Tracer
) -> None:
    with app_tracer.start_as_current_span("place-order") as span, engine.begin() as conn:
        ctx = span.get_span_context()
        enqueue(conn, topic="orders", payload={"n": 1}, key="k", headers={"h": "v"})
        enqueue_many(conn, [Event(topic="orders", payload={"n": 2})])
    with engine.begin() as conn:  # no span: nothing added
        enqueue(conn, topic="orders", payload={"n": 3})
    first, second, third = _stored_headers(engine, outbox)
    expected = _traceparent(ctx)
    assert first == {"h": "v", "traceparent": expected}
    assert second == {"traceparent": expected}
    assert third == {}


def test_the_async_writer_stores_the_context_of_the_awaiting_task(
    engine: sa.Engine, db_url: str, outbox: str, app_tracer: trace.Tracer
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine
    from test_writer_async import async_url

    async def write() -> trace.SpanContext:
        aengine = create_async_engine(async_url(db_url))
        try:
            with app_tracer.start_as_current_span("place-order") as span:
                async with aengine.begin() as conn:
                    await enqueue_async(conn, topic="orders", payload={"n": 1})
                    await enqueue_many_async(conn, [Event(topic="orders", payload={"n": 2})])
            return span.get_span_context()
        finally:
            await aengine.dispose()

    ctx = asyncio.run(write())
    expected = _traceparent(ctx)
    assert _stored_headers(engine, outbox) == [{"traceparent": expected}] * 2


@given(
    given_headers=st.dictionaries(
        st.sampled_from(["traceparent", "tracestate", "h", "x-request-id"]),
        st.text(alphabet="abcdef0123456789-=,", max_size=60),
        max_size=4,
    ),
    state=st.sampled_from(["", "vendor=abc", "a=1,b=2"]),
)
@settings(max_examples=40, deadline=None, derandomize=True)
def test_a_trace_header_the_caller_set_is_never_overwritten(
    given_headers: dict[str, str], state: str
) -> None:
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    ctx = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=False,
        trace_flags=TraceFlags(1),
        trace_state=TraceState.from_header([state]) if state else TraceState(),
    )
    with trace.use_span(NonRecordingSpan(ctx)):
        added = tracing.trace_headers()
    assert added is not None and added["traceparent"] == _TRACEPARENT
    assert added.get("tracestate", "") == state
    merged = tracing.with_trace_headers(given_headers, added)
    if "traceparent" in given_headers or "tracestate" in given_headers:
        assert merged == given_headers  # the caller's trace headers, untouched, none added
    else:
        assert merged == {**given_headers, **added}


def test_the_record_size_check_counts_the_trace_headers(
    engine: sa.Engine, outbox: str, app_tracer: trace.Tracer
) -> None:
    limit = kafka_record_size(b"x" * 100, None, [("event_id", b"e-1")])
    with engine.begin() as conn:  # fits exactly without a trace
        enqueue(conn, topic="orders", payload=b"x" * 100, event_id="e-1", max_message_bytes=limit)
    with (
        pytest.raises(PayloadTooLargeError),
        app_tracer.start_as_current_span("place-order"),
        engine.begin() as conn,
    ):
        enqueue(conn, topic="orders", payload=b"x" * 100, event_id="e-2", max_message_bytes=limit)
    assert len(_stored_headers(engine, outbox)) == 1


# -- writer -> relay -> consumer --------------------------------------------------------


class _Handled(Consumer):
    """Records each message and opens a span of its own inside the handler."""

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.seen: list[Message] = []

    def handle(self, message: Message) -> None:
        with trace.get_tracer("handler").start_as_current_span("charge-card"):
            self.seen.append(message)


class _HandledAsync(_Handled):
    """The same with ``async def handle``: it runs on the consumer's event loop thread."""

    async def handle(self, message: Message) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        with trace.get_tracer("handler").start_as_current_span("charge-card"):
            self.seen.append(message)


def _relay_settings(db_url: str, bootstrap: str) -> RelaySettings:
    return RelaySettings(
        db_url=db_url,
        kafka_bootstrap=bootstrap,
        kafka_config={"message.timeout.ms": "5000"},
        poll_interval=0.05,
        start_jitter=0.0,
        health_port=0,
        node_id=f"relay-{uuid.uuid4().hex[:6]}",
    )


def _run_relay_until(relay: Relay, done: Callable[[], bool]) -> None:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        wait_for(done, timeout=30, what="deliveries")
    finally:
        relay.stop()
        thread.join(30)
    assert not thread.is_alive()


def _consume(settings: ConsumerSettings, expected: int, handler: str = "sync") -> _Handled:
    consumer = _Handled(settings) if handler == "sync" else _HandledAsync(settings)
    thread = threading.Thread(target=consumer.run, kwargs={"handle_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(consumer.seen) >= expected, timeout=60, what="messages handled")
    finally:
        consumer.stop()
        thread.join(30)
    assert not thread.is_alive()
    return consumer


def _consumer_settings(bootstrap: str, topic: str) -> ConsumerSettings:
    return ConsumerSettings(
        kafka_bootstrap=bootstrap,
        topics=(topic,),
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        health_port=0,
        kafka_config={"auto.offset.reset": "earliest", "session.timeout.ms": "6000"},
        worker_drain_timeout=5.0,
        close_timeout=5.0,
    )


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name.split(" ")[0], []).append(span)
    return out


@pytest.mark.parametrize(("writer", "handler"), [("sync", "sync"), ("async", "async")])
def test_one_trace_from_the_writer_through_the_relay_to_the_handler(
    writer: str,
    handler: str,
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    spans: InMemorySpanExporter,
) -> None:
    topic = kafka_topics(partitions=2)
    app = trace.get_tracer("order-service")

    if writer == "sync":
        with app.start_as_current_span("place-order"), engine.begin() as conn:
            event_id = enqueue(conn, topic=topic, payload={"order": 1}, key="order-1")
    else:
        from sqlalchemy.ext.asyncio import create_async_engine
        from test_writer_async import async_url

        async def write() -> str:
            aengine = create_async_engine(async_url(db_url))
            try:
                with app.start_as_current_span("place-order"):
                    async with aengine.begin() as conn:
                        return await enqueue_async(
                            conn, topic=topic, payload={"order": 1}, key="order-1"
                        )
            finally:
                await aengine.dispose()

        event_id = asyncio.run(write())
    with engine.begin() as conn:  # written outside any trace: no spans, sent as stored
        untraced = enqueue(conn, topic=topic, payload={"order": 2}, key="order-2")

    relay = Relay(_relay_settings(db_url, kafka_bootstrap))
    _run_relay_until(
        relay, lambda: relay.registry.get_sample_value("outbox_rows_delivered_total") == 2
    )
    consumer = _consume(_consumer_settings(kafka_bootstrap, topic), expected=2, handler=handler)

    named = _by_name(spans)
    [place] = named["place-order"]
    [send] = named["send"]
    processes = {s.attributes["messaging.message.id"]: s for s in named["process"]}  # type: ignore[index]
    process = processes[event_id]
    [charge] = [s for s in named["charge-card"] if _ids(s.parent) == _ids(process.context)]
    assert place.context is not None and send.context is not None
    trace_id = place.context.trace_id
    assert {_ids(s.context)[0] for s in (send, process, charge)} == {trace_id}
    assert send.kind is SpanKind.PRODUCER and _ids(send.parent) == _ids(place.context)
    assert process.kind is SpanKind.CONSUMER and _ids(process.parent) == _ids(send.context)
    assert send.name == f"send {topic}" and process.name == f"process {topic}"

    message = next(m for m in consumer.seen if m.event_id == event_id)
    assert send.attributes == {
        "messaging.system": "kafka",
        "messaging.destination.name": topic,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.message.id": event_id,
        "messaging.client.id": relay.settings.node_id,
        "messaging.destination.partition.id": str(message.partition),
        "messaging.kafka.destination.partition": message.partition,
        "messaging.kafka.offset": message.offset,
    }
    assert process.attributes == {
        "messaging.system": "kafka",
        "messaging.destination.name": topic,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.consumer.group.name": consumer.group,
        "messaging.destination.partition.id": str(message.partition),
        "messaging.kafka.destination.partition": message.partition,
        "messaging.kafka.offset": message.offset,
        "messaging.message.id": event_id,
    }
    # The record's traceparent names the relay's span: same trace, same length.
    sent = dict(message.headers)["traceparent"].decode()
    assert send.context is not None and sent == _traceparent(send.context)

    # The untraced row: no send span, a consumer span that starts its own trace.
    other = processes[untraced]
    assert other.parent is None and _ids(other.context)[0] != trace_id
    plain = next(m for m in consumer.seen if m.event_id == untraced)
    assert [name for name, _ in plain.headers] == ["event_id"]


def test_without_a_tracer_provider_the_writer_context_travels_as_stored(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    app_tracer: trace.Tracer,
) -> None:
    assert tracing.producer_tracing(client_id="x") is None  # nothing configured globally
    assert tracing.consumer_tracing(group="g") is None
    topic = kafka_topics(partitions=1)
    with app_tracer.start_as_current_span("place-order") as span, engine.begin() as conn:
        enqueue(conn, topic=topic, payload={"order": 1}, headers={"tracestate": "v=1"})
        enqueue(conn, topic=topic, payload={"order": 2})
        ctx = span.get_span_context()
    relay = Relay(_relay_settings(db_url, kafka_bootstrap))
    _run_relay_until(
        relay, lambda: relay.registry.get_sample_value("outbox_rows_delivered_total") == 2
    )
    consumer = _consume(_consumer_settings(kafka_bootstrap, topic), expected=2)
    first, second = sorted(consumer.seen, key=lambda m: m.offset)
    # The caller's own trace header is kept as given, and nothing is added next to it.
    assert [n for n, _ in first.headers] == ["tracestate", "event_id"]
    assert dict(second.headers)["traceparent"].decode() == (_traceparent(ctx))


@pytest.mark.unit
def test_the_package_works_without_opentelemetry() -> None:
    probe = (
        "import sys\n"
        "for name in ('opentelemetry', 'opentelemetry.trace'):\n"
        "    sys.modules[name] = None  # as if the otel extra were not installed\n"
        "import outboxkit, outboxkit.relay.publish, outboxkit.consumer.handling\n"
        "from outboxkit.runtime import tracing\n"
        "assert not tracing.available() and tracing.trace_headers() is None\n"
        "assert tracing.producer_tracing(client_id='x') is None\n"
        "assert tracing.consumer_tracing(group='g') is None\n"
        "assert tracing.with_trace_headers({'h': 'v'}, None) == {'h': 'v'}\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.unit
def test_the_otel_extra_brings_the_api_only() -> None:
    import importlib.metadata as md

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in md.requires("outboxkit") or ()]
    otel = {r.name.lower() for r in reqs if r.marker and r.marker.evaluate({"extra": "otel"})}
    assert otel == {"opentelemetry-api"}
    dev = [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "dev"})]
    assert any(r.name == "outboxkit" and "otel" in r.extras for r in dev)
    assert any(r.name.lower() == "opentelemetry-sdk" for r in dev)


# -- tracing is a hook: its failures never stop a row or a message ------------------------


class _BrokenTracer:
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exporter exploded")

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exporter exploded")


class _BrokenSpan:
    def set_attribute(self, *args: Any) -> None:
        raise RuntimeError("span exploded")

    def end(self) -> None:
        raise RuntimeError("span exploded")


@pytest.mark.unit
def test_a_failing_tracer_sends_the_row_as_stored_and_logs_once() -> None:
    from outboxkit.runtime.testing import capture_json_logs

    tracing._failed.clear()
    producer = tracing.ProducerTracing(_BrokenTracer(), client_id="r")  # type: ignore[arg-type]
    headers: list[tuple[str, str | bytes | None]] = [
        ("traceparent", _TRACEPARENT.encode()),
        ("event_id", b"e-1"),
    ]
    got: list[Any] = []

    def callback(err: Any, msg: Any) -> None:
        got.append((err, msg))

    spans: dict[int, Any] = {}
    with capture_json_logs() as cap:
        for row_id in (1, 2):
            sent, cb = producer.send("orders", "e-1", headers, callback, spans, row_id)
            assert sent is headers and cb is callback
    assert spans == {}
    [failed] = cap.events("tracing-failed")
    assert failed["where"] == "producer-span" and "exporter exploded" in str(failed["error"])


@pytest.mark.unit
def test_a_span_that_fails_to_end_still_delivers_the_report() -> None:
    tracing._failed.clear()
    got: list[Any] = []
    provider = TracerProvider()
    producer = tracing.ProducerTracing(provider.get_tracer("t"), client_id="r")
    spans: dict[int, Any] = {}
    _, cb = producer.send(
        "orders",
        "e-1",
        [("traceparent", _TRACEPARENT.encode())],
        lambda err, msg: got.append((err, msg)),
        spans,
        7,
    )
    spans[7] = _BrokenSpan()
    msg = types.SimpleNamespace(partition=lambda: 0, offset=lambda: 5)
    cb(None, msg)
    assert got == [(None, msg)]
    spans[8] = _BrokenSpan()
    tracing.ProducerTracing.abandon(spans)
    assert spans == {}


@pytest.mark.unit
def test_a_failing_tracer_still_runs_the_handler_and_lets_its_error_through() -> None:
    tracing._failed.clear()
    consumer = tracing.ConsumerTracing(_BrokenTracer(), group="g")  # type: ignore[arg-type]
    message = Message(topic="t", partition=0, offset=1, key=None, value=b"v")
    ran: list[Any] = []
    with consumer.span(message) as span:
        ran.append(span)
    assert ran == [None]
    with pytest.raises(KeyError), consumer.span(message):
        raise KeyError("the handler's own error")
