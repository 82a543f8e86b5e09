"""Shard ownership by session advisory locks against a real PostgreSQL: a fair
and disjoint split over live relays, hand-over to a joiner only once a shard has
no rows in flight, takeover when a session dies, release on drain.

Who holds a shard is read from the server (``pg_locks``), not only from the
relays' own view: the lock is the ownership.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from support.ownership import LEASE_EVENTS, parse_shard_ranges
from support.ownership import assert_never_owned_twice as never_owned_twice
from support.waiting import bound, wait_for

from outboxkit.errors import ConfigError
from outboxkit.relay.ownership.advisory_locks import PgAdvisoryShards, lock_keys
from outboxkit.schema.apply import _LOCK_NAME

pytestmark = pytest.mark.integration

TABLE = "outbox_events"
SHARDS = 8
#: Short ticks keep the suite quick.
TICK_S = 0.1

ShardsFactory = Callable[..., PgAdvisoryShards]


def _shards_of(fields: dict[str, object]) -> list[int]:
    """The shards of a ``shard-*`` line: one (``shard``) or several (``shards``)."""
    if "shards" in fields:
        return parse_shard_ranges(str(fields["shards"]))
    return [int(str(fields["shard"]))]


class Inflight:
    """The relay's view of shards holding rows it is delivering (a test double)."""

    def __init__(self) -> None:
        self.shards: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self.shards)

    def set(self, shards: set[int]) -> None:
        with self._lock:
            self.shards = set(shards)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def make_shards(pg_url: str) -> Iterator[ShardsFactory]:
    made: list[PgAdvisoryShards] = []

    def make(
        node_id: str,
        *,
        inflight: Inflight | None = None,
        shard_count: int = SHARDS,
        table: str = TABLE,
        start: bool = True,
        **kwargs: object,
    ) -> PgAdvisoryShards:
        shards = PgAdvisoryShards(
            pg_url,
            table=table,
            node_id=node_id,
            shard_count=shard_count,
            **{"tick_interval": TICK_S, "registry": CollectorRegistry(), **kwargs},  # type: ignore[arg-type]
        )
        made.append(shards)
        if start:
            shards.start(inflight or Inflight())
        return shards

    yield make
    for shards in made:
        shards.close()


def server_owners(
    engine: sa.Engine, table: str = TABLE, *, outbox: str | None = None
) -> dict[int, int]:
    """shard -> pid of the session that holds its advisory lock, from pg_locks.
    ``outbox``: the identity key the locks are named by (a relay's); without it,
    the bare table (as ``PgAdvisoryShards`` built without an identity names them)."""
    key1, _ = lock_keys(outbox or table, 0)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT objid::bigint, pid FROM pg_locks WHERE locktype = 'advisory' "
                "AND objsubid = 2 AND granted AND classid::bigint = :k1 "
                "AND objid::bigint < 2147483648 "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ),
            {"k1": key1 & 0xFFFFFFFF},
        )
        return {int(shard): int(pid) for shard, pid in rows}


class Unnoticing:
    """Stands in for a relay's ``PgAdvisoryShards._idle``: its session thread waits
    on a gate instead of watching the socket, as a thread on a busy host can be
    late to hear of its session's death (47 ms in a chaos run)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, conn: object, seconds: float) -> None:
        self.entered.set()
        self.gate.wait(bound(30))

    def install(self, monkeypatch: pytest.MonkeyPatch, shards: PgAdvisoryShards) -> None:
        """From the thread's next wait on, until :attr:`gate` opens."""
        monkeypatch.setattr(shards, "_idle", self)
        assert self.entered.wait(bound(10)), "the session thread never waited again"


def terminate(engine: sa.Engine, pid: int | None) -> None:
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()


def settled(relays: list[PgAdvisoryShards], shard_count: int = SHARDS) -> bool:
    """Every shard claimable by exactly one relay, each within +-1 of a fair share."""
    owned = [r.claimable() for r in relays]
    sizes = [len(o) for o in owned]
    union = frozenset().union(*owned)
    return (
        sum(sizes) == shard_count == len(union)
        and max(sizes) - min(sizes) <= 1
        and min(sizes) >= shard_count // len(relays)
    )


