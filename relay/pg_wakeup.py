"""Wake-ups by PostgreSQL ``NOTIFY``: the relay listens on the table's channel.

On PostgreSQL the writer calls ``pg_notify('outboxkit:<schema>.<table>', '<shard>')``
inside the caller's transaction (:mod:`outboxkit.notify`), so the notification
is delivered when the rows become visible and never for a rollback.
:class:`PgNotifyWaker` holds a dedicated autocommit session that resolves the
channel on the server exactly as the writer does (the table's schema on the
session's ``search_path``), so two schemas of one database never wake each
other's relays, and runs ``LISTEN "outboxkit:<schema>.<table>"``, plus the
legacy ``outboxkit:<table>`` on which writers of older versions still notify
(during an upgrade; a notification there may be another schema's and costs one
empty claim); a background thread turns each notification
into "claim now" (the relay's :meth:`wait` returns). A burst coalesces into one
early return.

Nothing is missed between the relay's start and the ``LISTEN``: the waker wakes
the relay once as soon as it listens (rows committed before it are then claimed),
and again after every reconnect (notifications sent while the session was down
are lost). When the session drops (server restart, ``pg_terminate_backend``, a
failover), the thread reconnects with exponential backoff and logs
``wakeup-unsubscribed`` once, then ``wakeup-subscribed``; meanwhile the relay
polls every ``--poll-interval``. The URL in those lines has its password masked.

Drain-aware like :class:`~outboxkit.relay.wakeup.RedisWaker`: :meth:`wake` (called
by the relay when the drain begins), a ``Lifecycle`` or a ``threading.Event``
end every current and later wait at once.
"""

from __future__ import annotations

import logging
import threading

from outboxkit.notify import channel_sql, legacy_channel, notify_channel
from outboxkit.relay.drain_aware import DrainAware
from outboxkit.relay.pg_session import (
    ReconnectLoop,
    connect,
    log_closing_failure,
    masked_url,
)
from outboxkit.runtime.identity import OutboxIdentity
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import Episode

__all__ = ["PgNotifyWaker"]

_log = logging.getLogger("outboxkit.relay.wakeup")

#: How often the listener thread looks at its stop flag.
_READ_SLICE_S = 0.25


class PgNotifyWaker(DrainAware):
    """Waits the poll interval, or less when a ``NOTIFY`` for the table arrives."""

    def __init__(
        self,
        db_url: str,
        table: str,
        lifecycle_or_event: Lifecycle | threading.Event | None = None,
        *,
        node_id: str = "",
        connect_timeout: float = 5.0,
        logger: logging.Logger | None = None,
        identity: OutboxIdentity | None = None,
    ) -> None:
        """``identity``: the outbox as the relay read it (its schema names the
        channel until the session resolves it itself)."""
        super().__init__(lifecycle_or_event)
        self.db_url = db_url
        self.table = table
        schema = identity.schema if identity is not None and identity.schema else "public"
        self.channel = notify_channel(table, schema)
        self.legacy_channel = legacy_channel(table)
        self.log = logger or _log
        self.hints = 0
        self._node_id = node_id
        self._connect_timeout = connect_timeout
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._backend_pid: int | None = None
        self._loop = ReconnectLoop(
            self._listen,
            stop=self._stop,
            down=Episode(self.log, "wakeup-unsubscribed", "wakeup-subscribed"),
            fields=lambda: {
                "channel": self.channel,
                "database": masked_url(self.db_url),
                "note": "the relay polls until the database session is back",
            },
        )
        self._thread = threading.Thread(
            target=self._loop.run, name="outboxkit-wakeup-listener", daemon=True
        )
        self._thread.start()

    @property
    def listening(self) -> threading.Event:
        """Set while the ``LISTEN`` session is live."""
        return self._listening

    @property
    def backend_pid(self) -> int | None:
        """The server process of the listening session (None while down)."""
        return self._backend_pid

    def close(self) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout=_READ_SLICE_S * 4 + self._connect_timeout + 1)

    # -- listener thread -------------------------------------------------------

    def _listen(self) -> None:
        """LISTEN and turn notifications into wake-ups until stopped; raise when
        the session fails (the reconnect loop backs off and calls again)."""
        from psycopg import sql

        conn = connect(
            self.db_url,
            application_name=f"outboxkit-wakeup:{self._node_id}",
            connect_timeout=self._connect_timeout,
        )
        try:
            row = conn.execute(f"SELECT {channel_sql(self.table)}").fetchone()
            self.channel = str(row[0]) if row is not None else self.channel
            for channel in dict.fromkeys((self.channel, self.legacy_channel)):
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            self._backend_pid = conn.info.backend_pid
            self._on_listening()
            while not self._stop.is_set():
                for _note in conn.notifies(timeout=_READ_SLICE_S):
                    self.hints += 1
                    self._wake.set()
        finally:
            self._listening.clear()
            self._backend_pid = None
            try:
                conn.close()
            except Exception as exc:  # closing a dead session may fail too
                log_closing_failure(self.log, "wake-up", exc)

    def _on_listening(self) -> None:
        # Notifications sent while we were not listening are lost: claim once, then
        # wait for more. Set before `listening`, so whoever sees it sees the wake-up.
        self._wake.set()
        self._listening.set()
        self._loop.up(channel=self.channel)
