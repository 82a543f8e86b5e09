"""Shard ownership by PostgreSQL session advisory locks: no Redis needed.

:class:`PgAdvisoryShards` implements :class:`~outboxkit.relay.shards.ShardOwnership`
on :class:`~outboxkit.relay.ownership.base.ShardOwnershipBase` (the held and
target shards, ``claiming()``, the rebalance and the hand-over), with one
dedicated database session per relay (autocommit, outside the pool):

* **Lock keys.** Shard ``s`` of outbox ``O`` is the two-key advisory lock
  ``(k, s)`` with ``k = crc32("outboxkit-shards:" + O)`` read as a signed 32-bit
  integer (:func:`lock_keys`), where ``O`` is the outbox's identity read from
  the database (``database.schema.table``, :mod:`outboxkit.runtime.identity`):
  two schemas of one database, each with its own ``outbox_events``, never share
  a lock. Membership is the *shared* lock ``(k, -1)``.
  Two-key locks are their own key space in PostgreSQL (``objsubid = 2`` in
  ``pg_locks``), apart from the one-key (bigint) lock that ``schema apply``
  takes, and advisory locks are per database (and so per server: every member
  of one outbox's locks is on the same server, with nothing to tell apart).
  Two outboxes of one database whose identities share a CRC-32 (about one
  pair in 4 billion) would share shard locks: each shard still has one owner,
  but each relay claims only its share of its own table; the relays of the
  other outbox then claim rows this relay never sees, and the members no
  relay of this outbox knows show as ``rebalance`` lines with too many members.
* **Upgrade.** Older relays keyed the locks by the bare table name. While any
  session holds that legacy membership lock, a shard lock taken here also takes
  the legacy lock of the shard (both or neither), and gives both back together:
  an older relay and this one never hold a shard at once.
* **Live members** are the sessions holding the shared member lock, read from
  ``pg_locks`` every ``tick_interval``; identified by their server pid. Every
  relay computes the same split over them (:func:`~outboxkit.relay.assignment.assign_shards`),
  so nobody coordinates.
* **Acquire** targets with ``pg_try_advisory_lock``: a shard still locked by its
  previous owner is tried again at the next (fast) tick.
* **Hand-over.** A shard no longer targeted is unlocked once the base offers it:
  no open ``claiming()`` block holds it and it is not in ``inflight_shards()``
  (its rows are settled), exactly as with Redis leases.
* **Death.** The server drops every lock of a session when it ends (crash,
  ``pg_terminate_backend``, failover), so a dead relay's shards are free at
  once and the survivors take them at their next tick. The relay notices its
  own session's death as soon as the server's goodbye reaches the socket (the
  thread waits on it between ticks) and :meth:`claimable` is empty from then
  on; it reconnects with backoff, joins again and gets its share back. Rows it
  had leased stay protected by their lease tokens, and the claim's per-key rule
  holds back later rows of a key whose earlier row is still leased.
* **Fence.** Noticing takes a moment (tens of milliseconds on a busy host), and
  another relay may take the shards within it. So a claim does not trust this
  relay's view: :meth:`claim_fence` gives the claim a condition its lease
  statement checks on the server, after locking its rows, that the session
  holding the shards is still there (it holds the membership lock). A claim
  made after the session died leases nothing (``claim-fenced``): claims from a
  shard stay inside the server's hold of its lock.
* **Network partition.** TCP keepalives (about 10 s) end the client side; the
  server keeps the session, and so the locks, until *its* keepalive settings
  notice (``tcp_keepalives_idle`` etc.): the shards stall, never double-owned.

Session advisory locks need a real server session: PgBouncer in transaction
pooling mode breaks them (docs/postgresql.md).

Log events: ``rebalance``, ``shard-acquired``, ``shard-released`` (reason
``handover`` or ``drain``), ``shard-lost`` (reason ``session-lost``, or
``session-lost-while-leaving`` when the session died during a drain),
``shard-session-lost`` / ``shard-session-restored``. Every one of these lock
events carries ``db_epoch_ms``, the server's clock (ms since the epoch): read just
after a lock was taken or just before one was let go, and for ``shard-lost``
the last moment the session was seen holding its locks (its last statement; the
server ended the locks some time after it, and the relay heard of it later
still). So every relay's logged holds of a shard lie inside the real ones, can
be compared on one clock, and never overlap.
"""

from __future__ import annotations

import logging
import select
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outboxkit.relay.ownership.base import Held, ShardOwnershipBase, ShardOwnershipMetrics
from outboxkit.relay.pg_session import (
    ReconnectLoop,
    connect,
    describe_error,
    log_closing_failure,
    masked_url,
)
from outboxkit.relay.rows import ClaimFence
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.logs import Episode

