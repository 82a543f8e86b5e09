"""What a claim hands out and what it is handed: the claimed rows and their
batch (:class:`ClaimedRow`, :class:`Batch`), and the two limits a claim may be
given (:class:`ClaimFence`, :class:`ByteBudget`).

Apart from the claim (:mod:`outboxkit.relay.claim`) because most modules that
name these types never claim: publish, finalize, drain and accounting carry a
batch's rows, and a shard ownership builds the fence its claims check. They
import these few dataclasses, not the claim's SQL and statements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

__all__ = ["Batch", "ByteBudget", "ClaimFence", "ClaimedRow"]


# Not frozen, like Report and Decision: a frozen dataclass's ``__init__`` sets
# each field through ``object.__setattr__``, about 6 x slower (2.7 against 0.44 µs
# for 11 fields), and the relay builds one of each per row. Nothing assigns to
# their fields after construction; they are not hashed.
@dataclass(slots=True)
class ClaimedRow:
    id: int
    event_id: str
    topic: str
    key: bytes | None
    payload: bytes
    headers: str | None
    shard: int
    #: Attempts including this claim.
    attempts: int
    #: Seconds from the row's ``created_at`` to the claim, on the database clock.
    age_at_claim: float
    #: Owner of the expired lease this claim took over, or None.
    reclaimed_from: str | None
    #: The stored shard when it was outside the table's range (``shard`` then
    #: holds the shard the row was claimed under), else None.
    misplaced_shard: int | None = None
    #: Why the row can never be sent, found by the claim (its payload is over the
    #: producer's ``message.max.bytes``; see :class:`ByteBudget`): ``payload`` was
    #: then not loaded. The publisher fails such a row without producing it.
    unsendable: str | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows leased to ``owner`` under ``token`` for the lease TTL from the claim
    (the lease's end is database time; ``claimed_mono``, this process's monotonic
    clock when the claim returned, is later than its start)."""

    owner: str
    token: str
    rows: tuple[ClaimedRow, ...]
    claimed_mono: float

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shards(self) -> frozenset[int]:
        return frozenset(r.shard for r in self.rows)

    def age(self, row: ClaimedRow, mono: float) -> float:
        """Seconds from ``row``'s ``created_at`` (database clock) to monotonic time
        ``mono``: its age at the claim plus the time since."""
        return row.age_at_claim + (mono - self.claimed_mono)


@dataclass(frozen=True, slots=True)
class ClaimFence:
    """A condition the claim's lease statement must meet, checked by the server
    after the claim locked its rows: the claim leases nothing when it is false.

    ``clause`` is built once and reused (the lease statement with it is cached
    per clause object); ``params`` are its bound values for this claim;
    ``what`` names the hold it checks, for the ``claim-fenced`` log line."""

    clause: sa.ColumnElement[bool]
    params: Mapping[str, Any]
    what: str


@dataclass(frozen=True, slots=True)
class ByteBudget:
    """The bytes of payloads and headers one claim may load (``max_bytes``), and
    the largest record the producer sends (``max_message_bytes``, its
    ``message.max.bytes``). See :func:`outboxkit.relay.claim._within_budget`
    for the rule."""

    max_bytes: int
    max_message_bytes: int

    def inline_max(self, limit: int) -> int:
        """Rows up to this size (payload + headers) come with the lock statement:
        ``limit`` of them are ``max_bytes`` at most, whatever the claim then keeps."""
        return max(1, self.max_bytes // limit)
