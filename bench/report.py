"""Results: one table per scenario, one JSON file per run, the docs section.

A scenario returns a :class:`ScenarioResult`: ``rows`` (what the table shows),
``figures`` (flat named numbers the goals and later runs compare), ``settings``
and ``notes``.  The run's JSON holds every scenario, the goal verdicts, the
machine and the versions, and is rewritten after each scenario so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]


@dataclass
class ScenarioResult:
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    #: Further tables, by title, when one scenario measures two different things.
    tables: dict[str, list[Row]] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if 0 < abs(value) < 0.01:  # e.g. CPU seconds per 1,000 messages of a raw loop
            return f"{value:.2g}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def columns(rows: Sequence[Row]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        for key in row:
            if key not in cols:
                cols.append(key)
    return cols


def text_table(rows: Sequence[Row]) -> str:
    cols = columns(rows)
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for line in cells:
        lines.append(
            "  ".join(
                v.rjust(w) if i else v.ljust(w)
                for i, (v, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row]) -> str:
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def print_scenario(result: ScenarioResult) -> None:
    print(f"\n== {result.name}: {result.title}  ({result.seconds:.1f}s)")
    if result.skipped:
        print(f"   skipped: {result.skipped}")
        return
    if result.error:
        print(f"   FAILED: {result.error}")
    if result.rows:
        print(text_table(result.rows))
    for title, rows in result.tables.items():
        print(f"\n   {title}")
        print(text_table(rows))
    for note in result.notes:
        print(f"   note: {note}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


DOCS_START = "<!-- bench:results:start -->"
DOCS_END = "<!-- bench:results:end -->"
#: A PostgreSQL run's tables go between these markers (MySQL/MariaDB runs: the ones above).
PG_DOCS_START = "<!-- bench:results:postgresql:start -->"
PG_DOCS_END = "<!-- bench:results:postgresql:end -->"


def _markers(report: dict[str, Any]) -> tuple[str, str]:
    if report["versions"].get("database_kind") == "postgresql":
        return PG_DOCS_START, PG_DOCS_END
    return DOCS_START, DOCS_END


#: Under the goals table when a goal has a bound (bench/goals.py).
BOUND_NOTE = (
    "_bound in this run_: the most this run's own figures allow for the measure, "
    "from a loop doing the same database work without the part measured: the "
    "floor (db-ceiling, three set-based statements per batch, no relay code) for "
    "the relay's events/s, database CPU and log bytes; the relay's own claim + "
    "finalize without Kafka (db-ceiling, one after the other or overlapped as the "
    "pipelined relay runs them, the faster) for its ratio to the floor. For the "
    "p99 goals, twice the relay's mean time between two claims at that rate (1 / "
    "its batches per second, from its metrics, with its default pipeline setting): "
    "an event committed just after a claim waits for the next one and then for its "
    "own batch's acknowledgement. For "
    "keeping up at 5,000/s, the relay's own rate on the backlog over 5,000."
)


#: Under the headline row (:func:`headline_row`).
HEADLINE_NOTE = (
    "_events/s_: one relay with its defaults draining the 200k backlog "
    "(relay-throughput); _x floor_: against the floor of today's table in the same "
    "run (db-ceiling); _db cpu_ and _log MB_: the database server's CPU "
    "seconds and replication-log megabytes (binary log or WAL) per 100,000 events "
    "of that drain, beside what the writer's own inserts logged; _p99_: "
    "commit->ack with wake-ups at a steady 1,000 and 5,000 events/s, the relay's "
    "default pipeline setting (on with PostgreSQL, off with MySQL/MariaDB) (latency)."
)


def default_latency(figures: dict[str, float], name: str) -> float | None:
    """A latency figure (``name`` such as ``p99_ms_1000``) of the relay with
    wake-ups and its default pipeline setting; a run saved before that figure
    existed has only the unpipelined one, MySQL/MariaDB's default."""
    found = figures.get(f"{name}_wakeups_default", figures.get(f"{name}_wakeups"))
    return None if found is None else float(found)


