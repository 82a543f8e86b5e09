"""The relay's CPU per event through each MySQL/MariaDB driver: PyMySQL (the
default, pure Python) and mysqlclient (the ``mysqlclient`` extra, C).

One relay with its defaults drains the same backlog once per driver, the
drivers alternating for ``ROUNDS`` rounds so a machine whose load drifts
during the run weighs on both alike; the figure compared is the relay's CPU
seconds per 1,000 events (its own process, from ``/proc``), and the ratio of
the medians is the verdict (mysqlclient / PyMySQL: below 1, the C driver costs
less). Only the ratio means something across hosts.
"""

from __future__ import annotations

import importlib.util
import statistics

import sqlalchemy as sa

from bench.context import BenchContext
from bench.report import ScenarioResult
from bench.scenarios import Results, Unavailable
from bench.scenarios.common import template
from bench.scenarios.relay_runs import drain_backlog, require_relay

TITLE = "one relay's CPU per event through PyMySQL and through mysqlclient"

#: Drains per driver, alternating.
ROUNDS = 2

#: SQLAlchemy driver names, in the order each round runs them.
DRIVERS = ("pymysql", "mysqldb")


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    if ctx.postgresql:
        raise Unavailable("MySQL/MariaDB drivers only (this run is on PostgreSQL)")
    if importlib.util.find_spec("MySQLdb") is None:
        raise Unavailable("mysqlclient is not installed (pip install '.[mysqlclient]')")
    cfg = ctx.config
    res = ScenarioResult("relay-drivers", TITLE)
    res.settings = {"rows": cfg.rows, "rounds": ROUNDS, "drivers": list(DRIVERS)}
    source = template(ctx, cfg.rows)
    per_1k: dict[str, list[float]] = {d: [] for d in DRIVERS}
    rates: dict[str, list[float]] = {d: [] for d in DRIVERS}
    for round_ in range(ROUNDS):
        for driver in DRIVERS:
            url = sa.make_url(ctx.db_url)
            url = url.set(drivername=f"{url.get_backend_name()}+{driver}")
            out = drain_backlog(
                ctx,
                source=source,
                rows=cfg.rows,
                relays=1,
                label=f"driver-{driver}-{round_}",
                db_url=url.render_as_string(hide_password=False),
            )
            res.notes.extend(out.notes)
            rates[driver].append(out.rate)
            if out.relay_cpu_per_1k is not None:
                per_1k[driver].append(out.relay_cpu_per_1k)
            res.rows.append(
                {
                    "driver": driver,
                    "round": round_ + 1,
                    "events/s": out.rate,
                    "relay cpu s/1k events": out.relay_cpu_per_1k,
                    "relay cpu µs/event": (
                        None if out.relay_cpu_per_1k is None else out.relay_cpu_per_1k * 1000
                    ),
                    "db cpu s/100k events": out.db_cpu_per_100k,
                }
            )
    for driver in DRIVERS:
        res.figures[f"rate_{driver}"] = statistics.median(rates[driver])
        if per_1k[driver]:
            res.figures[f"relay_cpu_per_1k_{driver}"] = statistics.median(per_1k[driver])
    pymysql, mysqldb = (res.figures.get(f"relay_cpu_per_1k_{d}") for d in DRIVERS)
    if pymysql and mysqldb:
        res.figures["mysqldb_vs_pymysql_cpu"] = mysqldb / pymysql
        res.notes.append(
            f"relay CPU per event, mysqlclient / PyMySQL (medians of {ROUNDS} drains each): "
            f"{mysqldb / pymysql:.2f}"
        )
    return res
