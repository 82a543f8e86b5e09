"""The benchmark at tiny sizes, so it cannot rot: every scenario runs end to end
and writes a JSON report with the fields the docs and later runs rely on.

Figures at these sizes mean nothing and are never compared to a bound here;
speed is shown by the real run (docs/performance.md), not by a timed test.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from bench.config import BenchConfig
from bench.context import Services
from bench.procs import ServiceCpu
from bench.runner import run
from bench.scenarios import names

pytestmark = pytest.mark.integration

#: Modules a scenario measures; it may only be skipped while one is missing.
NEEDS = {
    "db-ceiling": ("outboxkit.relay.claim", "outboxkit.relay.finalize"),
    "relay-throughput": ("outboxkit.relay.relay",),
    "backlog-scaling": ("outboxkit.relay.relay",),
    "latency": ("outboxkit.relay.relay",),
    "drain": ("outboxkit.relay.relay",),
    "relay-drivers": ("outboxkit.relay.relay", "MySQLdb"),
    "consumer": ("outboxkit.consumer",),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def test_smoke_run_writes_a_complete_report(
    db_server_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    services = Services(db_url=db_server_url, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url)
    report = run(BenchConfig.smoke(), services, results_dir=tmp_path, smoke=True, quiet=True)

    saved = json.loads(Path(report["path"]).read_text())
    assert json.loads((tmp_path / "latest.json").read_text())["run_id"] == saved["run_id"]
    assert saved["machine"]["cpu_count"] >= 1
    # How dear a wake-up on another core is: runs on a degraded machine show it.
    assert saved["machine"]["thread_handoff_us"] > 0
    assert saved["machine"]["thread_handoff_one_core_us"] > 0
    for field in ("python", "confluent_kafka", "librdkafka", "database", "kafka"):
        assert saved["versions"][field], field
    assert saved["config"]["rows"] == BenchConfig.smoke().rows

    assert list(saved["scenarios"]) == names()
    for name, result in saved["scenarios"].items():
        assert result["error"] is None, f"{name}: {result['error']}"
        if result["skipped"] is not None:
            # Only while the code it measures does not exist; never to hide a break.
            assert not all(map(_importable, NEEDS.get(name, ()))), result["skipped"]
            continue
        assert result["rows"], name
        assert result["figures"], name
        for figure, value in result["figures"].items():
            assert math.isfinite(value) and value > 0, f"{name}.{figure} = {value}"

    assert {g["goal"] for g in saved["goals"]} >= {"consumer base class vs raw poll loop"}
    for goal in saved["goals"]:
        assert set(goal) == {"goal", "target", "measured", "met", "bound in this run"}
    _assert_goal_bounds(saved)

    _assert_memory_and_cpu(saved)
    _assert_scale_out(saved, services)
    _assert_consumer_rounds(saved)
    # Start to work on MySQL/MariaDB: the relay's first claim, the consumer's first
    # poll, judged against 0.3.0's recorded ratios.
    if sa.make_url(db_server_url).get_backend_name() != "postgresql":
        startup = saved["scenarios"]["startup"]["figures"]
        assert {"relay_claim_ratio", "consumer_poll_ratio"} <= set(startup)
        judged = {g["goal"]: g for g in saved["goals"]}
        assert judged["relay spawn -> first claim vs import sqlalchemy (CPU)"]["measured"]
    # The single-message inbox with several lanes has its row and figure, and the
    # DB ceiling its overlapped loop (the scenario fails if it lost or left a row).
    assert "inbox_rate_lanes" in saved["scenarios"]["consumer"]["figures"]
    assert "rate_overlapped" in saved["scenarios"]["db-ceiling"]["figures"]
    # The floor: the least any relay keeping per-row states asks of this table,
    # with every throughput row measured against it.
    assert saved["scenarios"]["db-ceiling"]["figures"]["rate_floor"] > 0
    assert all(r["x floor"] for r in saved["scenarios"]["relay-throughput"]["rows"])
    # The latency rows read each relay's /metrics on the health port it logged,
    # and say whether the relay kept up with the writer.
    latency = saved["scenarios"]["latency"]
    assert all("batches/s" in row for row in latency["rows"])
    assert all(0 < row["kept up"] <= 1 for row in latency["rows"]), latency["rows"]


#: Goals whose bound this run measures, and the figures each bound is made of.
BOUNDED_GOALS = {
    "one relay, 200k backlog (events/s)": ("db-ceiling", ("rate_floor",)),
    "one relay vs the floor of its table": (
        "db-ceiling",
        ("rate", "rate_overlapped", "rate_floor"),
    ),
    "database CPU per 100k events, one relay (s)": ("db-ceiling", ("floor_db_cpu_per_100k",)),
    "relay keeps up at 5,000/s: delivered vs written": ("relay-throughput", ("rate_1",)),
}
#: Measured only where the server keeps a replication log (not the tests' MariaDB).
LOG_GOAL = "relay's log bytes per event vs the writer's"


def _assert_goal_bounds(saved: dict[str, Any]) -> None:
    """The goals with a bound show it, from this run's figures; the others none;
    and the docs' goals table says what the bound is."""
    from bench.report import BOUND_NOTE, HEADLINE_NOTE, headline_row, markdown_report

    goals = {g["goal"]: g for g in saved["goals"]}
    for name, goal in goals.items():
        bound = goal["bound in this run"]
        if name in BOUNDED_GOALS:
            scenario, figures = BOUNDED_GOALS[name]
            for figure in figures:
                assert figure in saved["scenarios"][scenario]["figures"], (name, figure)
            assert bound is not None and math.isfinite(bound) and bound > 0, (name, bound)
        elif name == LOG_GOAL:
            logged = "floor_log_bytes_per_event" in saved["scenarios"]["db-ceiling"]["figures"]
            assert (bound is not None) == logged, (name, bound)
        else:
            assert bound is None, (name, bound)
    ceiling = saved["scenarios"]["db-ceiling"]["figures"]
    assert goals["one relay, 200k backlog (events/s)"]["bound in this run"] == ceiling["rate_floor"]
    assert (
        goals["one relay vs the floor of its table"]["bound in this run"]
        == max(ceiling["rate"], ceiling["rate_overlapped"]) / ceiling["rate_floor"]
    )
    throughput = saved["scenarios"]["relay-throughput"]["figures"]
    assert goals["one relay vs the floor of its table"]["measured"] == (
        throughput["rate_1"] / ceiling["rate_floor"]
    )
    # The floor row carries the server's cost, as every drain row does.
    floors = [
        r for r in saved["scenarios"]["db-ceiling"]["rows"] if r["finalize"].startswith("floor")
    ]
    assert [r["finalize"].split(":")[0] for r in floors] == [
        "floor, today's table (payload aside)",
        "floor, delivered rows deleted",
        "floor, lease columns written at their claimed size",
        "floor, 0.2.0's table (payload in the row)",
    ]
    assert floors[0]["rows/s"] == ceiling["rate_floor"]
    assert floors[0]["db cpu s/100k events"] == ceiling["floor_db_cpu_per_100k"]
    for shape in ("delete", "presized", "inline"):
        assert ceiling[f"rate_floor_{shape}"] > 0, shape
    # The retired goals' figures stay in the tables: the inbox's driver-alone row.
    consumer = saved["scenarios"]["consumer"]
    rows = [r for r in consumer["rows"] if r["variant"].startswith("driver alone")]
    assert len(rows) == 1 and rows[0]["msgs/s"] == consumer["figures"]["inbox_driver_rate"]
    table = markdown_report(saved)
    assert "bound in this run" in table and BOUND_NOTE in table
    # The headline the docs open with: this run's one-relay figures, by name.
    headline = headline_row(saved)
    assert headline is not None
    assert headline["events/s"] == throughput["rate_1"]
    assert headline["x floor"] == throughput["rate_1"] / ceiling["rate_floor"]
    assert headline["p99 ms at 1k/s"] is None  # the smoke writes at 100/s only
    assert "MariaDB (binary log off)" in table and HEADLINE_NOTE in table


