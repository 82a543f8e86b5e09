"""The goals of the benchmark issue, judged from figures of one run.

Each goal is a ratio or a bound; a goal whose figures were not measured in this
run is reported as not measured, never as met.

Some goals also have a *bound*: the most this run's own figures allow for that
measure. For the relay's rate, its database cost and its log bytes, it is taken
from a loop that does the same database work without the component under test
(no Kafka, no consumer). For the latency goals, from the relay's own cycle at
that rate (the mean time between two claims, 1 / its batches per second, read
from its metrics): an event committed just after a claim waits for the next
claim and then for its batch's acknowledgement, so the p99 is about twice that
time. (With the pipeline a batch lives longer than the time between two claims,
so the bound is lower than the cycle allows, never higher.) For keeping up, from
the relay's own rate on a backlog. A goal beyond its bound cannot be met on this
host by the component as it is; the bound is shown beside the verdict, which it
never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.report import ScenarioResult, default_latency

Results = dict[str, ScenarioResult]


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    #: The measured value from the results (None if not measured), and whether it meets the goal.
    measure: Callable[[Results], float | None]
    met: Callable[[float], bool]
    #: The most this run allows for the measure (see the module docstring), or None.
    bound: Callable[[Results], float | None] | None = None


def _fig(results: Results, scenario: str, name: str) -> float | None:
    r = results.get(scenario)
    if r is None:
        return None
    v = r.figures.get(name)
    return float(v) if v is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _largest(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _latency(results: Results, figure: str, rate: int) -> float | None:
    """See :func:`bench.report.default_latency`."""
    r = results.get("latency")
    return None if r is None else default_latency(r.figures, f"{figure}_{rate}")


def _twice(value: float | None) -> float | None:
    return None if value is None else 2 * value


def _at_most_one(value: float | None) -> float | None:
    return None if value is None else min(1.0, value)


#: Round three's goals (issue "Performance, round three"), for the database as
#: production runs it (bench/run.sh's default; docs/performance.md). Two goals of
#: the round before are retired, their figures still in the scenario tables: the
#: pipelined relay at 1.5 x the unpipelined one (bounded on this 2-core host by
#: the claim beside the finalize, ``db-ceiling``'s overlapped row) and the
#: one-message inbox at 5,000/s (bounded by the inbox's own INSERT + COMMIT
#: through the driver, ``inbox_driver_rate``).
GOALS = [
    Goal(
        "one relay, 200k backlog (events/s)",
        ">= 12,000",
        lambda r: _fig(r, "relay-throughput", "rate_1"),
        lambda v: v >= 12_000,
        # No relay code at all: the least any per-row-state relay asks of the table.
        lambda r: _fig(r, "db-ceiling", "rate_floor"),
    ),
    Goal(
        "one relay vs the floor of its table",
        ">= 0.9",
        lambda r: _ratio(
            _fig(r, "relay-throughput", "rate_1"), _fig(r, "db-ceiling", "rate_floor")
        ),
        lambda v: v >= 0.9,
        # The relay's own claim and finalize with no Kafka, one after the other or
        # overlapped as the pipelined relay runs them (its default on PostgreSQL),
        # whichever is faster, against the floor.
        lambda r: _ratio(
            _largest(_fig(r, "db-ceiling", "rate"), _fig(r, "db-ceiling", "rate_overlapped")),
            _fig(r, "db-ceiling", "rate_floor"),
        ),
    ),
    Goal(
        "database CPU per 100k events, one relay (s)",
        "<= 5",
        lambda r: _fig(r, "relay-throughput", "db_cpu_per_100k_1"),
        lambda v: v <= 5,
        lambda r: _fig(r, "db-ceiling", "floor_db_cpu_per_100k"),
    ),
    Goal(
        "relay's log bytes per event vs the writer's",
        "<= 1.0",
        lambda r: _ratio(
            _fig(r, "relay-throughput", "log_bytes_per_event_1"),
            _fig(r, "relay-throughput", "writer_log_bytes_per_event"),
        ),
        lambda v: v <= 1.0,
        lambda r: _ratio(
            _fig(r, "db-ceiling", "floor_log_bytes_per_event"),
            _fig(r, "relay-throughput", "writer_log_bytes_per_event"),
        ),
    ),
    Goal(
        "1M backlog: last 10% vs first 10%",
        ">= 0.9",
        lambda r: _fig(r, "backlog-scaling", "last_vs_first"),
        lambda v: v >= 0.9,
    ),
    Goal(
        "same, with delete-on-deliver",
        ">= 0.9",
        lambda r: _fig(r, "backlog-scaling", "last_vs_first_delete"),
        lambda v: v >= 0.9,
    ),
    Goal(
        "commit->ack p99 at 1,000/s with wake-ups (ms)",
        "<= 20",
        lambda r: _latency(r, "p99_ms", 1000),
        lambda v: v <= 20,
        lambda r: _twice(_latency(r, "cycle_ms", 1000)),
    ),
    Goal(
        "commit->ack p99 at 5,000/s with wake-ups (ms)",
        "<= 100",
        lambda r: _latency(r, "p99_ms", 5000),
        lambda v: v <= 100,
        lambda r: _twice(_latency(r, "cycle_ms", 5000)),
    ),
    Goal(
        "relay keeps up at 5,000/s: delivered vs written",
        ">= 0.99",
        lambda r: _latency(r, "kept_up", 5000),
        lambda v: v >= 0.99,
        # The relay's own rate on a backlog, with no writer beside it.
        lambda r: _at_most_one(_ratio(_fig(r, "relay-throughput", "rate_1"), 5000)),
    ),
    Goal(
        "writer insert rate with relay vs without",
        ">= 0.8",
        lambda r: _fig(r, "latency", "writer_ratio"),
        lambda v: v >= 0.8,
    ),
    Goal(
        "consumer base class vs raw poll loop",
        ">= 0.8",
        # The median of the rounds' ratios (consumer_rounds); a result saved before
        # the rounds existed has only the one pair.
        lambda r: (
            _fig(r, "consumer", "base_vs_raw")
            or _ratio(_fig(r, "consumer", "base_rate"), _fig(r, "consumer", "raw_rate"))
        ),
        lambda v: v >= 0.8,
    ),
    Goal(
        "consumer with the batched inbox (msgs/s)",
        ">= 10,000",
        lambda r: _fig(r, "consumer", "inbox_batch_rate"),
        lambda v: v >= 10_000,
    ),
]


#: A peak RSS may move this much between two runs of the same process without
#: meaning it grows with the backlog (allocator arenas, librdkafka buffers).
RSS_GROWTH_BOUND = 1.1

GOALS += [
    Goal(
        "relay peak RSS draining the backlog (MB)",
        "<= 150",
        lambda r: _largest(
            _fig(r, "backlog-scaling", "rss_mb"), _fig(r, "backlog-scaling", "rss_mb_delete")
        ),
        lambda v: v <= 150,
    ),
    Goal(
        "relay peak RSS, backlog vs 1/4 of it",
        f"<= {RSS_GROWTH_BOUND}",
        lambda r: _fig(r, "backlog-scaling", "rss_growth"),
        lambda v: v <= RSS_GROWTH_BOUND,
    ),
    Goal(
        "consumer+inbox peak RSS, backlog vs 1/4 of it",
        f"<= {RSS_GROWTH_BOUND}",
        lambda r: _fig(r, "consumer", "inbox_rss_growth"),
        lambda v: v <= RSS_GROWTH_BOUND,
    ),
]


#: Issue 63's start-up goals: the CPU beyond a bare interpreter, in units of
#: ``import sqlalchemy``'s, medians of one run (bench/scenarios/startup.py).
GOALS += [
    Goal(
        "import outboxkit vs import sqlalchemy (CPU)",
        "<= 1.25",
        lambda r: _fig(r, "startup", "outboxkit_ratio"),
        lambda v: v <= 1.25,
    ),
    Goal(
        "outboxkit --version vs import sqlalchemy (CPU)",
        "<= 1.5",
        lambda r: _fig(r, "startup", "version_ratio"),
        lambda v: v <= 1.5,
    ),
]


#: 0.3.0's start-to-work CPU beyond a bare interpreter, in units of ``import
#: sqlalchemy``'s (the ratios of bench/scenarios/startup.py). Unlike every other
#: goal these are NOT taken in the same run: recorded once, on 2026-12-07, on the
#: benchmark's host (AMD EPYC, 2 cores, Python 3.11.7, MariaDB 10.11, Kafka KRaft),
#: by ``python -m bench.scenarios.startup 21 --services 5 --python PY`` where PY is
#: a virtual environment with tag v0.3.0 (2c729b8) installed: medians of 5 relays
#: (spawn -> first claim: 620 ms CPU, 0.70 s wall) and 5 consumers (spawn -> first
#: poll: 510 ms CPU, 0.59 s wall) against 21 runs each of ``python -c pass``
#: (24.7 ms) and ``import sqlalchemy`` (275.5 ms). On another host, measure again.
BASELINE_030_RELAY_CLAIM_RATIO = 2.37
BASELINE_030_CONSUMER_POLL_RATIO = 1.94

GOALS += [
    Goal(
        "relay spawn -> first claim vs import sqlalchemy (CPU)",
        f"<= {BASELINE_030_RELAY_CLAIM_RATIO} (0.3.0, recorded)",
        lambda r: _fig(r, "startup", "relay_claim_ratio"),
        lambda v: v <= BASELINE_030_RELAY_CLAIM_RATIO,
    ),
    Goal(
        "consumer spawn -> first poll vs import sqlalchemy (CPU)",
        f"<= {BASELINE_030_CONSUMER_POLL_RATIO} (0.3.0, recorded)",
        lambda r: _fig(r, "startup", "consumer_poll_ratio"),
        lambda v: v <= BASELINE_030_CONSUMER_POLL_RATIO,
    ),
]


def evaluate(results: Results) -> list[dict[str, Any]]:
    out = []
    for goal in GOALS:
        value = goal.measure(results)
        out.append(
            {
                "goal": goal.name,
                "target": goal.target,
                "measured": value,
                "met": None if value is None else goal.met(value),
                "bound in this run": None if goal.bound is None else goal.bound(results),
            }
        )
    return out
