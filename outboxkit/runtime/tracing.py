"""OpenTelemetry trace context from the writer through the relay to the consumer.

Optional: it needs ``opentelemetry-api`` (the ``otel`` extra).
Without it, or without a configured tracer provider, every hook here is a
no-op and nothing about events, Kafka records or handling changes.

* **Writer** (:func:`trace_headers`): called inside a span whose context is
  valid, ``enqueue`` stores the W3C ``traceparent`` (and ``tracestate`` when
  there is one) in the event's headers. Headers the caller set win: when the
  caller's headers already hold ``traceparent`` or ``tracestate``, neither is
  added or changed. Only W3C trace context is stored, never baggage (it would
  grow every record by an amount nobody checked).
* **Relay** (:class:`ProducerTracing`): for a row that carries a valid
  ``traceparent``, a ``send <topic>`` span of kind PRODUCER, child of the
  writer's context, from ``produce`` to the delivery report; the record's
  ``traceparent`` then names that span (same trace id, same length, so the
  record size the writer checked does not change; ``tracestate`` is sent as
  stored). Rows written outside any trace get no span and are sent as stored.
* **Consumer** (:class:`ConsumerTracing`): a ``process <topic>`` span of kind
  CONSUMER around each handler attempt, continuing the trace of the record's
  ``traceparent`` (a new trace when it has none). It is the current span while
  the handler runs, so the handler's own spans and any event it enqueues join
  the trace.

Whether to trace is decided once per component, when the relay's producer or
the consumer's handling is built: a tracer provider set later is not picked up
by a running relay or consumer. The writer looks at the current span on each
call (a context variable read; nothing more without an active span).

Span attributes follow the OpenTelemetry messaging semantic conventions:
``messaging.system`` (``kafka``), ``messaging.destination.name``,
``messaging.operation.type`` / ``.name``, ``messaging.message.id`` (the event
id), ``messaging.destination.partition.id`` and ``messaging.kafka.offset`` once
known, plus the older ``messaging.kafka.destination.partition`` that many
backends still chart; ``messaging.client.id`` (the relay's node id) and
``messaging.consumer.group.name``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "ConsumerTracing",
    "ProducerTracing",
    "consumer_tracing",
    "producer_tracing",
    "trace_headers",
    "with_trace_headers",
]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
# opentelemetry-api is imported on first use (:func:`_load`), not with the writer:
# a service that only calls ``enqueue`` outside any trace never pays for it.
_trace: Any = None
_PROPAGATOR: Any = None
_loaded = False
_INSTRUMENTATION = "outboxkit"
_log = logging.getLogger("outboxkit.tracing")
_failed: set[str] = set()


def _hook_failed(where: str, exc: Exception) -> None:
    """Tracing is a hook: a failure is logged (once per place) and never breaks the
    relay's or the consumer's loop; the row or message goes on untraced."""
    if where in _failed:
        return
    _failed.add(where)
    from outboxkit.runtime.logs import log_event, redact  # the writer has no other use

    log_event(
        _log,
        "tracing-failed",
        level=logging.WARNING,
        where=where,
        error=redact(f"{type(exc).__name__}: {exc}"),
        effect="sent or handled without this span; logged once per process",
    )


def _load() -> bool:
    """Import ``opentelemetry-api`` once; True when it is installed (the otel extra).
    Without it every hook here is a no-op."""
    global _trace, _PROPAGATOR, _loaded
    if not _loaded:
        _loaded = True
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            return False
        _trace, _PROPAGATOR = trace, TraceContextTextMapPropagator()
    return _trace is not None


def available() -> bool:
    """True when ``opentelemetry-api`` is importable."""
    return _load()


def trace_headers() -> dict[str, str] | None:
    """``traceparent`` (and ``tracestate``) of the current span, or None.

    None without OpenTelemetry or without a valid current span context; the
    current span need not be recording (a propagated context counts too).
    """
    if not _loaded and "opentelemetry.trace" not in sys.modules:
        # No span can be current while nothing has imported OpenTelemetry's trace API.
        return None
    if not _load():
        return None
    if not _trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    assert _PROPAGATOR is not None
    _PROPAGATOR.inject(carrier)
    return carrier or None


def with_trace_headers(headers: Any, trace: Mapping[str, str] | None) -> Any:
    """``headers`` with ``trace`` added, unless the caller set a trace header itself.

    Anything that is not a mapping is returned as it is, for the writer's
    validation to refuse with its usual message.
    """
    if not trace:
        return headers
    if headers is None:
        return dict(trace)
    if not isinstance(headers, Mapping) or any(name in headers for name in _TRACE_HEADERS):
        return headers
    return {**headers, **trace}


def _tracer() -> Tracer | None:
    """A tracer of the configured provider, or None (no OpenTelemetry, no provider)."""
    if not _load():
        return None
    provider = _trace.get_tracer_provider()
    if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
        return None
    tracer: Tracer = provider.get_tracer(_INSTRUMENTATION, _version())
    return tracer


def _version() -> str | None:
    try:
        return version("outboxkit")
    except PackageNotFoundError:
        return None


def _carrier(headers: Sequence[tuple[str, bytes | str | None]]) -> dict[str, str]:
    """The trace headers of a record (last value wins, as Kafka consumers read them)."""
    out: dict[str, str] = {}
    for name, value in headers:
        if name in _TRACE_HEADERS and value is not None:
            out[name] = value if isinstance(value, str) else value.decode("ascii", "replace")
    return out


#: A delivery callback as confluent-kafka calls it: (error or None, message).
DeliveryCallback = Callable[[Any, Any], None]


class ProducerTracing:
    """The relay's PRODUCER spans; build it with :func:`producer_tracing`.

    :meth:`send` starts a span for a row that carries a trace and wraps the
    row's delivery callback so the report ends it; :meth:`abandon` ends the
    spans of a batch whose reports did not arrive (released, drained).
    """

    def __init__(self, tracer: Tracer, *, client_id: str) -> None:
        self._tracer = tracer
        self._client_id = client_id

    def send(
        self,
        topic: str,
        event_id: str,
        headers: list[tuple[str, str | bytes | None]],
        callback: DeliveryCallback,
        spans: dict[int, Any],
        row_id: int,
    ) -> tuple[list[tuple[str, str | bytes | None]], DeliveryCallback]:
        """The headers and callback to produce with; unchanged for an untraced row
        (or when tracing fails: the row is sent as stored)."""
        try:
            started = self._start_span(topic, event_id, headers)
        except Exception as exc:
            _hook_failed("producer-span", exc)
            return headers, callback
        if started is None:
            return headers, callback
        span, sent = started
        spans[row_id] = span

        def on_delivery(err: Any, msg: Any) -> None:
            ended = spans.pop(row_id, None)
            if ended is not None:
                try:
                    _end_delivered(ended, err, msg)
                except Exception as exc:  # the report itself must still land
                    _hook_failed("producer-span-end", exc)
            callback(err, msg)

        return sent, on_delivery

    def _start_span(
        self, topic: str, event_id: str, headers: list[tuple[str, str | bytes | None]]
    ) -> tuple[Span, list[tuple[str, str | bytes | None]]] | None:
        """The producer span of a traced row and the headers that continue it;
        None for a row without a traceparent we can continue."""
        carrier = _carrier(headers)
        if TRACEPARENT not in carrier:
            return None
        assert _PROPAGATOR is not None and _trace is not None
        parent = _PROPAGATOR.extract(carrier)
        if not _trace.get_current_span(parent).get_span_context().is_valid:
            return None  # not a traceparent we can continue: send as stored
        span = self._tracer.start_span(
            f"send {topic}",
            context=parent,
            kind=_trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.destination.name": topic,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.message.id": event_id,
                "messaging.client.id": self._client_id,
            },
        )
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=_trace.set_span_in_context(span))
        traceparent = out[TRACEPARENT].encode("ascii")
        sent: list[tuple[str, str | bytes | None]] = [
            (n, traceparent if n == TRACEPARENT else v) for n, v in headers
        ]
        return span, sent

    @staticmethod
    def abandon(spans: dict[int, Any]) -> None:
        """End the spans still open: their rows got no delivery report."""
        while spans:
            _row_id, span = spans.popitem()
            try:
                span.set_attribute("outboxkit.outcome", "no-delivery-report")
                span.end()
            except Exception as exc:
                _hook_failed("producer-span-end", exc)


def _end_delivered(span: Span, err: Any, msg: Any) -> None:
    assert _trace is not None
    try:
        if err is None:
            partition, offset = msg.partition(), msg.offset()
            span.set_attribute("messaging.destination.partition.id", str(partition))
            span.set_attribute("messaging.kafka.destination.partition", partition)
            span.set_attribute("messaging.kafka.offset", offset)
        else:
            span.set_attribute("error.type", err.name())
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"{err.name()}: {err.str()}"))
    finally:
        span.end()


def producer_tracing(*, client_id: str) -> ProducerTracing | None:
    """The relay's producer tracing, or None when there is nothing to trace to."""
    tracer = _tracer()
    return None if tracer is None else ProducerTracing(tracer, client_id=client_id)