def _assert_consumer_rounds(saved: dict[str, Any]) -> None:
    """The consumer goal is the median of the raw/base rounds, each round listed."""
    consumer = saved["scenarios"]["consumer"]
    f = consumer["figures"]
    assert f["base_vs_raw_min"] <= f["base_vs_raw"] <= f["base_vs_raw_max"], f
    rounds = BenchConfig.smoke().consumer_rounds
    listed = [n for n in consumer["notes"] if n.startswith("base class vs raw poll loop in ")]
    assert len(listed) == 1 and f"in {rounds} rounds" in listed[0], consumer["notes"]
    assert listed[0].count(";") == rounds, listed[0]  # one entry per round, then the median
    goal = {g["goal"]: g for g in saved["goals"]}["consumer base class vs raw poll loop"]
    assert goal["measured"] == f["base_vs_raw"]


#: Figures of peak memory (MB) and CPU per 1,000 events each scenario must report.
MEMORY_AND_CPU = {
    "backlog-scaling": (
        "rss_mb",
        "rss_mb_small",
        "rss_mb_delete",
        "rss_growth",
        "relay_cpu_per_1k",
        "relay_cpu_per_1k_delete",
    ),
    "consumer": (
        "inbox_rss_mb",
        "inbox_rss_mb_small",
        "inbox_rss_growth",
        "raw_cpu_per_1k",
        "base_cpu_per_1k",
        "inbox_cpu_per_1k",
    ),
}
MEMORY_GOALS = {
    "relay peak RSS draining the backlog (MB)",
    "relay peak RSS, backlog vs 1/4 of it",
    "consumer+inbox peak RSS, backlog vs 1/4 of it",
    "database CPU per 100k events, one relay (s)",
}


