"""Connection settings of ``outboxkit admin``: flags or ``OUTBOXKIT_*`` variables."""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from outboxkit.runtime.settings import setting
from outboxkit.schema.table import DEFAULT_TABLE, validate_identifier

__all__ = ["AdminSettings"]


def _url(value: str | None) -> str | None:
    if value is None:
        return None
    parts = urlsplit(value)
    if not parts.scheme or not parts.netloc:
        return "must be a URL like scheme://user:password@host:port/path"
    return None


def _identifier(value: str) -> str | None:
    try:
        validate_identifier(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdminSettings:
    """Where the outbox lives. Same names as the relay's, so one environment serves both."""

    db_url: str = setting(
        help="SQLAlchemy database URL, e.g. mysql+pymysql://user:password@host:3306/db",
        validate=_url,
    )
    table: str = setting(DEFAULT_TABLE, help="outbox table name", validate=_identifier)
    redis_url: str | None = setting(
        None,
        help="Redis URL of the relays' shard leases (status shows shard owners)",
        validate=_url,
    )
    redis_prefix: str = setting("", help="key prefix the relays use in Redis", default_help="none")