def assert_matches_server(engine: sa.Engine, relays: list[PgAdvisoryShards]) -> None:
    owners = server_owners(engine)
    for r in relays:
        pid = r.backend_pid
        assert pid is not None
        held_on_server = frozenset(s for s, p in owners.items() if p == pid)
        assert r.claimable() <= held_on_server, (r.node_id, r.claimable(), held_on_server)


@pytest.mark.parametrize("n_relays", [1, 2, 3])
@pytest.mark.parametrize("shard_count", [1, 7, 8])
def test_relays_split_the_shards_fairly_and_disjointly(
    pg_engine: sa.Engine, make_shards: ShardsFactory, n_relays: int, shard_count: int
) -> None:
    relays = [make_shards(f"relay-{i}", shard_count=shard_count) for i in range(n_relays)]
    wait_for(lambda: settled(relays, shard_count), timeout=10, what="a fair split")
    assert_matches_server(pg_engine, relays)


def test_a_joining_relay_gets_its_share_after_handover(
    pg_engine: sa.Engine, make_shards: ShardsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxkit")
    ra, rb = CollectorRegistry(), CollectorRegistry()
    a, b = make_shards("relay-a", registry=ra), make_shards("relay-b", registry=rb)
    wait_for(lambda: settled([a, b]), timeout=10, what="two relays")
    c = make_shards("relay-c")
    wait_for(lambda: settled([a, b, c]), timeout=10, what="three relays")
    assert_matches_server(pg_engine, [a, b, c])
    events = [getattr(r, "outboxkit_event", None) for r in caplog.records]
    assert "shard-released" in events and "rebalance" in events
    handed = [r.get_sample_value("outbox_shard_handovers_total") or 0 for r in (ra, rb)]
    assert sum(handed) >= 2, handed


def test_a_shard_with_rows_in_flight_is_not_handed_over_until_they_settle(
    pg_engine: sa.Engine, make_shards: ShardsFactory
) -> None:
    inflight = Inflight()
    a = make_shards("relay-a", inflight=inflight)
    wait_for(lambda: len(a.claimable()) == SHARDS, timeout=10, what="a alone owns all")
    inflight.set(set(range(SHARDS)))
    b = make_shards("relay-b")
    # b becomes a member and a stops claiming its surplus at once, but keeps the locks.
    wait_for(lambda: len(a.claimable()) == SHARDS // 2, timeout=10, what="a's surplus marked")
    deadline = time.monotonic() + 1.0  # ten ticks
    while time.monotonic() < deadline:
        assert b.claimable() == frozenset(), "a shard with rows in flight was handed over"
        assert len(server_owners(pg_engine)) == SHARDS
        time.sleep(TICK_S / 2)
    surplus = a.held() - a.claimable()
    keep = sorted(surplus)[0]
    inflight.set({keep})  # all but one settle
    wait_for(lambda: len(b.claimable()) == SHARDS // 2 - 1, timeout=10, what="partial handover")
    assert keep in a.held() and keep not in b.claimable()
    inflight.set(set())
    wait_for(lambda: settled([a, b]), timeout=10, what="the rest handed over")
    assert_matches_server(pg_engine, [a, b])


def test_a_claiming_block_keeps_its_shards(
    pg_engine: sa.Engine, make_shards: ShardsFactory
) -> None:
    a = make_shards("relay-a")
    wait_for(lambda: len(a.claimable()) == SHARDS, timeout=10, what="a alone owns all")
    with a.claiming() as shards:
        assert shards == frozenset(range(SHARDS))
        b = make_shards("relay-b")
        wait_for(lambda: len(a.claimable()) == SHARDS // 2, timeout=10, what="surplus marked")
        time.sleep(5 * TICK_S)
        assert b.claimable() == frozenset() and len(server_owners(pg_engine)) == SHARDS
    wait_for(lambda: settled([a, b]), timeout=10, what="handover after the block")


def test_a_dead_session_stops_claiming_at_once_and_its_shards_move(
    pg_engine: sa.Engine, make_shards: ShardsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxkit")
    # A long first reconnect delay, so the takeover is observed before a comes back.
    # A long tick: only the watch on the socket can notice the death this fast.
    a = make_shards("relay-a", reconnect_min=3.0, tick_interval=5.0)
    b = make_shards("relay-b")
    wait_for(lambda: settled([a, b]), timeout=10, what="two relays")
    pid = a.backend_pid
    with pg_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    killed = time.monotonic()
    wait_for(lambda: a.claimable() == frozenset(), timeout=1, interval=0.005, what="a stops")
    stopped_after = time.monotonic() - killed
    assert stopped_after < bound(0.5), f"a still claimed {stopped_after:.3f} s after its death"
    wait_for(lambda: len(b.claimable()) == SHARDS, timeout=10, what="b takes over")
    assert a.claimable() == frozenset()
    events = [getattr(r, "outboxkit_event", None) for r in caplog.records]
    assert "shard-session-lost" in events
    # a comes back with a new session and gets its share again.
    wait_for(lambda: a.backend_pid not in (None, pid), timeout=15, what="a reconnects")
    wait_for(lambda: settled([a, b]), timeout=15, what="split again")
    assert_matches_server(pg_engine, [a, b])
    assert "shard-session-restored" in [getattr(r, "outboxkit_event", None) for r in caplog.records]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert ":outboxkit@" not in text


def test_a_session_that_dies_while_leaving_still_logs_each_shards_end(
    pg_engine: sa.Engine, make_shards: ShardsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A drain that meets a database restart: the session dies after the relay
    began leaving and before it unlocked anything. The locks end with the
    session, and the log must say so for every shard (the chaos suite rebuilds
    ownership from these lines: a relay that said nothing held its shards
    forever there, an overlap with every later owner)."""
    caplog.set_level(logging.INFO, logger="outboxkit")
    a = make_shards("relay-a", reconnect_min=3.0, tick_interval=5.0)
    wait_for(lambda: len(a.claimable()) == SHARDS, timeout=10, what="a owns every shard")
    held = a.held()
    pid = a.backend_pid
    with a._lock:  # release_all's first step, then the session dies before the rest
        a._leaving = True
    with pg_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    wait_for(lambda: a.backend_pid is None, timeout=2, interval=0.005, what="the session ends")
    a.release_all()
    ended = {
        shard
        for r in caplog.records
        if getattr(r, "outboxkit_event", None) in ("shard-lost", "shard-released")
        for shard in _shards_of(r.outboxkit_fields)  # type: ignore[attr-defined]
    }
    assert ended == held


def test_release_all_frees_every_lock(pg_engine: sa.Engine, make_shards: ShardsFactory) -> None:
    a, b = make_shards("relay-a"), make_shards("relay-b")
    wait_for(lambda: settled([a, b]), timeout=10, what="two relays")
    pid = a.backend_pid
    a.release_all()
    assert a.claimable() == frozenset()
    assert pid not in server_owners(pg_engine).values()
    wait_for(lambda: len(b.claimable()) == SHARDS, timeout=10, what="b takes all")


def test_owned_gauge_counts_shards_held(make_shards: ShardsFactory) -> None:
    registry = CollectorRegistry()
    a = make_shards("relay-a", registry=registry)
    wait_for(
        lambda: registry.get_sample_value("outbox_shards_owned") == SHARDS,
        timeout=10,
        what="the gauge",
    )
    a.release_all()
    assert registry.get_sample_value("outbox_shards_owned") == 0


def test_tables_do_not_share_locks(pg_engine: sa.Engine, make_shards: ShardsFactory) -> None:
    a = make_shards("relay-a", table="outbox_a")
    b = make_shards("relay-b", table="outbox_b")
    wait_for(lambda: len(a.claimable()) == len(b.claimable()) == SHARDS, timeout=10, what="both")


def test_keys_do_not_meet_the_schema_lock() -> None:
    # schema apply locks one bigint key (objsubid 1); shard locks use two int4 keys
    # (objsubid 2): different key spaces in pg_locks, whatever the values.
    key1, key2 = lock_keys(TABLE, 3)
    assert key2 == 3 and -(2**31) <= key1 < 2**31
    assert lock_keys(TABLE, 3) == lock_keys(TABLE, 3)
    assert lock_keys("outbox_a", 0)[0] != lock_keys("outbox_b", 0)[0]
    assert _LOCK_NAME  # the schema lock's name, locked as pg_advisory_lock(hashtext(name))


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        PgAdvisoryShards("postgresql+psycopg://u@h/db", table=TABLE, node_id="n", shard_count=0)


def test_lock_changes_carry_the_database_clock_and_never_overlap(
    make_shards: ShardsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each acquisition and release logs ``db_epoch_ms`` (the server's clock, read after
    a lock is taken and before one is let go): the holds rebuilt from them, as the
    chaos suite does, never overlap across join, hand-over and drain."""
    caplog.set_level(logging.INFO, logger="outboxkit")
    nodes = ("relay-a", "relay-b", "relay-c")
    loggers = {n: logging.getLogger(f"outboxkit.test.pgshards.{n}") for n in nodes}
    a = make_shards("relay-a", logger=loggers["relay-a"])
    b = make_shards("relay-b", logger=loggers["relay-b"])
    wait_for(lambda: settled([a, b]), timeout=10, what="two relays")
    c = make_shards("relay-c", logger=loggers["relay-c"])
    wait_for(lambda: settled([a, b, c]), timeout=10, what="three relays")
    a.release_all()
    wait_for(lambda: settled([b, c]), timeout=10, what="two relays after a drain")

    node_of = {lg.name: n for n, lg in loggers.items()}
    records = [
        {
            "event": r.outboxkit_event,  # type: ignore[attr-defined]
            "node_id": node_of[r.name],
            **r.outboxkit_fields,  # type: ignore[attr-defined]
        }
        for r in caplog.records
        if r.name in node_of and getattr(r, "outboxkit_event", None) in LEASE_EVENTS
    ]
    changes = [r for r in records if r["event"] in ("shard-acquired", "shard-released")]
    assert {r["event"] for r in changes} == {"shard-acquired", "shard-released"}
    assert all(isinstance(r.get("db_epoch_ms"), int) for r in changes), changes
    assert never_owned_twice(records) >= SHARDS + 2  # a's, b's and c's first holds at least


def test_the_hold_of_a_session_that_died_unnoticed_ends_before_the_next_owner_takes_it(
    pg_engine: sa.Engine,
    make_shards: ShardsFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server ends a dead session's locks at once; the relay hears of it
    later. The ``shard-lost`` lines must not stretch the hold to that moment:
    the next owner took the shards in between, and the ownership rebuilt from
    the log showed two owners (64 overlaps in a chaos run). They carry the last
    moment the session was seen holding its locks instead."""
    caplog.set_level(logging.INFO, logger="outboxkit")
    loggers = {n: logging.getLogger(f"outboxkit.test.pgshards.{n}") for n in ("a", "b")}
    a = make_shards("relay-a", logger=loggers["a"], reconnect_min=3.0)
    wait_for(lambda: len(a.claimable()) == SHARDS, timeout=10, what="a owns every shard")
    unnoticing = Unnoticing()
    unnoticing.install(monkeypatch, a)
    terminate(pg_engine, a.backend_pid)
    b = make_shards("relay-b", logger=loggers["b"])
    wait_for(lambda: len(b.claimable()) == SHARDS, timeout=10, what="b takes every shard")
    assert len(a.claimable()) == SHARDS  # a has not heard yet: the window is open
    unnoticing.gate.set()
    wait_for(lambda: a.backend_pid is None, timeout=5, interval=0.005, what="a hears of it")

    node_of = {lg.name: n for n, lg in loggers.items()}
    records = [
        {
            "event": r.outboxkit_event,  # type: ignore[attr-defined]
            "node_id": node_of[r.name],
            # The line's own time, as in the JSON log: the rebuild's fallback.
            "ts": dt.datetime.fromtimestamp(r.created, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            **r.outboxkit_fields,  # type: ignore[attr-defined]
        }
        for r in caplog.records
        if r.name in node_of and getattr(r, "outboxkit_event", None) in LEASE_EVENTS
    ]
    assert never_owned_twice(records) == 2 * SHARDS
    lost = [r for r in records if r["event"] == "shard-lost"]
    assert sorted(r["shard"] for r in lost) == list(range(SHARDS))
    assert all(isinstance(r.get("db_epoch_ms"), int) for r in lost), lost
