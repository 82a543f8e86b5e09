"""What a PostgreSQL server's sessions are doing during a drain, sampled in a thread.

A drain's rate can dip for reasons on either side of the connection. Sampled
every ``interval`` seconds (``pg_stat_activity``), then split by stretches of
the drain (:meth:`DbActivity.by_stretch`), it tells them apart: the relay's
sessions busy in the server, in which statements and on what they wait;
transactions it left open while it is elsewhere (on Kafka, on its own CPU);
an autovacuum worker at work; a checkpoint being written. Autovacuum and
checkpoints are only visible to a superuser or a member of
``pg_read_all_stats``. MySQL/MariaDB: not sampled.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa

#: Client sessions other than the sampler's and the relay's side connections
#: (LISTEN, shard ownership), and the server's workers that compete with them.
_QUERY = sa.text(
    """
    SELECT backend_type, state, wait_event_type, wait_event, left(query, 200) AS query
    FROM pg_stat_activity
    WHERE pid <> pg_backend_pid()
      AND (backend_type IN ('autovacuum worker', 'checkpointer')
           OR (backend_type = 'client backend' AND datname = current_database()
               AND application_name NOT LIKE 'outboxkit-%'))
    """
)


@dataclass
class _Sample:
    at: float
    active: int = 0
    idle_in_tx: int = 0
    autovacuum: bool = False
    checkpoint: bool = False
    waits: collections.Counter[str] = field(default_factory=collections.Counter)
    statements: collections.Counter[str] = field(default_factory=collections.Counter)


class DbActivity:
    def __init__(self, engine: sa.Engine, interval: float = 0.1) -> None:
        self.engine = engine
        self.interval = interval
        self.samples: list[_Sample] = []
        #: Whether the server's own processes are visible to this user (superuser
        #: or ``pg_read_all_stats``); else autovacuum and checkpoints are not known.
        self.sees_server = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-db-activity", daemon=True)

    def __enter__(self) -> DbActivity:
        if self.engine.dialect.name == "postgresql":
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        with self.engine.connect() as conn:
            while not self._stop.is_set():
                sample = _Sample(at=time.monotonic())
                for row in conn.execute(_QUERY):
                    if row.backend_type == "autovacuum worker":
                        sample.autovacuum = True
                    elif row.backend_type == "checkpointer":
                        # Between checkpoints it sleeps in CheckpointerMain.
                        self.sees_server = True
                        sample.checkpoint = row.wait_event != "CheckpointerMain"
                    elif row.state == "active":
                        sample.active += 1
                        sample.statements[_statement(row.query or "")] += 1
                        sample.waits[
                            f"{row.wait_event_type}:{row.wait_event}" if row.wait_event else "CPU"
                        ] += 1
                    elif row.state == "idle in transaction":
                        sample.idle_in_tx += 1
                conn.rollback()
                self.samples.append(sample)
                self._stop.wait(self.interval)

    def by_stretch(self, bounds: Sequence[float], labels: Sequence[str]) -> list[dict[str, object]]:
        """One row per stretch ``bounds[i]..bounds[i + 1]`` (monotonic seconds)."""
        rows: list[dict[str, object]] = []
        for label, lo, hi in zip(labels, bounds, bounds[1:], strict=False):
            inside = [s for s in self.samples if lo <= s.at < hi]
            if not inside:
                continue
            n = len(inside)
            waits: collections.Counter[str] = collections.Counter()
            for s in inside:
                waits.update(s.waits)
            top = ", ".join(f"{w} {c / n:.2f}" for w, c in waits.most_common(3))
            statements: collections.Counter[str] = collections.Counter()
            for s in inside:
                statements.update(s.statements)
            busiest = ", ".join(f"{w} {c / n:.2f}" for w, c in statements.most_common(3))
            rows.append(
                {
                    "stretch": label,
                    "samples": n,
                    "sessions in a statement": sum(s.active for s in inside) / n,
                    "idle in transaction": sum(s.idle_in_tx for s in inside) / n,
                    "top waits (sessions)": top,
                    "statements (sessions)": busiest,
                    "autovacuum share": (
                        sum(s.autovacuum for s in inside) / n if self.sees_server else None
                    ),
                    "checkpoint share": (
                        sum(s.checkpoint for s in inside) / n if self.sees_server else None
                    ),
                }
            )
        return rows


def _statement(query: str) -> str:
    """A statement told apart from the relay's others by its first 48 characters."""
    return " ".join(query.split())[:48] or "?"
