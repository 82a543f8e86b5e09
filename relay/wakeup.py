"""How the relay waits between claims: the poll interval, cut short by wake-up hints.

:class:`Waker` is the seam: the relay waits on it between empty claims.
:class:`PollWaker`, the default, just sleeps ``poll_interval``.

:class:`RedisWaker` subscribes to the outbox's wake-up channel
``{prefix}outboxkit:{outbox}:wakeup``, named by the outbox's identity (see
:mod:`outboxkit.wakeup` and :mod:`outboxkit.runtime.identity`), so hints for
another outbox with the same table name never wake it; and to the legacy
channel named by the bare table, on which writers of older versions still send
(a hint there may be another outbox's: it costs one empty claim, never a row).
It listens in a background thread; a hint sets an event, and
:meth:`RedisWaker.wait` returns as soon as it is set. A burst of hints
coalesces into one early return. When Redis drops, the thread reconnects on
its own (with backoff) and wakes the loop once after reconnecting, since hints
sent meanwhile were lost; until then the relay simply polls. Without Redis the
relay uses :class:`PollWaker`. On PostgreSQL the relay listens for the writer's
``NOTIFY`` instead (:class:`~outboxkit.relay.pg_wakeup.PgNotifyWaker`, also when
``--redis-url`` is set); :func:`default_waker` makes the choice.

It returns at once when the process starts draining: the relay calls
:meth:`RedisWaker.wake` when the drain begins, and a ``Lifecycle`` or
``threading.Event`` passed in is watched as well.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from outboxkit.relay.drain_aware import DrainAware
from outboxkit.relay.pg_wakeup import PgNotifyWaker
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import Episode, redact_url
from outboxkit.wakeup import wakeup_channel

if TYPE_CHECKING:
    from outboxkit.relay.settings import RelaySettings
    from outboxkit.runtime.identity import OutboxIdentity

__all__ = ["PollWaker", "RedisWaker", "Waker", "default_waker"]

_log = logging.getLogger("outboxkit.relay.wakeup")

# How often the subscriber thread looks at its stop flag, and the cap of the
# reconnect backoff.
_READ_SLICE_S = 0.5
_RECONNECT_MIN_S = 0.1
_RECONNECT_MAX_S = 5.0


@runtime_checkable
class Waker(Protocol):
    """Where the relay waits when there was nothing to claim.

    ``wait`` returns after ``timeout`` seconds, or earlier on a wake-up hint
    (new rows were committed) or when the relay drains. A waker that also has a
    ``wake()`` method gets it called by the relay when the drain begins.
    """

    def wait(self, timeout: float) -> None: ...


class PollWaker:
    """The default waker: sleep the poll interval; :meth:`wake` ends the sleep for good."""

    def __init__(self) -> None:
        self._woken = threading.Event()

    def wait(self, timeout: float) -> None:
        self._woken.wait(timeout)

    def wake(self) -> None:
        """Called when the drain begins: current and later waits return at once."""
        self._woken.set()


class RedisWaker(DrainAware):
    """Waits the poll interval, or less when a wake-up hint arrives."""

    def __init__(
        self,
        redis_url: str,
        channel: str,
        lifecycle_or_event: Lifecycle | threading.Event | None = None,
        *,
        logger: logging.Logger | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        """``also``: more channels that wake the relay (the legacy channel)."""
        super().__init__(lifecycle_or_event)
        self.redis_url = redis_url
        self.channel = channel
        self.also = tuple(c for c in also if c != channel)
        self.log = logger or _log
        self.hints = 0
        self._subscribed = threading.Event()
        self._stop = threading.Event()
        self._down = Episode(self.log, "wakeup-unsubscribed", "wakeup-subscribed")
        self._backoff = _RECONNECT_MIN_S
        self._thread = threading.Thread(
            target=self._run, name="outboxkit-wakeup-subscriber", daemon=True
        )
        self._thread.start()

    @property
    def subscribed(self) -> threading.Event:
        """Set while the subscription is live."""
        return self._subscribed

    def close(self) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout=_READ_SLICE_S * 4 + 1)

    # -- subscriber thread -----------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as exc:  # Redis gone or unhealthy: reconnect
                self._subscribed.clear()
                self._down.begin(
                    channel=self.channel,
                    redis=redact_url(self.redis_url),
                    error=f"{type(exc).__name__}: {exc}",
                    note="the relay polls until the subscription is back",
                )
                if self._stop.wait(self._backoff):
                    return
                self._backoff = min(self._backoff * 2, _RECONNECT_MAX_S)

    def _listen(self) -> None:
        """Subscribe and relay hints until stopped; raise when the connection fails."""
        client: redis.Redis[Any] = redis.Redis.from_url(
            self.redis_url,
            socket_connect_timeout=2.0,
            socket_timeout=5.0,
            health_check_interval=5,
            retry=Retry(backoff=NoBackoff(), retries=0),
        )
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(self.channel, *self.also)
            while not self._stop.is_set():
                msg = pubsub.get_message(timeout=_READ_SLICE_S)
                if msg is None:
                    continue
                if msg.get("type") == "subscribe":
                    self._on_subscribed()
                elif msg.get("type") == "message":
                    self.hints += 1
                    self._wake.set()
        finally:
            self._subscribed.clear()
            try:
                pubsub.close()
                client.close()
            except Exception as exc:  # closing a dead connection may fail too
                self.log.debug("closing the wake-up subscription failed: %s", exc)

    def _on_subscribed(self) -> None:
        # Hints sent while we were away are lost: look once, then wait for more.
        # Set before `subscribed`, so whoever sees the subscription sees this wake-up.
        self._wake.set()
        self._subscribed.set()
        self._backoff = _RECONNECT_MIN_S
        self._down.end(channel=self.channel)


def default_waker(
    s: RelaySettings,
    lifecycle: Lifecycle,
    *,
    logger: logging.Logger,
    identity: OutboxIdentity | None = None,
) -> tuple[Waker, str | None]:
    """The waker ``s`` asks for (:meth:`RelaySettings.wakeup_source`), started, and
    the name of the resource to close at exit (None for polling). Channels are
    named by ``identity`` (read from the database)."""
    source = s.wakeup_source()
    if source == "notify" and s.db_url:
        waker = PgNotifyWaker(
            s.db_url,
            s.table,
            lifecycle,
            identity=identity,
            node_id=s.node_id,
            connect_timeout=s.connect_timeout,
            logger=logger,
        )
        return waker, "pg-wakeups"
    if source == "redis" and s.redis_url:
        outbox = identity.key if identity is not None else None
        channel = wakeup_channel(s.table, s.redis_prefix, outbox=outbox)
        legacy = wakeup_channel(s.table, s.redis_prefix)
        hints = RedisWaker(s.redis_url, channel, lifecycle, logger=logger, also=(legacy,))
        return hints, "redis-wakeups"
    return PollWaker(), None
