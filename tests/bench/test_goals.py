"""The goals' verdicts and bounds from a run's figures (no service needed)."""

from __future__ import annotations

import pytest

from bench.goals import (
    BASELINE_030_CONSUMER_POLL_RATIO,
    BASELINE_030_RELAY_CLAIM_RATIO,
    evaluate,
)
from bench.report import ScenarioResult, headline_row

pytestmark = pytest.mark.unit


def _results(latency: dict[str, float], rate_1: float = 4_500.0) -> dict[str, ScenarioResult]:
    throughput = ScenarioResult("relay-throughput", "t")
    throughput.figures["rate_1"] = rate_1
    lat = ScenarioResult("latency", "l")
    lat.figures.update(latency)
    return {"relay-throughput": throughput, "latency": lat}


def _goal(results: dict[str, ScenarioResult], name: str) -> dict[str, object]:
    (goal,) = [g for g in evaluate(results) if g["goal"] == name]
    return goal


P99_1K = "commit->ack p99 at 1,000/s with wake-ups (ms)"
P99_5K = "commit->ack p99 at 5,000/s with wake-ups (ms)"
KEPT_UP = "relay keeps up at 5,000/s: delivered vs written"


def test_the_latency_goals_judge_the_relays_default_and_are_bounded_by_twice_its_cycle() -> None:
    # PostgreSQL: the pipelined run is the default, the unpipelined one a figure.
    results = _results(
        {
            "p99_ms_1000_wakeups": 57.0,
            "cycle_ms_1000_wakeups": 11.7,
            "p99_ms_1000_wakeups_pipeline": 40.8,
            "cycle_ms_1000_wakeups_pipeline": 8.9,
            "p99_ms_1000_wakeups_default": 40.8,
            "cycle_ms_1000_wakeups_default": 8.9,
            "p99_ms_5000_wakeups_default": 96.8,
            "cycle_ms_5000_wakeups_default": 17.3,
            "kept_up_5000_wakeups_default": 1.0,
        },
        rate_1=11_859.0,
    )
    one_k = _goal(results, P99_1K)
    assert (one_k["measured"], one_k["met"], one_k["bound in this run"]) == (40.8, False, 17.8)
    five_k = _goal(results, P99_5K)
    assert (five_k["measured"], five_k["met"], five_k["bound in this run"]) == (96.8, True, 34.6)
    kept = _goal(results, KEPT_UP)
    assert (kept["measured"], kept["met"], kept["bound in this run"]) == (1.0, True, 1.0)
    row = headline_row({"scenarios": {k: v.as_dict() for k, v in results.items()}})
    assert row is not None and (row["p99 ms at 1k/s"], row["p99 ms at 5k/s"]) == (40.8, 96.8)


def test_a_run_saved_before_the_default_figures_is_judged_on_its_unpipelined_run() -> None:
    results = _results(
        {"p99_ms_1000_wakeups": 76.0, "cycle_ms_1000_wakeups": 19.2, "kept_up_5000_wakeups": 0.82}
    )
    one_k = _goal(results, P99_1K)
    assert (one_k["measured"], one_k["bound in this run"]) == (76.0, 38.4)
    kept = _goal(results, KEPT_UP)
    # The relay drains 4,500/s on a backlog: it cannot keep up with 5,000/s.
    assert (kept["measured"], kept["met"], kept["bound in this run"]) == (0.82, False, 0.9)
    assert _goal(results, P99_5K)["measured"] is None, "not measured is never met"
    assert _goal(results, P99_5K)["met"] is None


RELAY_START = "relay spawn -> first claim vs import sqlalchemy (CPU)"
CONSUMER_START = "consumer spawn -> first poll vs import sqlalchemy (CPU)"


def test_the_start_to_work_goals_judge_the_ratios_against_the_recorded_baseline() -> None:
    startup = ScenarioResult("startup", "s")
    startup.figures.update(
        {
            "relay_claim_ratio": BASELINE_030_RELAY_CLAIM_RATIO,
            "consumer_poll_ratio": BASELINE_030_CONSUMER_POLL_RATIO + 0.01,
        }
    )
    relay = _goal({"startup": startup}, RELAY_START)
    assert (relay["measured"], relay["met"]) == (BASELINE_030_RELAY_CLAIM_RATIO, True)
    consumer = _goal({"startup": startup}, CONSUMER_START)
    assert consumer["met"] is False
    # A run without services (PostgreSQL, or the import table only) has no verdict.
    assert _goal({}, RELAY_START)["met"] is None