def headline_row(report: dict[str, Any]) -> Row | None:
    """The figures docs/performance.md opens with, from one run; None when the run
    measured none of them."""
    figures = {
        name: result.get("figures", {}) for name, result in report.get("scenarios", {}).items()
    }

    def fig(scenario: str, name: str) -> float | None:
        value = figures.get(scenario, {}).get(name)
        return None if value is None else float(value)

    def latency(name: str) -> float | None:
        return default_latency(figures.get("latency", {}), name)

    def per_100k(value: float | None) -> float | None:
        return None if value is None else value * 100_000

    rate, floor = fig("relay-throughput", "rate_1"), fig("db-ceiling", "rate_floor")
    row: Row = {
        "database": _database_label(report.get("versions", {})),
        "events/s": rate,
        "x floor": rate / floor if rate and floor else None,
        "db cpu s/100k": fig("relay-throughput", "db_cpu_per_100k_1"),
        "relay log MB/100k": _mb(per_100k(fig("relay-throughput", "log_bytes_per_event_1"))),
        "writer log MB/100k": _mb(per_100k(fig("relay-throughput", "writer_log_bytes_per_event"))),
        "p99 ms at 1k/s": latency("p99_ms_1000"),
        "p99 ms at 5k/s": latency("p99_ms_5000"),
    }
    measured = [v for k, v in row.items() if k != "database" and v is not None]
    return row if measured else None


def _mb(value: float | None) -> float | None:
    return None if value is None else value / 1_000_000


def _database_label(versions: dict[str, Any]) -> str:
    """The database and how it logs row changes (``versions.database_log``)."""
    if versions.get("database_kind") == "postgresql":
        kind = "PostgreSQL"
    else:
        kind = "MariaDB" if "mariadb" in str(versions.get("database", "")).lower() else "MySQL"
    log = versions.get("database_log") or {}
    if log.get("log") == "binlog":
        how = f"binary log {log.get('binlog_format')}, {log.get('binlog_row_image')} images"
    elif log.get("log") == "wal":
        how = f"wal_level {log.get('wal_level')}, full_page_writes {log.get('full_page_writes')}"
    else:
        how = "binary log off"
    return f"{kind} ({how})"


def markdown_report(report: dict[str, Any]) -> str:
    """The generated part of docs/performance.md: goals, then one table per scenario."""
    out = [
        f"Run `{report['run_id']}` ({report['started_at']}, {report['duration_s']:.0f} s, "
        f"commit `{report['versions'].get('outboxkit_commit')}`, "
        f"{'smoke sizes' if report.get('smoke') else 'full sizes'}).",
        "",
    ]
    headline = headline_row(report)
    if headline:
        out += [
            "**Headline: one relay on this database**",
            "",
            markdown_table([headline]),
            "",
            HEADLINE_NOTE,
            "",
        ]
    goals = report.get("goals") or []
    if goals:
        out += ["**Goals**", "", markdown_table(goals), ""]
        if any(g.get("bound in this run") is not None for g in goals):
            out += [BOUND_NOTE, ""]
    for result in report["scenarios"].values():
        out.append(f"**{result['name']}: {result['title']}**")
        out.append("")
        if result.get("skipped"):
            out += [f"Skipped: {result['skipped']}", ""]
            continue
        if result.get("error"):
            out += [f"Failed: `{result['error']}`", ""]
        if result["rows"]:
            out += [markdown_table(result["rows"]), ""]
        for title, rows in result.get("tables", {}).items():
            out += [f"_{title}_", "", markdown_table(rows), ""]
        for note in result.get("notes", []):
            out.append(f"- {note}")
        if result.get("notes"):
            out.append("")
    v = report["versions"]
    m = report["machine"]
    out.append(
        f"Machine: {m['cpu_count']} CPUs ({m.get('processor')}), {m.get('memory_gib')} GiB, "
        f"load average at start {m.get('loadavg_at_start')}{_handoff(m)}; services co-located. "
        f"Python {v['python']}, confluent-kafka {v['confluent_kafka']} "
        f"(librdkafka {v['librdkafka']}), {v['database']}, Kafka {v['kafka']}, "
        f"SQLAlchemy {v['sqlalchemy']}, {_driver(v)}."
    )
    return "\n".join(out) + "\n"


def _handoff(m: dict[str, Any]) -> str:
    """The thread hand-off figures of ``context.thread_handoff`` (older results have none)."""
    if m.get("thread_handoff_us") is None:
        return ""
    one = m.get("thread_handoff_one_core_us")
    pinned = f" ({one} µs on one core)" if one is not None else ""
    return f", thread hand-off round trip {m['thread_handoff_us']} µs{pinned}"


def _driver(versions: dict[str, Any]) -> str:
    if versions.get("database_kind") == "postgresql":
        return f"psycopg {versions.get('psycopg')}"
    return f"PyMySQL {versions['pymysql']}"


def write_docs(path: Path, report: dict[str, Any]) -> None:
    """Replace the generated section of ``path`` (between the markers of the run's
    database) with this run."""
    start, end = _markers(report)
    text = path.read_text() if path.exists() else f"# Performance\n\n{start}\n{end}\n"
    if start not in text or end not in text:
        text += f"\n{start}\n{end}\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    body = f"{start}\n{markdown_report(report)}{end}"
    path.write_text(pattern.sub(lambda _m: body, text, count=1))
