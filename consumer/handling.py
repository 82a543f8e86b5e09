"""What a worker does with one message: handle it, retry it later, or dead-letter it.

:meth:`Handling.process` never raises for a handler's exception and never
sleeps for a retry. It returns a :class:`Result`:

* ``SUCCESS`` / ``DUPLICATE`` (inbox: seen before, handler skipped): done;
* ``RETRY`` with a delay: a transient failure with attempts and time left;
* ``DEAD_LETTERED``: the handler gave up (permanent, or retries exhausted) and
  the dead-letter write was acknowledged: done;
* ``DLQ_BLOCKED`` with a delay: the handler gave up but the dead-letter write
  failed; the message is kept and only the write is tried again later.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from outboxkit.consumer.dlq import DeadLetters, DeadLetterUnavailable, Failure
from outboxkit.consumer.errors import Classification, InvalidMessageError
from outboxkit.consumer.inbox import Inbox
from outboxkit.consumer.message import Message
from outboxkit.consumer.metrics import ConsumerMetrics, HandleTimes
from outboxkit.consumer.retry import RetryPolicy
from outboxkit.consumer.workers import WorkItem
from outboxkit.runtime.logs import describe_exception, exception_text, log_event, redact
from outboxkit.runtime.tracing import ConsumerTracing

__all__ = ["Handling", "Outcome", "Result"]

_log = logging.getLogger("outboxkit.consumer")


class Outcome(enum.Enum):
    SUCCESS = "success"
    DUPLICATE = "duplicate"
    DEAD_LETTERED = "dlq"
    RETRY = "retry"
    DLQ_BLOCKED = "dlq-blocked"
    RELEASED = "released"  # not finished here; Kafka redelivers it

    def __init__(self, value: str) -> None:
        # A plain attribute, read once or twice per message: a property doing a
        # set lookup costs more (Enum hashing is Python code).
        #: Done for good: the offset may move past it.
        self.final = value in ("success", "duplicate", "dlq")


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    delay: float | None = None
    error: str | None = None


# Results are immutable: the two common ones are shared instead of built per message.
_SUCCESS = Result(Outcome.SUCCESS)
_DUPLICATE = Result(Outcome.DUPLICATE)


class Handling:
    def __init__(
        self,
        *,
        handler: Callable[[Message], None],
        classify: Callable[[BaseException], Classification],
        on_failure: Callable[[Message, BaseException, int], None],
        policy: RetryPolicy,
        dead_letters: DeadLetters,
        inbox: Inbox | None,
        metrics: ConsumerMetrics,
        tracing: ConsumerTracing | None = None,
    ) -> None:
        self.handler = handler
        self.classify = classify
        self.on_failure = on_failure
        self.policy = policy
        self.dead_letters = dead_letters
        self.inbox = inbox
        self.metrics = metrics
        #: CONSUMER spans around each attempt; None without OpenTelemetry or a provider.
        self.tracing = tracing

    def process(self, item: WorkItem, times: HandleTimes | None = None) -> Result:
        """Handle ``item`` once (or dead-letter it); the handler's time goes to
        ``times`` (a worker's batch of ``worker_handle_seconds``) or the histogram."""
        if item.failure is None:
            result = self._attempt(item, times)
            if result is not None:
                return result
        return self._dead_letter(item)

    def _attempt(self, item: WorkItem, times: HandleTimes | None) -> Result | None:
        """Run the handler once; None means "gave up": dead-letter it."""
        started = time.monotonic()
        item.first_attempt_at = item.first_attempt_at or started
        item.attempts += 1
        error: BaseException
        if item.group_error is not None:
            # It already ran, in a group transaction that was rolled back (see
            # consumer/batching.py): that was this attempt.
            error, item.group_error = item.group_error, None
        else:
            timer = time.perf_counter()
            try:
                try:
                    if self.tracing is None:
                        duplicate = self._run(item.message)
                    else:
                        with self.tracing.span(item.message):
                            duplicate = self._run(item.message)
                finally:
                    (self.metrics.handle_seconds if times is None else times).observe(
                        time.perf_counter() - timer
                    )
            except Exception as exc:
                error = exc
            else:
                return _DUPLICATE if duplicate else _SUCCESS

        if isinstance(error, InvalidMessageError) and item.message._headers_invalid():
            # The handler or the inbox read headers that cannot be decoded (a name
            # that is not UTF-8): the record's fault, whatever classify says. The
            # headers are only checked when read: a handler that never reads them
            # handles such a record like any other.
            self._give_up(item, error, Classification.PERMANENT)
            return None
        kind = self.classify(error)
        text = redact(describe_exception(error))
        if kind is Classification.UNAVAILABLE:
            return self._wait_for_dependency(item, text)
        item.outages = 0
        if kind is Classification.TRANSIENT:
            delay = self.policy.next_delay(
                attempts=item.attempts, started_at=item.first_attempt_at, now=time.monotonic()
            )
            if delay is not None:
                log_event(
                    _log,
                    "handler-retry",
                    level=logging.WARNING,
                    **_where(item.message),
                    attempt=item.attempts,
                    attempts_left=self.policy.max_attempts - item.attempts,
                    retry_in_s=round(delay, 3),
                    error=text,
                )
                return Result(Outcome.RETRY, delay=delay, error=text)
        self._give_up(item, error, kind)
        return None

    def _wait_for_dependency(self, item: WorkItem, text: str) -> Result:
        """A dependency failed, not the message: retry it with capped backoff for as
        long as that lasts. The attempt and the time are not counted against the
        message's retry budget, and it is never dead-lettered for this."""
        item.attempts -= 1
        item.first_attempt_at = None
        item.outages += 1
        delay = self.policy.backoff(item.outages)
        log_event(
            _log,
            "handler-retry",
            level=logging.WARNING,
            **_where(item.message),
            classification=Classification.UNAVAILABLE.value,
            outages=item.outages,
            retry_in_s=round(delay, 3),
            error=text,
        )
        return Result(Outcome.RETRY, delay=delay, error=text)

    def _give_up(self, item: WorkItem, error: BaseException, kind: Classification) -> None:
        """Record why the handler gave up (dead-letter it next); log and call the hook."""
        text = redact(describe_exception(error))
        item.failure = Failure.of(
            error, attempts=item.attempts, permanent=kind is Classification.PERMANENT
        )
        log_event(
            _log,
            "handler-gave-up",
            level=logging.ERROR,
            **_where(item.message),
            attempts=item.attempts,
            classification=kind.value,
            error=text,
            exc_info=error,
        )
        self._call_on_failure(item.message, error, item.attempts)

    def _run(self, message: Message) -> bool:
        if self.inbox is None:
            self.handler(message)
            return False
        return self.inbox.run(message, self.handler)

    def _dead_letter(self, item: WorkItem) -> Result:
        assert isinstance(item.failure, Failure)
        try:
            topic = self.dead_letters.send(item.message, item.failure)
        except DeadLetterUnavailable as exc:
            item.dlq_attempts += 1
            self.metrics.dlq_unavailable.inc()
            delay = self.policy.backoff(item.dlq_attempts)
            return Result(Outcome.DLQ_BLOCKED, delay=delay, error=exception_text(exc))
        log_event(
            _log,
            "dead-lettered",
            level=logging.WARNING,
            **_where(item.message),
            dlq_topic=topic,
            attempts=item.failure.attempts,
            error_class=item.failure.error_class,
        )
        return Result(Outcome.DEAD_LETTERED)

    def _call_on_failure(self, message: Message, exc: BaseException, attempts: int) -> None:
        try:
            self.on_failure(message, exc, attempts)
        except Exception as hook_exc:  # a hook never breaks the loop
            log_event(
                _log,
                "hook-failed",
                level=logging.ERROR,
                hook="on_failure",
                error=redact(describe_exception(hook_exc)),
            )


def _where(message: Message) -> dict[str, object]:
    try:
        event_id = message.event_id
    except InvalidMessageError:  # undecodable headers: no event id to show
        event_id = None
    return {
        "topic": message.topic,
        "partition": message.partition,
        "offset": message.offset,
        "event_id": event_id,
    }
