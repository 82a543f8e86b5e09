"""``NOTIFY`` wake-ups against a real PostgreSQL: a committed ``enqueue`` wakes the
relay's waker, a rolled-back one does not, and the listener survives the death
of its session.

Absence is proven as in tests/test_notify.py: after the transaction under test
a marker notification is committed; notifications arrive in commit order, so
whatever the transaction sent would have been counted before the marker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from support.waiting import bound, wait_for

from outboxkit import enqueue
from outboxkit.notify import notify_channel
from outboxkit.relay.pg_wakeup import PgNotifyWaker
from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

TABLE = "outbox_events"
#: The poll interval a wake-up must beat by far.
POLL_S = 10.0

WakerFactory = Callable[..., PgNotifyWaker]


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    apply_schema(engine, shards=8)
    yield engine
    engine.dispose()


@pytest.fixture
def make_waker(pg_url: str) -> Iterator[WakerFactory]:
    made: list[PgNotifyWaker] = []

    def make(**kwargs: object) -> PgNotifyWaker:
        waker = PgNotifyWaker(pg_url, TABLE, **kwargs)  # type: ignore[arg-type]
        made.append(waker)
        return waker

    yield make
    for waker in made:
        waker.close()


def _listening(waker: PgNotifyWaker) -> PgNotifyWaker:
    """Wait until the waker listens, then consume the wake-up it gives itself then."""
    wait_for(waker.listening.is_set, timeout=10, what="LISTEN")
    waker.wait(0)
    return waker


def _enqueue(engine: sa.Engine, *, commit: bool, n: int = 1) -> None:
    with engine.connect() as conn:
        enqueue(conn, topic="orders", payload={"n": n}, key=f"k{n}", table=TABLE)
        conn.commit() if commit else conn.rollback()


def _marker(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_notify(:c, 'marker')"), {"c": notify_channel(TABLE)})


def _timed_wait(waker: PgNotifyWaker, timeout: float) -> float:
    started = time.monotonic()
    waker.wait(timeout)
    return time.monotonic() - started


def _enqueue_later(engine: sa.Engine, delay: float) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: (time.sleep(delay), _enqueue(engine, commit=True)), daemon=True
    )
    thread.start()
    return thread


def test_committed_enqueue_wakes_a_waiting_waker(
    pg_engine: sa.Engine, make_waker: WakerFactory
) -> None:
    waker = _listening(make_waker())
    writer = _enqueue_later(pg_engine, 0.2)
    took = _timed_wait(waker, POLL_S)
    writer.join()
    assert took < POLL_S / 2, f"woke after {took:.2f} s, not by the notification"
    assert waker.hints == 1


def test_rolled_back_enqueue_does_not_wake(pg_engine: sa.Engine, make_waker: WakerFactory) -> None:
    waker = _listening(make_waker())
    _enqueue(pg_engine, commit=False)
    _marker(pg_engine)
    wait_for(lambda: waker.hints >= 1, timeout=10, what="the marker")
    assert waker.hints == 1, "the rolled-back enqueue sent a notification"


def test_listens_again_after_its_session_is_terminated(
    pg_engine: sa.Engine, make_waker: WakerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxkit")
    waker = _listening(make_waker())
    first = waker.backend_pid
    assert first is not None
    with pg_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": first}).scalar()
    wait_for(lambda: waker.backend_pid not in (None, first), timeout=10, what="a new session")
    _listening(waker)
    writer = _enqueue_later(pg_engine, 0.2)
    took = _timed_wait(waker, POLL_S)
    writer.join()
    assert took < POLL_S / 2, f"woke after {took:.2f} s after the reconnect"

    events = [getattr(r, "outboxkit_event", None) for r in caplog.records]
    assert "wakeup-unsubscribed" in events and "wakeup-subscribed" in events, events
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert ":outboxkit@" not in text, "the database password in a log line"
    assert "database=postgresql+psycopg://outboxkit:***@" in text


def test_wakes_after_listening_starts_for_rows_committed_before(
    pg_engine: sa.Engine, make_waker: WakerFactory
) -> None:
    # A row committed before LISTEN took effect has no notification for us: the
    # waker wakes once when it starts listening, so the relay claims once more.
    _enqueue(pg_engine, commit=True)
    waker = make_waker()
    wait_for(waker.listening.is_set, timeout=10, what="LISTEN")
    assert _timed_wait(waker, POLL_S) < POLL_S / 2


def test_drain_ends_every_wait(make_waker: WakerFactory) -> None:
    draining = threading.Event()
    waker = _listening(make_waker(lifecycle_or_event=draining))
    threading.Timer(0.2, draining.set).start()
    assert _timed_wait(waker, POLL_S) < POLL_S / 2
    assert _timed_wait(waker, POLL_S) < bound(0.5)
    waker.wake()
    assert _timed_wait(waker, POLL_S) < bound(0.5)


def test_an_unreachable_database_is_retried_and_logged_masked(
    make_waker: WakerFactory, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxkit")
    dead = sa.make_url(pg_url).set(port=1).render_as_string(hide_password=False)
    waker = PgNotifyWaker(dead, TABLE, connect_timeout=1.0)
    try:
        wait_for(
            lambda: any("wakeup-unsubscribed" in r.getMessage() for r in caplog.records),
            timeout=10,
            what="the outage log line",
        )
        assert not waker.listening.is_set()
        assert _timed_wait(waker, 0.3) >= 0.25  # polls meanwhile
    finally:
        waker.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert ":outboxkit@" not in text
