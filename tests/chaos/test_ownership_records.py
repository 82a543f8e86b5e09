"""The ownership rebuild reads a drain that could not reach Redis: found by the
chaos suite's full run, where 694 "overlaps" were relays redeployed while Redis
was frozen, whose intervals never closed although they had exited."""

from __future__ import annotations

import datetime as dt

import pytest
from support.ownership import ownership_overlaps

pytestmark = pytest.mark.unit

#: 18:00:00 UTC: the records' times are milliseconds after it, on one clock
BASE = dt.datetime(2026, 11, 30, 18, tzinfo=dt.UTC)


def _at(ms: int) -> str:
    return (BASE + dt.timedelta(milliseconds=ms)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _acquired(node: str, shard: int, ms: int) -> dict[str, object]:
    redis_ms = int(BASE.timestamp() * 1000) + ms
    return {
        "event": "shard-acquired",
        "node_id": node,
        "shard": shard,
        "redis_ms": redis_ms,
        "ts": _at(ms),
    }


def test_a_drain_that_could_not_release_ends_its_ownership_at_that_record() -> None:
    released_late = {
        "event": "shard-release-failed",
        "node_id": "a",
        "shards": [3, 5],
        "ts": _at(20_000),
    }
    records = [
        _acquired("a", 3, 10_000),
        _acquired("a", 5, 10_000),
        released_late,
        _acquired("b", 3, 28_500),  # after a's lease expired in Redis
    ]
    assert ownership_overlaps(records) == (3, [])
    # without the record, a's interval never ends: the rebuild reports an overlap
    count, overlaps = ownership_overlaps([r for r in records if r is not released_late])
    assert count == 3 and [(o.shard, o.node, o.other) for o in overlaps] == [(3, "a", "b")]


def test_a_drain_that_could_not_release_does_not_hide_an_earlier_overlap() -> None:
    records = [
        _acquired("a", 3, 10_000),
        _acquired("b", 3, 15_000),
        {"event": "shard-release-failed", "node_id": "a", "shards": [3], "ts": _at(20_000)},
    ]
    _, overlaps = ownership_overlaps(records)
    assert [(o.shard, o.node, o.other) for o in overlaps] == [(3, "a", "b")]
