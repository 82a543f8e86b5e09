"""Scenario 4, backlog scaling: one relay drains a large backlog (1,000,000 rows by
default); the rate of the last 10% is compared with the rate of the first 10%.

Delivered rows pile up behind the relay as it goes, so a claim whose cost grew
with delivered history would show here as a slower tail.  The same again with
delete-on-deliver, where the table shrinks instead (and purged rows leave
InnoDB delete-marks for the purge thread).

Memory: each drain reports the relay's peak resident set (VmHWM), and a first,
smaller drain of ``backlog_rows / memory_scale`` rows gives the same figure for
a quarter of the backlog (by default), so ``rss_growth`` says whether a relay's
memory grows with the backlog it drains.  ``relay cpu s/1k events`` is its CPU
per 1,000 events.
"""

from __future__ import annotations

import re
import threading

import sqlalchemy as sa

from bench.activity import DbActivity
from bench.context import BenchContext
from bench.report import ScenarioResult
from bench.scenarios import Results
from bench.scenarios.common import batch_size, template
from bench.scenarios.relay_runs import drain_backlog, require_relay, table_for

_HISTORY = re.compile(r"History list length (\d+)")


class PurgeLag:
    """Samples the database's garbage not cleaned up yet, in a thread.

    MySQL/MariaDB: InnoDB's history list length (undo records not purged yet).
    PostgreSQL: the table's dead row versions (``n_dead_tup``, until autovacuum).
    Every status change leaves a dead ``(status, id)`` index entry behind; if the
    clean-up fell behind, the claim's range scan would step over ever more of
    them, so the largest value seen says whether that could explain a slower tail.
    """

    def __init__(self, engine: sa.Engine, table: str, interval: float = 5.0) -> None:
        self.engine = engine
        self.table = table
        self.interval = interval
        self.largest = 0
        #: PostgreSQL: autovacuum's passes over the table, and the server setting
        #: that spaces them.
        self.vacuums = 0
        self.naptime: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-purge-lag", daemon=True)

    def __enter__(self) -> PurgeLag:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def label(self) -> str:
        return "max dead rows" if self.engine.dialect.name == "postgresql" else "max history list"

    def note(self, what: str) -> str | None:
        if self.naptime is None:
            return None
        return f"{what}: {self.vacuums} autovacuum passes (autovacuum_naptime {self.naptime})"

    def _sample(self) -> int:
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "postgresql":
                row = conn.execute(
                    sa.text(
                        "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables"
                        " WHERE relname = :t"
                    ),
                    {"t": self.table},
                ).one_or_none()
                if row is None:
                    return 0
                # The table is made for the drain and dropped after it: the most
                # seen is how many times autovacuum took it up (up to the last sample).
                self.vacuums = max(self.vacuums, int(row.autovacuum_count or 0))
                if self.naptime is None:
                    self.naptime = str(conn.execute(sa.text("SHOW autovacuum_naptime")).scalar())
                return int(row.n_dead_tup or 0)
            status = conn.execute(sa.text("SHOW ENGINE INNODB STATUS")).one()[-1]
        m = _HISTORY.search(str(status))
        return int(m.group(1)) if m else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.largest = max(self.largest, self._sample())
            except sa.exc.DBAPIError:  # needs the PROCESS privilege; the figure is optional
                return
            self._stop.wait(self.interval)


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    cfg = ctx.config
    res = ScenarioResult("backlog-scaling", "first 10% vs last 10% of a large backlog")
    n = cfg.backlog_rows
    small = max(1, n // max(1, cfg.memory_scale))
    res.settings = {"rows": n, "small_rows": small, "batch_size": batch_size(cfg), "relays": 1}
    source = template(ctx, n)
    # The smaller backlog first, for the peak-memory comparison only.
    out = drain_backlog(ctx, source=source, rows=small, relays=1, label="scale-small")
    res.rows.append(
        {
            "finalize": "mark delivered",
            "rows": small,
            "seconds": out.seconds,
            "events/s": out.rate,
            **out.cpu_row(),
        }
    )
    if out.peak_rss_mb is not None:
        res.figures["rss_mb_small"] = out.peak_rss_mb
    res.notes.extend(out.notes)
    for delete in (False, True):
        label = "scale-delete" if delete else "scale"
        with PurgeLag(ctx.engine, table_for(label)) as lag, DbActivity(ctx.engine) as activity:
            out = drain_backlog(
                ctx, source=source, rows=n, relays=1, label=label, delete_on_deliver=delete
            )
        p = out.progress
        first = 0.1 * n / (p.time_at(0.1 * n) - p.first_nonzero())
        last = p.rate_between(0.9 * n, n)
        # Every tenth, so the two the goal compares can be read against the spread.
        tenths = [first] + [p.rate_between(i * n / 10, (i + 1) * n / 10) for i in range(1, 10)]
        mode = "delete" if delete else "mark delivered"
        res.tables.setdefault("events/s in each tenth of the drain", []).append(
            {"finalize": mode} | {str(i + 1): rate for i, rate in enumerate(tenths)}
        )
        # PostgreSQL: what the server's sessions did in each tenth, to tell a
        # slow tenth's cause on the database's side from one on the relay's.
        bounds = [p.first_nonzero()] + [p.time_at(i * n / 10) for i in range(1, 11)]
        labels = [f"{i + 1} ({rate:,.0f}/s)" for i, rate in enumerate(tenths)]
        if stretches := activity.by_stretch(bounds, labels):
            res.tables[f"PostgreSQL sessions in each tenth ({mode})"] = stretches
        res.rows.append(
            {
                "finalize": mode,
                "rows": n,
                "seconds": out.seconds,
                "events/s": out.rate,
                "first 10%/s": first,
                "last 10%/s": last,
                "last vs first": last / first,
                lag.label: lag.largest,
                **out.cpu_row(),
            }
        )
        suffix = "_delete" if delete else ""
        res.figures[f"rate{suffix}"] = out.rate
        res.figures[f"last_vs_first{suffix}"] = last / first
        if (per_1k := out.relay_cpu_per_1k) is not None:
            res.figures[f"relay_cpu_per_1k{suffix}"] = per_1k
        if out.peak_rss_mb is not None:
            res.figures[f"rss_mb{suffix}"] = out.peak_rss_mb
        res.notes.extend(out.notes)
        vacuum_note = lag.note(f"{n:,}-row drain ({'delete' if delete else 'mark delivered'})")
        if vacuum_note:
            res.notes.append(vacuum_note)
        if out.profile:
            res.tables[f"profile of the relay ({mode}), share of its loop's wall time"] = (
                out.profile
            )
    big, little = res.figures.get("rss_mb"), res.figures.get("rss_mb_small")
    if big and little:
        res.figures["rss_growth"] = big / little
        res.notes.append(
            f"relay peak RSS: {big:.0f} MB draining {n:,} rows, {little:.0f} MB draining "
            f"{small:,} rows (x{big / little:.2f})"
        )
    return res
