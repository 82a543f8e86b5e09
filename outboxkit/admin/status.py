"""What ``outboxkit admin status`` reports: the table, the relays, the shard leases.

All ages are computed from the database clock (``db_now()`` read in the same
query as the data), never from this machine's clock.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import urllib.error
import urllib.request
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.runtime.identity import read_identity
from outboxkit.runtime.logs import redact, redact_url
from outboxkit.runtime.rediskeys import lease_key, lease_owner
from outboxkit.schema.apply import read_shard_count
from outboxkit.schema.table import STATUSES, Status, db_now, outbox_table, validate_identifier

__all__ = [
    "LeaseOwner",
    "RelayView",
    "ShardView",
    "TableStatus",
    "read_relay",
    "read_shards",
    "read_table_status",
    "shard_key",
]

_UNDELIVERED = (Status.PENDING.value, Status.RETRYABLE.value, Status.DELIVERING.value)


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


def _age(now: dt.datetime, then: dt.datetime | None) -> float | None:
    if then is None:
        return None
    return max(0.0, (now - then).total_seconds())


def read_table_status(engine: Engine, *, table: str) -> TableStatus:
    """Counts per status and per topic x status, backlog ages and lease health.

    Counting scans the status index (and the table for the per-topic counts), so
    its cost grows with the table; retention keeps that in check.
    """
    t = outbox_table(validate_identifier(table))
    with engine.connect() as conn:
        now: dt.datetime = conn.execute(sa.select(db_now())).scalar_one()
        counts = dict.fromkeys(STATUSES, 0)
        for status, n in conn.execute(
            sa.select(t.c.status, sa.func.count()).group_by(t.c.status)
        ).all():
            counts[str(status)] = int(n)
        by_topic: dict[str, dict[str, int]] = {}
        for topic, status, n in conn.execute(
            sa.select(t.c.topic, t.c.status, sa.func.count())
            .group_by(t.c.topic, t.c.status)
            .order_by(t.c.topic)
        ).all():
            by_topic.setdefault(str(topic), dict.fromkeys(STATUSES, 0))[str(status)] = int(n)
        oldest_pending = conn.execute(
            sa.select(sa.func.min(t.c.created_at)).where(t.c.status == Status.PENDING.value)
        ).scalar()
        oldest_undelivered = conn.execute(
            sa.select(sa.func.min(t.c.created_at)).where(t.c.status.in_(_UNDELIVERED))
        ).scalar()
        shard_count = read_shard_count(conn, table)
        shard_out_of_range = int(
            conn.execute(
                sa.select(sa.func.count()).where(
                    t.c.status.in_(_UNDELIVERED),
                    sa.or_(t.c.shard < 0, t.c.shard >= shard_count),
                )
            ).scalar_one()
        )
        expired = t.c.lease_expires_at <= db_now()
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
        oldest_pending_age_s=_age(now, oldest_pending),
        oldest_undelivered_age_s=_age(now, oldest_undelivered),
        leases_live=sum(o.live for o in owners),
        leases_expired=sum(o.expired for o in owners),
        lease_owners=owners,
        shard_count=shard_count,
        shard_out_of_range=shard_out_of_range,
    )


def read_relay(url: str, *, timeout_s: float = 3.0) -> RelayView:
    """Read ``/healthz/ready`` of a relay (both 200 and 503 carry the JSON body).

    ``paused_topics`` may be a list of topic names, a mapping topic -> reason, or
    a list of ``{"topic": ..., "reason": ...}`` objects; all are normalised.
    """
    base = url.rstrip("/")
    ready = base if base.endswith("/healthz/ready") else base + "/healthz/ready"
    shown = redact_url(base)
    if not ready.startswith(("http://", "https://")):
        return RelayView(url=shown, state=None, paused_topics={}, error="not an http(s) URL")
    try:
        with urllib.request.urlopen(ready, timeout=timeout_s) as resp:  # noqa: S310 - http(s) checked above
            body, code = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        body, code = exc.read(), exc.code
    except (OSError, ValueError) as exc:
        return RelayView(url=shown, state=None, paused_topics={}, error=redact(str(exc)))
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return RelayView(
            url=shown, state=None, paused_topics={}, error="readiness body is not JSON"
        )
    if not isinstance(data, dict):
        return RelayView(url=shown, state=None, paused_topics={}, error="unexpected readiness body")
    state = data.get("state")
    return RelayView(
        url=shown,
        state=str(state) if state is not None else None,
        paused_topics=_paused(data.get("paused_topics")),
        ready=code == 200,
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
