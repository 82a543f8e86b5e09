"""What ``outboxkit admin status`` reports: the table, the relays, the shard leases.

All ages are computed from the database clock (``db_now()`` read in the same
query as the data), never from this machine's clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.relay._dbtime import micros_between, time_passed
from outboxkit.runtime.identity import read_identity
from outboxkit.runtime.logs import redact, redact_url
from outboxkit.runtime.rediskeys import lease_key, lease_owner
from outboxkit.schema.meta import read_applied_by, read_shard_count, read_table_meta
from outboxkit.schema.table import STATUSES, Status, db_now, outbox_table, validate_identifier

__all__ = [
    "RELAY_BODY_MAX",
    "RELAY_DEADLINE_S",
    "LeaseOwner",
    "RelayView",
    "ShardView",
    "TableStatus",
    "read_relay",
    "read_shards",
    "read_table_status",
    "shard_key",
]

#: The rows "oldest pending" looks at, one definition for the gauge, this and the alert.
_WAITING = (Status.PENDING.value, Status.RETRYABLE.value)
_UNDELIVERED = (Status.PENDING.value, Status.RETRYABLE.value, Status.DELIVERING.value)
#: Seconds a relay's readiness answer may take in total: connect, headers and body.
RELAY_DEADLINE_S = 5.0
#: Bytes of readiness body read at most; a relay's is a few hundred.
RELAY_BODY_MAX = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeaseOwner:
    """Rows one relay holds in ``delivering``, by lease state."""

    owner: str
    live: int
    expired: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TableStatus:
    table: str
    db_now: dt.datetime
    counts: dict[str, int]
    by_topic: dict[str, dict[str, int]]
    oldest_pending_age_s: float | None
    oldest_undelivered_age_s: float | None
    leases_live: int
    leases_expired: int
    lease_owners: list[LeaseOwner]
    #: The table's shard count, and undelivered rows whose stored shard is outside
    #: ``0..shard_count-1`` (another writer's; relays claim them under their key's hash).
    shard_count: int | None = None
    shard_out_of_range: int = 0
    #: Rows whose status is outside the enum (MariaDB/MySQL without strict mode
    #: store ``''``): never claimed, they hold their keys back; requeue repairs them.
    invalid_status: int = 0
    #: The table's schema version (``outboxkit_meta``), and the outboxkit version
    #: whose ``schema apply`` last ran on it (None: none of 0.4.0 or later has).
    schema_version: int | None = None
    applied_by: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RelayView:
    """What one relay's readiness endpoint said (or why it could not be read)."""

    url: str
    state: str | None
    paused_topics: dict[str, str]
    ready: bool | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardView:
    shard_count: int
    owners: dict[str, list[int]]
    unowned: list[int]


def _age(micros: object) -> float | None:
    if micros is None:
        return None
    return max(0.0, float(micros) / 1_000_000)  # type: ignore[arg-type]


