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
    redis_epoch_ms = int(BASE.timestamp() * 1000) + ms
    return {
        "event": "shard-acquired",
        "node_id": node,
        "shard": shard,
        "redis_epoch_ms": redis_epoch_ms,
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


@pytest.mark.integration
def test_a_lease_given_back_just_before_the_kill_ends_there(redis_url: str) -> None:
    """Found by the suite's chaos smoke: a relay killed right after a hand-over
    had given five shards back in Redis but not yet logged it; their intervals
    never closed and the next owner's looked like 5 overlaps. What Redis holds at
    the kill now ends them: no lease, ended by then; still the relay's, at its
    expiry; another relay's, not at all (a possible overlap stays visible)."""
    import uuid
    from types import SimpleNamespace

    import redis

    from chaos.faults import Injector
    from chaos.fleet import REDIS_PREFIX
    from outboxkit.runtime.rediskeys import lease_key

    outbox = f"t_{uuid.uuid4().hex[:8]}.outbox_events"
    client = redis.Redis.from_url(redis_url)
    fleet = SimpleNamespace(cfg=SimpleNamespace(ownership="redis", shards=3, timings=None))
    cluster = SimpleNamespace(redis_client=lambda: redis.Redis.from_url(redis_url))
    injector = Injector(fleet, cluster)  # type: ignore[arg-type]
    injector._outbox = outbox
    keys = [lease_key(REDIS_PREFIX, outbox, s) for s in range(3)]
    try:
        client.set(keys[0], b"relay-x:t0", px=5000)  # still the killed relay's
        client.set(keys[2], b"relay-y:t2", px=5000)  # already another's
        sec, usec = client.time()
        now = sec * 1000 + usec // 1000
        before, after = now - 10_000 - int(BASE.timestamp() * 1000), now + 1000
        after -= int(BASE.timestamp() * 1000)
        injector._note_lease_ends(SimpleNamespace(node_id="relay-x", stopped_at=None), "killed")  # type: ignore[arg-type]
        ends = {e["shard"]: e["reason"] for e in injector.lease_ends}
        assert ends == {0: "expired-killed", 1: "gone-killed"}
        records = [_acquired("relay-x", s, before) for s in range(3)]
        records += [_acquired("relay-y", 1, after), _acquired("relay-y", 2, before + 5000)]
        records += injector.lease_ends
        _, overlaps = ownership_overlaps(records)
        assert {o.shard for o in overlaps} == {2}, overlaps
    finally:
        client.delete(*keys)
        client.close()
