"""Relays that claim rows of one outbox without sharing its shards: detect it
and say so loudly.

Without Redis one relay owns every shard (:class:`~outboxkit.relay.shards.AllShards`);
a second such relay never double-claims a row, but per-key order across the
two is lost. :class:`ForeignRelayMonitor` notices it from the row leases.
:class:`OutsiderMonitor` does the same for a relay that shares shards through
Redis leases or advisory locks: it reports a relay that claims rows of the
outbox from outside that ownership (mixed ownership modes, another prefix,
an older version's names).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.relay._dbtime import time_ahead
from outboxkit.relay.conflicts import OwnershipConflicts
from outboxkit.runtime.logs import Episode
from outboxkit.schema.table import Status, db_now, outbox_table, validate_identifier

__all__ = ["ForeignRelayMonitor", "OutsiderMonitor", "detect_foreign_relays"]

# The name it has always logged under (it lived in the leases module), as the
# shard-ownership backends do.
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

    def __init__(
        self,
        table: str,
        node_id: str,
        logger: logging.Logger | None = None,
        *,
        conflicts: OwnershipConflicts | None = None,
    ) -> None:
        self.table = table
        self.node_id = node_id
        self.log = logger or _log
        self.conflicts = conflicts
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
            if self.conflicts is not None:
                self.conflicts.report(
                    "outsider", frozenset(active), mode="all", others=sorted(active)
                )
        return active


class OutsiderMonitor:
    """Reports relays that claim rows of this outbox from outside its ownership.

    With Redis leases or advisory locks, every relay of an outbox is a member
    of one ownership and the members split the shards. A relay that claims rows
    of the outbox but is not a member (``--shard-ownership`` set otherwise, one
    relay with ``--redis-url`` and one without, another ``--redis-prefix``, an
    older version naming its keys otherwise) splits nothing with them: per-key
    order across the two is lost. Every relay sees the rows, whatever its mode,
    so this is found from the row leases, cheaply (``delivering`` rows only),
    with each backlog sample: a lease owner whose latest lease moved forward in
    two checks in a row (it keeps claiming; a relay that crashed or drained
    does not) and that ``is_member`` does not know is reported as an
    ``outsider`` conflict (:mod:`outboxkit.relay.conflicts`). The conflict
    ends after ``quiet_checks`` checks without one.

    ``is_member(node_id)`` answers from the ownership's current view; None when
    it cannot tell now (Redis unreachable, the session down): no verdict then.
    """

    def __init__(
        self,
        table: str,
        node_id: str,
        *,
        mode: str,
        is_member: Callable[[str], bool | None],
        conflicts: OwnershipConflicts,
        quiet_checks: int = 10,
    ) -> None:
        self.table = table
        self.node_id = node_id
        self.mode = mode
        self.is_member = is_member
        self.conflicts = conflicts
        self.quiet_checks = quiet_checks
        self._seen: dict[str, dt.datetime] = {}
        self._suspects: frozenset[str] = frozenset()
        self._quiet = 0

    def check(self, conn: Connection) -> set[str]:
        """Return the outsiders confirmed by this check."""
        current = detect_foreign_relays(conn, self.table, self.node_id)
        moved = {o for o, exp in current.items() if o in self._seen and exp > self._seen[o]}
        self._seen = current
        verdicts = {o: self.is_member(o) for o in moved}
        if any(v is None for v in verdicts.values()):
            return set()
        outside = frozenset(o for o, member in verdicts.items() if not member)
        confirmed = outside & self._suspects
        self._suspects = outside
        if confirmed:
            self._quiet = 0
            self.conflicts.report(
                "outsider",
                confirmed,
                mode=self.mode,
                others=sorted(confirmed),
                detail=(
                    f"these relays claim rows of this outbox but are not among the relays "
                    f"sharing its shards through {self.mode}: another --shard-ownership, a "
                    "missing or different --redis-url / --redis-prefix, or an older version "
                    "naming its keys otherwise; rows are never claimed twice, but per-key "
                    "order across them is no longer guaranteed. Give every relay of the "
                    "outbox the same ownership settings"
                ),
            )
        elif not outside:
            self._quiet += 1
            if self._quiet >= self.quiet_checks:
                self.conflicts.clear("outsider")
        return set(confirmed)