def read_table_status(engine: Engine, *, table: str) -> TableStatus:
    """Counts per status and per topic x status, backlog ages and lease health.

    Counting scans the status index (and the table for the per-topic counts), so
    its cost grows with the table; retention keeps that in check.
    """
    t = outbox_table(validate_identifier(table))
    with engine.connect() as conn:
        now: dt.datetime = conn.execute(sa.select(db_now())).scalar_one()
        counts = dict.fromkeys(STATUSES, 0)
        # A status outside the enum (MariaDB stores '' for one written without
        # strict mode) is counted apart: invalid_status.
        invalid_status = 0
        for status, n in conn.execute(
            sa.select(t.c.status, sa.func.count()).group_by(t.c.status)
        ).all():
            if str(status) in counts:
                counts[str(status)] = int(n)
            else:
                invalid_status += int(n)
        by_topic: dict[str, dict[str, int]] = {}
        for topic, status, n in conn.execute(
            sa.select(t.c.topic, t.c.status, sa.func.count())
            .group_by(t.c.topic, t.c.status)
            .order_by(t.c.topic)
        ).all():
            per_topic = by_topic.setdefault(str(topic), dict.fromkeys(STATUSES, 0))
            if str(status) in per_topic:
                per_topic[str(status)] = int(n)
        # Ages computed by the server, skipping a created_at that is not a time
        # (a zero date, an infinity: another writer's), which has no age.
        age_us = micros_between(t.c.created_at, db_now())
        # "Pending" as the relay's gauge (outbox_oldest_pending_age_seconds) and the
        # OutboxBacklogOld alert count it: waiting to be delivered, pending or retryable.
        oldest_pending = conn.execute(
            sa.select(sa.func.max(age_us)).where(t.c.status.in_(_WAITING))
        ).scalar()
        oldest_undelivered = conn.execute(
            sa.select(sa.func.max(age_us)).where(t.c.status.in_(_UNDELIVERED))
        ).scalar()
        shard_count, schema_version = read_table_meta(conn, table)
        applied_by = read_applied_by(conn, table)
        shard_out_of_range = int(
            conn.execute(
                sa.select(sa.func.count()).where(
                    t.c.status.in_(_UNDELIVERED),
                    sa.or_(t.c.shard < 0, t.c.shard >= shard_count),
                )
            ).scalar_one()
        )
        # As the claim judges it: a lease "until infinity" is over (relay/_dbtime.py).
        expired = time_passed(t.c.lease_expires_at, db_now())
        owners = [
            LeaseOwner(owner=str(owner), live=int(live or 0), expired=int(exp or 0))
            for owner, live, exp in conn.execute(
                sa.select(
                    t.c.lease_owner,
                    sa.func.sum(sa.case((expired, 0), else_=1)),
                    sa.func.sum(sa.case((expired, 1), else_=0)),
                )
                .where(t.c.status == Status.DELIVERING.value)
                .group_by(t.c.lease_owner)
                .order_by(t.c.lease_owner)
            ).all()
        ]
    return TableStatus(
        table=table,
        db_now=now,
        counts=counts,
        by_topic=by_topic,
        oldest_pending_age_s=_age(oldest_pending),
        oldest_undelivered_age_s=_age(oldest_undelivered),
        leases_live=sum(o.live for o in owners),
        leases_expired=sum(o.expired for o in owners),
        lease_owners=owners,
        shard_count=shard_count,
        shard_out_of_range=shard_out_of_range,
        invalid_status=invalid_status,
        schema_version=schema_version,
        applied_by=applied_by,
    )


def read_relay(url: str, *, timeout_s: float = RELAY_DEADLINE_S) -> RelayView:
    """Read ``/healthz/ready`` of a relay (both 200 and 503 carry the JSON body).

    Whatever the server does, this returns within ``timeout_s`` (plus a moment)
    with a view or an ``error``: the whole exchange has one deadline (a server
    that sends a byte a second is cut at it, not timed per read), the body is
    read up to :data:`RELAY_BODY_MAX` bytes, and a body that is not a JSON object
    (nested too deeply for the parser included) or an answer that is not HTTP is
    an error, never an exception.

    ``paused_topics`` may be a list of topic names, a mapping topic -> reason, or
    a list of ``{"topic": ..., "reason": ...}`` objects; all are normalised.
    """
    base = url.rstrip("/")
    ready = base if base.endswith("/healthz/ready") else base + "/healthz/ready"
    shown = redact_url(base)

    def failed(error: str) -> RelayView:
        return RelayView(url=shown, state=None, paused_topics={}, error=error)

    if not ready.startswith(("http://", "https://")):
        return failed("not an http(s) URL")
    deadline = _Deadline()
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
    timer = threading.Timer(timeout_s, deadline.cut)
    timer.daemon = True
    timer.start()
    try:
        try:
            with opener.open(ready, timeout=timeout_s) as resp:
                body, code = resp.read(RELAY_BODY_MAX + 1), resp.status
        except urllib.error.HTTPError as exc:
            body, code = exc.read(RELAY_BODY_MAX + 1), exc.code
    except (OSError, ValueError, http.client.HTTPException) as exc:
        if deadline.expired:
            return failed(f"no complete answer within {timeout_s:g} s")
        if isinstance(exc, http.client.HTTPException) and not isinstance(exc, OSError):
            return failed(f"not an HTTP answer ({type(exc).__name__})")
        return failed(redact(str(exc)))
    finally:
        timer.cancel()
    if deadline.expired:
        return failed(f"no complete answer within {timeout_s:g} s")
    if len(body) > RELAY_BODY_MAX:
        return failed(f"readiness body larger than {RELAY_BODY_MAX} bytes")
    try:
        data = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        return failed("readiness body is not JSON")
    if not isinstance(data, dict):
        return failed("unexpected readiness body")
    state = data.get("state")
    try:
        paused = _paused(data.get("paused_topics"))
    except RecursionError:
        return failed("unexpected readiness body")
    return RelayView(
        url=shown,
        state=str(state) if state is not None else None,
        paused_topics=paused,
        ready=code == 200,
    )


