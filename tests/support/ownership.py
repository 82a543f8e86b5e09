"""Shard ownership rebuilt from the relays' lease events, on Redis's clock
(or, for PostgreSQL advisory locks, the database's: ``db_epoch_ms``, read after a lock
is taken and before one is let go, so a logged hold lies inside the real one).

Shared by the relay tests (``tests/relay/test_many_relays.py``) and the chaos
harness (``chaos/``): both check that two relays never held one shard at the
same moment.

An interval opens at ``shard-acquired`` and closes at ``shard-released`` or
``shard-lost``. Lease scripts run one at a time in Redis and each event that
comes from one carries Redis's clock (``redis_epoch_ms``), so a release and the next
owner's acquisition are ordered exactly, however late either relay gets to log
it. ``lease-unproven`` is a local deadline and carries the relay's clock (the
same machine's), seconds before the lease can expire in Redis: the moment the
proof ran out (``trusted_until_ms``, where the record has it), which after a
pause of the machine lies well before the record was written. A caller that
observed a lease's end itself (a killed or frozen relay cannot log one) adds a
record with ``redis_epoch_ms`` and event ``shard-lost``.

A draining relay that cannot reach Redis logs ``shard-release-failed`` with the
shards it still held: it has stopped claiming by then (release comes after the
drain), so its ownership of each ends at that record (its clock); in Redis the
lease lingers until its TTL, and no other relay can take the shard before.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LEASE_EVENTS = ("shard-acquired", "shard-released", "shard-lost")

#: (time in seconds, event, node_id, shard, reason)
Event = tuple[float, str, str, int, str]


@dataclass(frozen=True)
class Overlap:
    shard: int
    node: str
    start: float
    end: float
    other: str
    other_start: float
    other_end: float
    timeline: tuple[Event, ...]

    def __str__(self) -> str:
        return (
            f"shard {self.shard}: {self.node} held it {self.start:.3f}-{self.end:.3f} and "
            f"{self.other} {self.other_start:.3f}-{self.other_end:.3f}; "
            f"timeline {list(self.timeline)}"
        )


def lease_events(records: Iterable[Mapping[str, Any]]) -> list[Event]:
    """The lease events among log records, sorted by time (Redis's where known)."""
    events: list[Event] = []
    for r in records:
        if r.get("event") == "shard-release-failed":
            at = _wall(r)
            events += [
                (at, "shard-lost", str(r["node_id"]), int(s), "release-failed") for s in r["shards"]
            ]
            continue
        if r.get("event") not in LEASE_EVENTS:
            continue
        clock = r.get("redis_epoch_ms", r.get("db_epoch_ms", r.get("trusted_until_ms")))
        at = float(clock) / 1000 if clock is not None else _wall(r)
        reason = str(r.get("reason", ""))
        # Shards that changed hands together are one line (``shards``: ranges).
        shards = parse_shard_ranges(str(r["shards"])) if "shards" in r else [int(r["shard"])]
        events += [(at, str(r["event"]), str(r["node_id"]), s, reason) for s in shards]
    events.sort()
    return events


def parse_shard_ranges(text: str) -> list[int]:
    """``0-2,5`` (a ``shard-acquired`` / ``shard-released`` line's ``shards``) as
    ``[0, 1, 2, 5]``."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def _wall(record: Mapping[str, Any]) -> float:
    """A log record's own time (``ts``), as a Unix time."""
    return (
        dt.datetime.strptime(str(record["ts"]), "%Y-%m-%dT%H:%M:%S.%fZ")
        .replace(tzinfo=dt.UTC)
        .timestamp()
    )


#: shard -> [(node_id, start, end)], seconds on Redis's clock; end is inf while held
Intervals = dict[int, list[tuple[str, float, float]]]


def ownership_intervals(events: list[Event]) -> Intervals:
    """Each shard's ownership intervals rebuilt from sorted lease events."""
    intervals: Intervals = defaultdict(list)
    open_: dict[tuple[int, str], float] = {}
    for at, event, node, shard, _reason in events:
        if event == "shard-acquired":
            open_.setdefault((shard, node), at)
        elif (shard, node) in open_:
            intervals[shard].append((node, open_.pop((shard, node)), at))
    for (shard, node), since in open_.items():
        intervals[shard].append((node, since, math.inf))
    return intervals


def ownership_overlaps(records: Iterable[Mapping[str, Any]]) -> tuple[int, list[Overlap]]:
    """Rebuild each shard's ownership intervals; return their number and every overlap
    of two different relays' intervals."""
    events = lease_events(records)
    intervals = ownership_intervals(events)
    overlaps: list[Overlap] = []
    for shard, spans in intervals.items():
        for i, (node, start, end) in enumerate(spans):
            for other, o_start, o_end in spans[i + 1 :]:
                if other != node and min(end, o_end) > max(start, o_start):
                    timeline = tuple(e for e in events if e[3] == shard)
                    overlaps.append(
                        Overlap(shard, node, start, end, other, o_start, o_end, timeline)
                    )
    return sum(len(spans) for spans in intervals.values()), overlaps


def assert_never_owned_twice(records: Iterable[Mapping[str, Any]]) -> int:
    """Raise ``AssertionError`` naming the first overlap; else the number of intervals."""
    count, overlaps = ownership_overlaps(records)
    if overlaps:
        raise AssertionError(str(overlaps[0]))
    return count
