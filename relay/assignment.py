"""Which relay serves which shard: the split every relay computes identically.

No coordination: each relay reads the same live member set from Redis (see
:mod:`outboxkit.relay.ownership.redis_leases`; with advisory locks, from
``pg_locks``) and runs :func:`assign_shards` on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["assign_shards"]


def _weight(member: str, shard: int) -> int:
    digest = hashlib.blake2b(f"{member}\x00{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign_shards(shard_count: int, members: Iterable[str]) -> dict[str, frozenset[int]]:
    """The split of shards over ``members`` that every relay computes identically.

    Rendezvous hashing with quotas: (shard, member) pairs are taken in order of a
    stable hash weight, and a member takes a shard while it has fewer than
    ``floor(shards / members)``, or one more while fewer than ``shards % members``
    members have reached that. Every member ends with ``floor`` or ``ceil`` shards
    (a split within +-1 of fair), and a join or a leave moves few shards.
    """
    names = sorted(set(members))
    if not names:
        return {}
    base, extra = divmod(shard_count, len(names))
    counts = dict.fromkeys(names, 0)
    owned: dict[str, set[int]] = {m: set() for m in names}
    at_ceiling = 0
    taken: set[int] = set()
    pairs = sorted(((_weight(m, s), m, s) for s in range(shard_count) for m in names), reverse=True)
    for _, member, shard in pairs:
        if shard in taken:
            continue
        n = counts[member]
        if n < base or (n == base and at_ceiling < extra):
            if n == base:
                at_ceiling += 1
            counts[member] = n + 1
            owned[member].add(shard)
            taken.add(shard)
            if len(taken) == shard_count:
                break
    return {m: frozenset(s) for m, s in owned.items()}