class _Deadline:
    """The connections of one exchange, cut together when its time is up: a
    socket timeout bounds each read, not a server that trickles bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection] = []
        self.expired = False

    def track(self, factory: Callable[..., http.client.HTTPConnection]) -> Callable[..., Any]:
        def make(host: str, **kwargs: Any) -> http.client.HTTPConnection:
            conn = factory(host, **kwargs)
            with self._lock:
                self._connections.append(conn)
            return conn

        return make

    def cut(self) -> None:
        with self._lock:
            self.expired = True
            socks = [c.sock for c in self._connections if c.sock is not None]
        for sock in socks:
            with contextlib.suppress(OSError):
                # The plain socket's shutdown, also for TLS: SSLSocket.shutdown would
                # drop its SSL state under the reading thread. The read returns at once.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self.deadline.track(http.client.HTTPConnection), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(
            self.deadline.track(http.client.HTTPSConnection),
            req,
            context=self._context,  # type: ignore[attr-defined]
        )


def _paused(raw: object) -> dict[str, str]:
    if isinstance(raw, dict):
        return {str(k): _reason(v) for k, v in raw.items()}
    out: dict[str, str] = {}
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and "topic" in item:
                out[str(item["topic"])] = _reason(item.get("reason", ""))
            else:
                out[str(item)] = ""
    return out


def _reason(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("reason", json.dumps(value, default=str)))
    return "" if value is None else str(value)


def shard_key(prefix: str, outbox: str, shard: int) -> str:
    """The Redis key of one shard lease (value ``node_id:token``) of ``outbox``
    (its identity key, :mod:`outboxkit.runtime.identity`)."""
    return lease_key(prefix, outbox, shard)


def read_shards(
    engine: Engine, redis_url: str, *, table: str, prefix: str = "", timeout_s: float = 3.0
) -> ShardView:
    """Who owns which shard, from the relays' Redis leases. Tokens are never returned."""
    import redis

    with engine.connect() as conn:
        count = read_shard_count(conn, table)
        outbox = read_identity(conn, table).key  # the relays' names carry it
    client = redis.Redis.from_url(
        redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    try:
        values: Sequence[bytes | None] = client.mget(
            [shard_key(prefix, outbox, n) for n in range(count)]
        )
    finally:
        client.close()
    owners: dict[str, list[int]] = {}
    unowned: list[int] = []
    for shard, value in enumerate(values):
        if value is None:
            unowned.append(shard)
            continue
        text = value.decode("utf-8", "replace")
        node = lease_owner(text)
        owners.setdefault(node, []).append(shard)
    return ShardView(shard_count=count, owners=dict(sorted(owners.items())), unowned=unowned)
