"""Connection settings of ``outboxkit admin``: flags or ``OUTBOXKIT_*`` variables."""

from __future__ import annotations

import dataclasses

from outboxkit.runtime.settings import (
    log_format_setting,
    setting,
    valid_redis_url,
    valid_server_database_url,
)
from outboxkit.schema.table import DEFAULT_TABLE, identifier_problem

__all__ = ["AdminSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdminSettings:
    """Where the outbox lives. Same names as the relay's, so one environment serves both."""

    db_url: str = setting(
        help="SQLAlchemy database URL, e.g. mysql+pymysql://user:password@host:3306/db or "
        "postgresql+psycopg://user:password@host:5432/db",
        validate=valid_server_database_url,
    )
    table: str = setting(DEFAULT_TABLE, help="outbox table name", validate=identifier_problem)
    redis_url: str | None = setting(
        None,
        help="Redis URL of the relays' shard leases (status shows shard owners)",
        validate=valid_redis_url,
    )
    redis_prefix: str = setting("", help="key prefix the relays use in Redis", default_help="none")
    log_format: str = log_format_setting()