class ConsumerTracing:
    """The consumer's CONSUMER spans; build it with :func:`consumer_tracing`.

    :meth:`span` is a context manager for sync and async handlers alike: it
    makes the span current on entry, records an exception that leaves it
    (status ERROR), and ends the span on exit.
    """

    def __init__(self, tracer: Tracer, *, group: str) -> None:
        self._tracer = tracer
        self._group = group

    @contextlib.contextmanager
    def span(self, message: Any) -> Iterator[Span | None]:
        """``with tracing.span(message): handle(message)``.

        ``message`` is an ``outboxkit.consumer.Message``: its headers, topic,
        partition, offset and event id are read (an undecodable header block
        starts a new trace instead of failing here). If the span cannot be
        started, the body runs without one (None) and the failure is logged.
        Exceptions of the body pass through unchanged.
        """
        with contextlib.ExitStack() as stack:
            try:
                span: Span | None = stack.enter_context(self._start(message))
            except Exception as exc:
                _hook_failed("consumer-span", exc)
                span = None
            yield span

    def _start(self, message: Any) -> contextlib.AbstractContextManager[Span]:
        assert _PROPAGATOR is not None and _trace is not None
        try:
            carrier = _carrier(message.headers)
        except ValueError:  # InvalidMessageError: the handling reports it, not the span
            carrier = {}
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.destination.name": message.topic,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.consumer.group.name": self._group,
            "messaging.destination.partition.id": str(message.partition),
            "messaging.kafka.destination.partition": message.partition,
            "messaging.kafka.offset": message.offset,
        }
        with contextlib.suppress(ValueError):
            event_id = message.event_id
            if event_id:
                attributes["messaging.message.id"] = event_id
        return self._tracer.start_as_current_span(
            f"process {message.topic}",
            context=_PROPAGATOR.extract(carrier),
            kind=_trace.SpanKind.CONSUMER,
            attributes=attributes,
        )


def consumer_tracing(*, group: str) -> ConsumerTracing | None:
    """The consumer's tracing, or None when there is nothing to trace to."""
    tracer = _tracer()
    return None if tracer is None else ConsumerTracing(tracer, group=group)
