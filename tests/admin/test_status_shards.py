"""``admin status`` reads the shard leases under the keys the relays write them to."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases
from support.waiting import bound, wait_for

from outboxkit.admin import read_shards
from outboxkit.relay.ownership.redis_leases import LeaseSettings, RedisShardLeases
from outboxkit.runtime.identity import read_identity


@pytest.mark.integration
@on_both_databases
def test_admin_status_shows_the_owners_the_leases_wrote(
    engine: sa.Engine, outbox: str, redis_url: str, redis_prefix: str
) -> None:
    settings = LeaseSettings(ttl=1.5, renew_interval=0.25, batch_budget=0.4, prefix=redis_prefix)
    with engine.connect() as conn:
        key = read_identity(conn, outbox).key  # what a relay names its leases by
    relays = [
        RedisShardLeases(
            redis_url, table=outbox, node_id=n, shard_count=8, settings=settings, outbox=key
        )
        for n in ("relay-a", "relay-b")
    ]
    try:
        for r in relays:
            r.start(frozenset)

        def settled() -> bool:
            held = [r.held() for r in relays]
            return all(h and h == r.targets for h, r in zip(held, relays, strict=True)) and (
                sum(len(h) for h in held) == 8
            )

        wait_for(settled, timeout=bound(15), what="both relays hold their share")
        view = read_shards(engine, redis_url, table=outbox, prefix=redis_prefix)
        assert view.shard_count == 8
        assert view.unowned == []
        assert view.owners == {r.node_id: sorted(r.held()) for r in relays}
    finally:
        for r in relays:
            r.release_all()
            r.close()
    view = read_shards(engine, redis_url, table=outbox, prefix=redis_prefix)
    assert view.owners == {} and view.unowned == list(range(8))
