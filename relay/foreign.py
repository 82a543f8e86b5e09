"""Two relays on one table without Redis: detect it and say so loudly.

Without Redis one relay owns every shard (:class:`~outboxkit.relay.shards.AllShards`);
a second such relay never double-claims a row, but per-key order across the
two is lost. :class:`ForeignRelayMonitor` notices it from the row leases.
"""

from __future__ import annotations

import datetime as dt
import logging

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.relay._dbtime import time_ahead
from outboxkit.runtime.logs import Episode
from outboxkit.schema.table import Status, db_now, outbox_table, validate_identifier

__all__ = ["ForeignRelayMonitor", "detect_foreign_relays"]

# The name it has always logged under (it lived in the leases module).
_log = logging.getLogger("outboxkit.relay.leases")


def detect_foreign_relays(conn: Connection, table: str, node_id: str) -> dict[str, dt.datetime]:
    """Other relays holding live row leases on ``table``: owner -> latest lease expiry.

    Cheap: it reads only ``delivering`` rows (the claim index starts with
    ``status``), which are a batch or two per relay.
    """
    t = outbox_table(validate_identifier(table))
    latest = sa.func.max(t.c.lease_expires_at)
    rows = conn.execute(
        sa.select(t.c.lease_owner, latest)
        .where(
            t.c.status == Status.DELIVERING.value,
            t.c.lease_owner.is_not(None),
            t.c.lease_owner != node_id,
            # Not a lease "until infinity": no relay takes one (and PostgreSQL's
            # driver cannot read it back).
            time_ahead(t.c.lease_expires_at, db_now()),
        )
        .group_by(t.c.lease_owner)
        .limit(50)
    ).all()
    return {str(owner): expires for owner, expires in rows if expires is not None}


class ForeignRelayMonitor:
    """Warns once, loudly, when another relay works the same table without Redis.

    Call :meth:`check` at start and with each backlog sample. A relay counts as
    live when its latest row lease moved forward between two checks, i.e. it
    claimed since; a crashed predecessor's leftover leases (which never move)
    do not trigger the warning.
    """

    def __init__(self, table: str, node_id: str, logger: logging.Logger | None = None) -> None:
        self.table = table
        self.node_id = node_id
        self.log = logger or _log
        self._seen: dict[str, dt.datetime] = {}
        self._others = Episode(self.log, "multiple-relays-without-redis")  # never ends

    def check(self, conn: Connection) -> set[str]:
        """Return the relays seen claiming since the previous check."""
        current = detect_foreign_relays(conn, self.table, self.node_id)
        active = {o for o, exp in current.items() if o in self._seen and exp > self._seen[o]}
        self._seen = current
        if active:
            self._others.begin(
                table=self.table,
                others=sorted(active),
                detail=(
                    "another relay is claiming rows of this table and no Redis is configured: "
                    "rows are never claimed twice, but per-key order across the relays is no "
                    "longer guaranteed; set OUTBOXKIT_REDIS_URL on every relay"
                ),
            )
        return active