if TYPE_CHECKING:
    import psycopg

__all__ = ["MEMBER_KEY", "AdvisoryShardMetrics", "PgAdvisoryShards", "lock_keys"]

#: Second key of the shared membership lock (shards are >= 0).
MEMBER_KEY = -1
#: How often the idle thread looks at its stop flag and its session's socket.
_IDLE_SLICE_S = 0.05

#: The live members' pids, and the server's clock (as ``_NOW_MS_SQL``): the
#: moment this session was last seen holding its locks.
_MEMBERS_SQL = """
SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint, ARRAY(
  SELECT pid FROM pg_locks
  WHERE locktype = 'advisory' AND objsubid = 2 AND granted
    AND classid::bigint = %(classid)s AND objid::bigint = %(objid)s
    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
), (
  SELECT count(*) FROM pg_locks
  WHERE locktype = 'advisory' AND objsubid = 2 AND granted
    AND classid::bigint = %(legacy)s AND objid::bigint = %(objid)s
    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
), ARRAY(
  SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
  WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
    AND l.classid::bigint IN (%(classid)s, %(legacy)s) AND l.objid::bigint = %(objid)s
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
"""
_LOCKS = sa.table(
    "pg_locks",
    sa.column("locktype", sa.Text()),
    sa.column("objsubid", sa.Integer()),
    sa.column("granted", sa.Boolean()),
    sa.column("pid", sa.Integer()),
    sa.column("classid", sa.BigInteger()),
    sa.column("objid", sa.BigInteger()),
)
#: The claim fence (see the module docstring): session ``fence_pid`` holds the
#: membership lock of the table (``fence_classid``), so it is alive and still
#: holds every shard lock it took. One clause object: the fenced lease
#: statement is built and compiled once.
_FENCE = sa.exists().where(
    _LOCKS.c.locktype == "advisory",
    _LOCKS.c.objsubid == 2,
    _LOCKS.c.granted,
    _LOCKS.c.pid == sa.bindparam("fence_pid", type_=sa.Integer()),
    sa.cast(_LOCKS.c.classid, sa.BigInteger())
    == sa.bindparam("fence_classid", type_=sa.BigInteger()),
    sa.cast(_LOCKS.c.objid, sa.BigInteger()) == sa.bindparam("fence_objid", type_=sa.BigInteger()),
)
_TRY_LOCK_SQL = "SELECT s, pg_try_advisory_lock(%(k)s, s) FROM unnest(%(shards)s::int[]) AS s"
#: The server's clock in ms since the epoch, logged as ``db_epoch_ms`` with each lock
#: change: read after taking a lock and before letting one go, so the logged
#: holds lie inside the real ones (they can be checked for overlaps exactly).
_NOW_MS_SQL = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"


def lock_keys(outbox: str, shard: int) -> tuple[int, int]:
    """The two 32-bit keys of shard ``shard``'s advisory lock for ``outbox`` (an
    identity key such as ``orders.public.outbox_events``; a bare table name gives
    the legacy keys of older versions)."""
    crc = zlib.crc32(f"outboxkit-shards:{outbox}".encode())
    return crc - (1 << 32) if crc >= 1 << 31 else crc, shard


class AdvisoryShardMetrics(ShardOwnershipMetrics):
    """The shard-ownership metrics of advisory locks, under the same names as with
    Redis leases; no ``outbox_shard_grants_fenced``: nothing fences a lock."""

    HELP: ClassVar[Mapping[str, str]] = {
        "owned": "Shards whose advisory lock this relay's session holds",
        "acquired": "Shards acquired (pg_try_advisory_lock succeeded)",
        "lost": "Shards lost because the relay's database session ended",
    }


