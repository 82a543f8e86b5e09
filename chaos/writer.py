"""The writer process: commits the run's events in small transactions at a steady
rate, as a service would, and keeps going through database faults.

Event ``i`` has key ``k{i % keys}`` and the fixed event id ``e{seed}-{i}``, so a
commit whose outcome was lost (the server died at COMMIT) is retried safely: if
it had committed, the retry hits the unique event id and is skipped. The outbox
table is the record of what was committed.

    python -m chaos.writer DB_URL TOPIC EVENTS KEYS SECONDS SEED
"""

from __future__ import annotations

import json
import sys
import time

import sqlalchemy as sa
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from outboxkit import Event, enqueue_many

CHUNK = 20


def events(seed: int, keys: int, start: int, stop: int, topic: str) -> list[Event]:
    return [
        Event(topic=topic, key=f"k{i % keys}", payload={"i": i}, event_id=f"e{seed}-{i}")
        for i in range(start, stop)
    ]


def commit(engine: sa.Engine, batch: list[Event]) -> str:
    try:
        with engine.begin() as conn:
            enqueue_many(conn, batch)
    except sa.exc.IntegrityError:
        return "already-committed"
    return "committed"


def main(argv: list[str]) -> int:
    db_url, topic, total_s, keys_s, seconds_s, seed_s = argv
    total, keys, seconds, seed = int(total_s), int(keys_s), float(seconds_s), int(seed_s)
    # A statement the database does not answer gives up after 10 s (then retried).
    if sa.make_url(db_url).get_backend_name() == "postgresql":
        # Kept beside the URL's own options (the neighbour outbox's search_path):
        # connect_args replace the URL's query, they do not add to it.
        own = sa.make_url(db_url).query.get("options", "")
        timeouts: dict[str, object] = {
            "connect_timeout": 10,
            "options": f"{own} -c statement_timeout=10000".strip(),
        }
    else:
        timeouts = {"read_timeout": 10, "write_timeout": 10}
    engine = sa.create_engine(db_url, pool_pre_ping=True, pool_size=1, connect_args=timeouts)
    rate = total / seconds
    started = time.monotonic()
    retrying = Retrying(
        retry=retry_if_exception_type((sa.exc.OperationalError, sa.exc.InterfaceError)),
        wait=wait_random_exponential(multiplier=0.2, max=2.0),
        stop=stop_after_delay(300),
        reraise=True,
    )
    retried = ambiguous = 0
    last_report = started
    for start in range(0, total, CHUNK):
        batch = events(seed, keys, start, min(total, start + CHUNK), topic)
        for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    retried += 1
                if commit(engine, batch) == "already-committed":
                    ambiguous += 1
        done = start + len(batch)
        now = time.monotonic()
        if now - last_report >= 5:
            last_report = now
            print(
                json.dumps({"event": "writer-progress", "written": done, "retried": retried}),
                flush=True,
            )
        ahead = started + done / rate - now
        if ahead > 0:
            time.sleep(ahead)
    print(
        json.dumps(
            {
                "event": "writer-done",
                "written": total,
                "retried": retried,
                "already_committed": ambiguous,
                "seconds": round(time.monotonic() - started, 1),
            }
        ),
        flush=True,
    )
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