def _assert_memory_and_cpu(saved: dict[str, Any]) -> None:
    for name, wanted in MEMORY_AND_CPU.items():
        figures = saved["scenarios"][name]["figures"]
        assert set(wanted) <= set(figures), f"{name}: missing {set(wanted) - set(figures)}"
        for figure in wanted:
            if figure.startswith(("rss_mb", "inbox_rss_mb")):
                # A Python process with librdkafka and SQLAlchemy loaded: tens of MB, so
                # a figure in kB or bytes, or of the wrong process, shows here.
                assert 20 < figures[figure] < 2000, f"{name}.{figure} = {figures[figure]}"
    scaling = saved["scenarios"]["backlog-scaling"]
    assert [r["rows"] for r in scaling["rows"]] == [
        BenchConfig.smoke().backlog_rows // BenchConfig.smoke().memory_scale,
        BenchConfig.smoke().backlog_rows,
        BenchConfig.smoke().backlog_rows,
    ]
    goals = {g["goal"]: g for g in saved["goals"]}
    assert set(goals) >= MEMORY_GOALS
    for goal in MEMORY_GOALS:
        assert goals[goal]["measured"] is not None, goal
        assert goals[goal]["met"] in (True, False), goal


def _assert_scale_out(saved: dict[str, Any], services: Services) -> None:
    """One row per relay count with the relays' own defaults, and each relay count
    with the pipeline on and off, each with the relays' and every co-located
    service's CPU."""
    throughput = saved["scenarios"]["relay-throughput"]
    counts = BenchConfig.smoke().relay_counts
    rows = throughput["rows"]
    assert [r["relays"] for r in rows if r["pipeline"] == "default"] == list(counts)
    for n in counts:
        variants = [r["pipeline"] for r in rows if r["relays"] == n and r["pipeline"] != "default"]
        assert sorted(variants) == ["off", "on"], (n, rows)
        assert all(r["duplicates"] == 0 for r in rows if r["relays"] == n), (n, rows)
    engine = sa.create_engine(services.db_url)
    try:
        found = ServiceCpu.find(engine, services.kafka_bootstrap, services.redis_url).pids
    finally:
        engine.dispose()
    columns = {"relay cpu", "machine cpu", "relay cpu s/1k events", "relay peak MB"}
    columns |= {f"{service} cpu" for service in found}
    for row in throughput["rows"]:
        assert columns <= set(row), f"missing {columns - set(row)}"
        assert row["relay cpu"] > 0 and row["machine cpu"] > 0, row
    for n in counts:
        assert throughput["figures"][f"relay_cpu_per_1k_{n}"] > 0


#: The scenarios the PostgreSQL run measures (docs/performance.md shows them beside MariaDB's).
PG_SCENARIOS = ["db-ceiling", "relay-throughput", "backlog-scaling", "latency", "consumer"]