class PgAdvisoryShards(ShardOwnershipBase[Held, int]):
    """Shard ownership through session advisory locks; see the module docstring.

    The caller claims inside :meth:`claiming` and registers the claimed rows in
    ``inflight_shards()`` before the block ends.
    """

    _thread_kind = "locks"

    def __init__(
        self,
        db_url: str,
        *,
        table: str,
        node_id: str,
        shard_count: int,
        tick_interval: float = 1.0,
        connect_timeout: float = 5.0,
        reconnect_min: float = 0.1,
        registry: CollectorRegistry | None = None,
        owned_gauge: bool = True,
        logger: logging.Logger | None = None,
        outbox: str | None = None,
    ) -> None:
        """``outbox``: the identity key the locks are named by (the relay passes the
        one it read from the database; without it, the bare ``table``, as older
        versions named them)."""
        super().__init__(
            table=table, node_id=node_id, shard_count=shard_count, logger=logger, outbox=outbox
        )
        if not tick_interval > 0:
            raise ConfigError(f"tick_interval must be > 0 (got {tick_interval})")
        self.db_url = db_url
        self.tick_interval = tick_interval
        self.connect_timeout = connect_timeout
        self.metrics = AdvisoryShardMetrics(
            registry or CollectorRegistry(), owned_gauge=owned_gauge
        )
        self._key, _ = lock_keys(self.outbox, 0)
        #: The class key older relays of this outbox use, when it differs from ours.
        self._legacy_key: int | None = lock_keys(self.table, 0)[0]
        if self._legacy_key == self._key:
            self._legacy_key = None
        self._legacy_live = False
        #: Shards whose legacy lock is held beside ours.
        self._companions: set[int] = set()
        #: application_name of every member session (ours and older relays').
        self._member_apps: frozenset[str] = frozenset()

        self._alive = False
        self._pid: int | None = None
        #: The server's clock (ms) the last time this session was seen holding its locks.
        self._verified_ms: int | None = None
        self._first_round = threading.Event()
        self._loop = ReconnectLoop(
            self._session,
            stop=self._stop,
            down=Episode(self.log, "shard-session-lost", "shard-session-restored"),
            fields=lambda: {
                "table": self.table,
                "database": masked_url(self.db_url),
                "note": "no shard is claimed until the session is back",
            },
            min_s=reconnect_min,
        )

    # -- ShardOwnership ------------------------------------------------------

    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        """Join and take a first share (waiting up to ``connect_timeout`` for it),
        then keep following the member set in a background thread."""
        self._inflight = inflight_shards
        self._start_thread(self._loop.run)
        self._first_round.wait(self.connect_timeout)

    def claim_fence(self, shards: frozenset[int]) -> ClaimFence:
        """The condition a claim from ``shards`` (yielded by :meth:`claiming`) makes
        its lease statement check on the server: the session that holds them is
        still there. If this relay no longer holds them, a fence that is false."""
        with self._lock:
            pid = self._pid if self._alive and shards <= self._held.keys() else None
        return ClaimFence(
            _FENCE,
            {
                "fence_pid": pid or 0,  # no server process has pid 0
                "fence_classid": self._key & 0xFFFFFFFF,
                "fence_objid": MEMBER_KEY & 0xFFFFFFFF,
            },
            what=f"advisory locks of session {pid}" if pid else "advisory locks (session gone)",
        )

    def release_all(self) -> None:
        """Leave: stop claiming, unlock every shard and the membership (the others
        rebalance at their next tick), end the session."""
        super().release_all()  # the session thread unlocks as it ends

    # -- introspection (tests, health details) ---------------------------------

    @property
    def backend_pid(self) -> int | None:
        """The server process of the ownership session (None while down)."""
        return self._pid

    def is_member(self, node_id: str) -> bool | None:
        """Whether ``node_id``'s relay holds this outbox's membership lock (or an
        older version's, whose shard locks this relay respects), known by the
        ``application_name`` of its session; None while the session is down."""
        if not self._alive:
            return None
        return _app_name(node_id)[:_MAX_APP_NAME] in self._member_apps

    # -- what the base asks of a backend ---------------------------------------

    def _holding_locked(self) -> bool:
        return self._alive  # the server ends every lock with the session

    def _tick_seconds(self, busy: bool) -> float:
        return self.tick_interval / 4 if busy else self.tick_interval

    def _join_timeout(self) -> float:
        return self.connect_timeout + 2

    # -- the session thread ----------------------------------------------------

    def _session(self) -> None:
        """One database session: join, then tick until stopped; raise when it fails."""
        conn = connect(
            self.db_url,
            application_name=_app_name(self.node_id),
            connect_timeout=self.connect_timeout,
        )
        try:
            if self._stop.is_set():
                return
            conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (self._key, MEMBER_KEY))
            self._pid = conn.info.backend_pid
            with self._lock:
                self._alive = True
            self._loop.up(table=self.table, pid=self._pid)
            while not self._stop.is_set():
                self._tick(conn)
                self._first_round.set()
                self._idle(conn, self._next_delay())
            if self._leaving:
                self._leave(conn)
        finally:
            self._session_ended()
            try:
                conn.close()
            except Exception as exc:  # closing a dead session may fail too
                log_closing_failure(self.log, "shard ownership", exc)

    def _session_ended(self) -> None:
        """Whatever the reason, the locks are gone (or going) with the session:
        nothing is claimable from this moment."""
        self._companions.clear()
        with self._lock:
            self._alive = False
            lost = sorted(self._held)
            self._held.clear()
        verified_ms = self._verified_ms
        self._members = ()
        if lost and not self._leaving:
            self.metrics.lost.inc(len(lost))
        # Logged while leaving too (a drain meeting a database restart): the locks
        # ended here, and ownership rebuilt from the log must see each end.
        reason = "session-lost-while-leaving" if self._leaving else "session-lost"
        for shard in lost:
            self._event(
                "shard-lost", shard, level=logging.WARNING, reason=reason, db_epoch_ms=verified_ms
            )
        self._pid = None  # last: whoever sees no pid sees the losses logged
        self._set_owned_gauge()

    def _idle(self, conn: psycopg.Connection, seconds: float) -> None:
        """Wait ``seconds`` (or until stopped) watching the session's socket: the
        server's goodbye (terminate, shutdown) makes it readable, and the query
        that follows raises at once."""
        deadline = time.monotonic() + seconds
        fd = conn.fileno()
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            readable, _, _ = select.select([fd], [], [], min(left, _IDLE_SLICE_S))
            if readable:
                conn.execute("SELECT 1")

    def _tick(self, conn: psycopg.Connection) -> None:
        self._follow_members(conn)
        self._hand_over(conn)
        self._acquire_targets(conn)
        self._set_owned_gauge()

    def _follow_members(self, conn: psycopg.Connection) -> None:
        objid = MEMBER_KEY & 0xFFFFFFFF
        legacy = -1 if self._legacy_key is None else self._legacy_key & 0xFFFFFFFF
        row = conn.execute(
            _MEMBERS_SQL, {"classid": self._key & 0xFFFFFFFF, "objid": objid, "legacy": legacy}
        ).fetchone()
        assert row is not None
        self._verified_ms = int(row[0])
        self._legacy_live = int(row[2]) > 0
        self._member_apps = frozenset(str(a) for a in row[3] if a)
        self._follow(tuple(sorted(int(pid) for pid in row[1])), str(self._pid))

    def _hand_over(self, conn: psycopg.Connection) -> None:
        ready = sorted(self._surplus_ready())
        if not ready:
            return
        # One clock for the line, read before the first unlock: every logged
        # end lies inside the real hold.
        db_epoch_ms = self._verified_ms = _db_ms(conn)
        for shard in ready:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._key, shard))
            if shard in self._companions:
                conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._legacy_key, shard))
                self._companions.discard(shard)
            with self._lock:
                self._held.pop(shard, None)
        self._handed_over(ready, db_epoch_ms=db_epoch_ms)

    def _acquire_targets(self, conn: psycopg.Connection) -> None:
        with self._lock:
            wanted = sorted(self._targets - self._held.keys())
        if not wanted:
            return
        rows = conn.execute(_TRY_LOCK_SQL, {"k": self._key, "shards": wanted}).fetchall()
        got = sorted(int(s) for s, ok in rows if ok)
        if got and self._legacy_live:
            got = self._take_companions(conn, got)
        if not got:
            return
        db_epoch_ms = self._verified_ms = _db_ms(conn)
        with self._lock:
            for shard in got:
                self._held[shard] = Held()
        self._acquired(got, db_epoch_ms=db_epoch_ms)

    def _take_companions(self, conn: psycopg.Connection, got: list[int]) -> list[int]:
        """Older relays are live: keep only the shards whose legacy lock could be
        taken too, and give back ours of the others (both or neither)."""
        rows = conn.execute(_TRY_LOCK_SQL, {"k": self._legacy_key, "shards": got}).fetchall()
        both = sorted(int(s) for s, ok in rows if ok)
        for shard in sorted(set(got) - set(both)):
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._key, shard))
        self._companions.update(both)
        return both

    def _leave(self, conn: psycopg.Connection) -> None:
        """Drain: unlock everything now rather than when the session closes, so the
        others can take the shards at their next tick."""
        with self._lock:
            self._alive = False
            held = sorted(self._held)
            self._held.clear()
        try:
            db_epoch_ms = _db_ms(conn)
            conn.execute("SELECT pg_advisory_unlock_all()")
        except Exception as exc:  # the session is ending anyway: the server frees them
            self._release_failed(held, describe_error(exc), "the locks end with the session")
            return
        if held:
            self._shards_event("shard-released", held, reason="drain", db_epoch_ms=db_epoch_ms)


#: PostgreSQL keeps the first 63 bytes of an application_name.
_MAX_APP_NAME = 63


def _app_name(node_id: str) -> str:
    """The application_name of ``node_id``'s ownership session."""
    return f"outboxkit-shards:{node_id}"


def _db_ms(conn: psycopg.Connection) -> int:
    row = conn.execute(_NOW_MS_SQL).fetchone()
    assert row is not None
    return int(row[0])
