"""Consumer classes the subprocess tests run with ``python -m outboxkit consume``.

Parameters come from ``APP_*`` environment variables so one class serves several tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import sqlalchemy as sa

from outboxkit.consumer import Consumer, Message, PermanentError
from outboxkit.runtime.logs import log_event

log = logging.getLogger("consumer_apps")

effects = sa.Table(
    "effects",
    sa.MetaData(),
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(64), nullable=False),
    sa.Column("kafka_partition", sa.Integer, nullable=False),
    sa.Column("kafka_offset", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)


class RecordEffects(Consumer):
    """Writes one ``effects`` row per message through ``message.tx`` (inbox on)."""

    def handle(self, message: Message) -> None:
        message.tx.execute(
            effects.insert().values(
                event_id=message.event_id or "",
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=os.getpid(),
            )
        )


class RecordEffectsAsync(Consumer):
    """:class:`RecordEffects` as an ``async def handle``, through ``message.async_tx``."""

    async def handle(self, message: Message) -> None:
        await message.async_tx.execute(
            effects.insert().values(
                event_id=message.event_id or "",
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=os.getpid(),
            )
        )


class Sleepy(Consumer):
    """A message whose value is ``sleep:<seconds>`` sleeps that long; logs start and end."""

    def handle(self, message: Message) -> None:
        text = (message.value or b"").decode()
        where = {"partition": message.partition, "offset": message.offset}
        log_event(log, "handler-started", **where)
        if text.startswith("sleep:"):
            time.sleep(float(text.split(":", 1)[1]))
        log_event(log, "handler-finished", **where)


class SleepyAsync(Consumer):
    """:class:`Sleepy` as an ``async def handle`` (``asyncio.sleep``); logs a cancellation."""

    async def handle(self, message: Message) -> None:
        text = (message.value or b"").decode()
        where = {"partition": message.partition, "offset": message.offset}
        log_event(log, "handler-started", **where)
        try:
            if text.startswith("sleep:"):
                await asyncio.sleep(float(text.split(":", 1)[1]))
        except asyncio.CancelledError:
            log_event(log, "handler-cancelled", **where)
            raise
        log_event(log, "handler-finished", **where)


class NotAConsumer:
    pass


class ReadsHeaders(Consumer):
    """Reads every header and the event id of each message; logs ``handled`` with them."""

    def handle(self, message: Message) -> None:
        names = [name for name, _ in message.headers]
        log_event(
            log,
            "handled",
            partition=message.partition,
            offset=message.offset,
            event_id=message.event_id,
            headers=names,
        )


class GivesUp(Consumer):
    """Every message is refused for good, so each one goes to the dead-letter topic."""

    def handle(self, message: Message) -> None:
        from outboxkit.consumer import PermanentError

        raise PermanentError(f"order at offset {message.offset} cannot be handled")


class OrderTypes(Consumer):
    """Parses ``{"type": ...}`` and, like a service would, puts the type it does not
    know into its error: ``unknown order type <type>``. Logs ``handled`` for the rest."""

    def handle(self, message: Message) -> None:
        data = message.json()
        if data.get("type") != "paid":
            raise PermanentError(f"unknown order type {data['type']}")
        log_event(log, "handled", partition=message.partition, offset=message.offset)


class _TermAtFirstRevoke(logging.Filter):
    """Sends this process SIGTERM when its first partitions are revoked: the moment a
    rolling deploy's new member joined and the old one is told to stop."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.sent and getattr(record, "outboxkit_event", None) == "partitions-revoked":
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return True


class RollingMember(Consumer):
    """Logs ``handled`` per message (after ``APP_HANDLE_SLEEP`` s); with
    ``APP_TERM_AT_REVOKE=1`` it gets SIGTERM at its first revocation."""

    def on_start(self) -> None:
        if os.environ.get("APP_TERM_AT_REVOKE") == "1":
            logging.getLogger("outboxkit.consumer").addFilter(_TermAtFirstRevoke())

    def handle(self, message: Message) -> None:
        pause = float(os.environ.get("APP_HANDLE_SLEEP", "0"))
        if pause:
            time.sleep(pause)
        log_event(log, "handled", partition=message.partition, offset=message.offset)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot say what it is")


class RaisesUnprintable(Consumer):
    """Raises, for ``{"type": "bad"}``, an exception whose ``str()`` itself raises (a
    library's error class with a broken ``__str__``); logs ``handled`` for the rest."""

    def handle(self, message: Message) -> None:
        if message.json().get("type") == "bad":
            raise _Unprintable()
        log_event(log, "handled", partition=message.partition, offset=message.offset)