def test_smoke_run_on_postgresql_needs_no_redis(
    pg_server_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The relay scenarios run on PostgreSQL without Redis: several relays share
    shards by advisory locks and the latency run's wake-ups are the writer's NOTIFY."""
    services = Services(db_url=pg_server_url, kafka_bootstrap=kafka_bootstrap, redis_url=None)
    report = run(
        BenchConfig.smoke(),
        services,
        scenarios=PG_SCENARIOS,
        results_dir=tmp_path,
        smoke=True,
        quiet=True,
    )

    saved = json.loads(Path(report["path"]).read_text())
    assert saved["versions"]["database_kind"] == "postgresql"
    assert "PostgreSQL" in saved["versions"]["database"]
    assert saved["versions"]["psycopg"]
    assert list(saved["scenarios"]) == PG_SCENARIOS
    for name, result in saved["scenarios"].items():
        assert result["error"] is None, f"{name}: {result['error']}"
        assert result["skipped"] is None, f"{name}: {result['skipped']}"
        for figure, value in result["figures"].items():
            assert math.isfinite(value) and value > 0, f"{name}.{figure} = {value}"

    latency = saved["scenarios"]["latency"]
    assert {r["wake-ups"] for r in latency["rows"]} == {False, True}
    smoke = BenchConfig.smoke()
    rate = smoke.latency_rates[0]
    assert f"p99_ms_{rate}_wakeups" in latency["figures"]
    # The relay's default on PostgreSQL is the pipeline: that run is the one the
    # goals judge, its mean cycle read from the relay's metrics.
    (default,) = [r for r in latency["rows"] if r["wake-ups"] and r["pipeline"]]
    f = latency["figures"]
    assert f[f"p99_ms_{rate}_wakeups_default"] == default["p99 ms"]
    assert f[f"cycle_ms_{rate}_wakeups_default"] == 1000 / default["batches/s"]
    written = int(smoke.latency_rates[0] * (smoke.latency_warmup_seconds + smoke.latency_seconds))
    for row in latency["rows"]:
        # The warm-up's events are reported apart, none lost or counted twice; the
        # first commit always opens the warm-up.
        assert row["events"] + row["warm-up events"] == written, row
        assert row["warm-up events"] >= 1 and row["warm-up p99 ms"] is not None, row
        assert "batches/s" in row, row  # the relay's /metrics on the port it logged
    throughput = saved["scenarios"]["relay-throughput"]
    default_rows = [r for r in throughput["rows"] if r["pipeline"] == "default"]
    assert [r["relays"] for r in default_rows] == list(BenchConfig.smoke().relay_counts)
    for row in throughput["rows"]:
        # The postmaster and its backends: each connection is a process of its own.
        assert row["postgresql cpu"] > 0, row
    # Drains long enough to count the relays' CPU (a figure is left out when not).
    for n in BenchConfig.smoke().relay_counts:
        assert f"relay_cpu_per_1k_{n}" in throughput["figures"], throughput["notes"]
    # The inbox's statements through psycopg alone: the single-message inbox's bound.
    assert "inbox_driver_rate" in saved["scenarios"]["consumer"]["figures"]
    goals = {g["goal"]: g for g in saved["goals"]}
    # The PostgreSQL issue's bounds (the 1,000/s latency one needs the full sizes).
    for goal in ("one relay vs the floor of its table", "1M backlog: last 10% vs first 10%"):
        assert goals[goal]["measured"] is not None, goal


@pytest.mark.unit
def test_docs_keep_each_databases_run_between_its_own_markers(tmp_path: Path) -> None:
    from bench.report import DOCS_END, DOCS_START, PG_DOCS_END, PG_DOCS_START, write_docs

    doc = tmp_path / "performance.md"
    doc.write_text(f"# P\n\nintro\n\n{DOCS_START}\nold mariadb\n{DOCS_END}\n\nmiddle\n")

    def report(kind: str, run_id: str) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "started_at": "now",
            "duration_s": 1.0,
            "smoke": True,
            "goals": [],
            "scenarios": {},
            "machine": {
                "cpu_count": 2,
                "processor": "x",
                "memory_gib": 1,
                "thread_handoff_us": 87.5,
                "thread_handoff_one_core_us": 14.0,
            },
            "versions": {
                "database_kind": kind,
                "outboxkit_commit": "c",
                "python": "3",
                "confluent_kafka": "2",
                "librdkafka": "2",
                "database": kind,
                "kafka": "4",
                "sqlalchemy": "2",
                "pymysql": "1.1",
                "psycopg": "3.2",
            },
        }

    write_docs(doc, report("postgresql", "pg-run-1"))
    write_docs(doc, report("postgresql", "pg-run-2"))
    write_docs(doc, report("mysql", "my-run"))
    text = doc.read_text()
    assert "old mariadb" not in text and "pg-run-1" not in text
    assert text.count(PG_DOCS_START) == 1 and text.count(DOCS_START) == 1
    mariadb = text[text.index(DOCS_START) : text.index(DOCS_END)]
    postgres = text[text.index(PG_DOCS_START) : text.index(PG_DOCS_END)]
    assert "my-run" in mariadb and "PyMySQL 1.1" in mariadb
    assert "pg-run-2" in postgres and "psycopg 3.2" in postgres
    assert "thread hand-off round trip 87.5 µs (14.0 µs on one core)" in mariadb
    assert text.startswith("# P\n\nintro\n") and "middle" in text
