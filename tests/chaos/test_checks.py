"""The chaos checks fail on the evidence they exist for (pure data, no services)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from chaos.checks import (
    KafkaCopy,
    Observed,
    Row,
    drains_clean,
    duplicates_accounted,
    key_order,
    nothing_lost,
    nothing_stuck,
    run_checks,
)
from chaos.config import RunConfig, Timings
from chaos.faults import FaultRecord
from chaos.schedule import Fault

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0


class FakeProc:
    def __init__(self, node_id: str, records: list[dict[str, Any]], **kw: Any) -> None:
        self.node_id = node_id
        self.records = records
        self.fate = kw.get("fate")
        self.exit_code = kw.get("exit_code")
        self.stopped_at = kw.get("stopped_at", T0)

    def read_records(self) -> list[dict[str, Any]]:
        return self.records

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == name]


def cfg() -> RunConfig:
    return RunConfig(
        name="t",
        seed=1,
        events=3,
        keys=1,
        relays=1,
        consumers=1,
        duration_s=10,
        faults={},
        timings=Timings(),
    )


def rows(n: int = 3, shard: int = 5) -> list[Row]:
    return [Row(i, f"e{i}", "k0", shard, "delivered", 1, T0, T0 + 1) for i in range(1, n + 1)]


def observed(copies: list[KafkaCopy], **kw: Any) -> Observed:
    values: dict[str, Any] = {
        "rows": rows(),
        "copies": copies,
        "effects": Counter({"e1": 1, "e2": 1, "e3": 1}),
        "relays": [],
        "consumers": [],
        "faults": [],
        "lease_ends": [],
        "recovery_ahead": set(),
        "unexpected_exits": [],
        "dlq_messages": 0,
        "processed_at_commit": set(),
    }
    values.update(kw)
    return Observed(**values)


def copy(offset: int, event: int, ts: float = T0) -> KafkaCopy:
    return KafkaCopy(0, offset, "k0", f"e{event}", ts)


def test_a_reorder_fails_unless_the_relay_reported_it() -> None:
    swapped = [copy(0, 1), copy(1, 3), copy(2, 2)]
    assert key_order(observed(copies=[copy(0, 1), copy(1, 2), copy(2, 3)])).ok
    assert not key_order(observed(swapped)).ok
    reported = key_order(observed(swapped, recovery_ahead={3}))
    assert reported.ok and reported.figures["reported_reorders"] == 1


def test_lost_events_and_double_effects_fail() -> None:
    assert nothing_lost(observed([copy(0, 1), copy(1, 2), copy(2, 3)])).ok
    assert not nothing_lost(observed([copy(0, 1), copy(1, 2)])).ok
    twice = Counter({"e1": 2, "e2": 1, "e3": 1})
    assert not nothing_lost(observed([copy(0, 1), copy(1, 2), copy(2, 3)], effects=twice)).ok


def test_a_duplicate_needs_a_fault_in_reach_on_a_relay_that_owned_the_shard() -> None:
    dup = [copy(0, 1), copy(1, 2), copy(2, 2, T0 + 1), copy(3, 3)]
    assert not duplicates_accounted(cfg(), observed(dup)).ok
    owner = FakeProc(
        "relay-0-g0",
        [
            {
                "event": "shard-acquired",
                "node_id": "relay-0-g0",
                "shard": 5,
                "redis_epoch_ms": 1e12,
            },
        ],
    )
    kill = FaultRecord(
        Fault(0, 0, "relay-kill", "relay-0", 1), T0 + 2, T0 + 3, {"node_id": "relay-0-g0"}
    )
    ok = duplicates_accounted(cfg(), observed(dup, relays=[owner], faults=[kill]))
    assert ok.ok and ok.figures["by_cause"] == {"relay-kill": 1}
    other = FaultRecord(
        Fault(0, 0, "relay-kill", "relay-1", 1), T0 + 2, T0 + 3, {"node_id": "relay-1-g0"}
    )
    assert not duplicates_accounted(cfg(), observed(dup, relays=[owner], faults=[other])).ok
    late = FaultRecord(Fault(0, 0, "kafka-kill", "kafka", 1), T0 + 60, T0 + 61, {})
    assert not duplicates_accounted(cfg(), observed(dup, faults=[late])).ok


def test_a_row_the_relay_released_in_flight_explains_one_extra_copy_per_release() -> None:
    """Measured on a freshly started three-node cluster, no fault injected yet: a
    batch's request went unanswered past the batch deadline, its rows were
    released (``released-in-flight``) and sent again, and the first copy was
    written too. The relay named the rows; one copy more than it reported is not
    explained."""
    two = [copy(0, 1), copy(1, 2), copy(2, 2, T0 + 1), copy(3, 3)]
    said = FakeProc("relay-0-g0", [{"event": "released-in-flight", "rows": 1, "row_ids": [2]}])
    check = duplicates_accounted(cfg(), observed(two, relays=[said]))
    assert check.ok and check.figures["by_cause"] == {"released-in-flight": 1}
    three = [*two, copy(4, 2, T0 + 2)]
    check = duplicates_accounted(cfg(), observed(three, relays=[said]))
    assert not check.ok
    assert check.figures["by_cause"] == {"released-in-flight": 1, "unexplained": 1}
    other_row = FakeProc("relay-0-g0", [{"event": "released-in-flight", "rows": 1, "row_ids": [3]}])
    assert not duplicates_accounted(cfg(), observed(two, relays=[other_row])).ok
    # With a fault in reach the fault is the cause counted; the report only says how.
    freeze = FaultRecord(Fault(0, 0, "kafka-freeze", "kafka", 1), T0 + 2, T0 + 3, {})
    check = duplicates_accounted(cfg(), observed(two, relays=[said], faults=[freeze]))
    assert check.ok and check.figures["by_cause"] == {"kafka-freeze": 1}
    # A send the broker never answered (timed out in flight), sent again.
    timed_out = FakeProc("relay-0-g0", [{"event": "possibly-written", "rows": 1, "row_ids": [2]}])
    check = duplicates_accounted(cfg(), observed(three, relays=[said, timed_out]))
    assert check.ok
    assert check.figures["by_cause"] == {"released-in-flight": 1, "possibly-written": 1}


def test_a_consumer_drain_must_not_stop_its_commit_at_a_message_it_processed() -> None:
    def drained(committed: int) -> Any:
        exit_ = {"event": "consumer-exit", "result": "clean", "committed": {"t/0": committed}}
        proc = FakeProc("consumer-0-g0", [exit_], fate="term", exit_code=0)
        return drains_clean(
            observed([], consumers=[proc], processed_at_commit={("consumer-0-g0", 0, 41)})
        )

    assert drained(42).ok  # stopped at a message it had not processed
    assert not drained(41).ok  # stopped at one it had


def test_a_stalled_relays_batch_first_sent_by_the_next_owner_is_the_stalls() -> None:
    """The stalled relay owned the shard when the stall began; its lease expired,
    the next owner sent the batch first and the woken relay sent it again."""
    dup = [copy(0, 1), copy(1, 2, T0 + 11), copy(2, 2, T0 + 13), copy(3, 3)]
    stalled = FakeProc(
        "relay-1-g0",
        [
            {
                "event": "shard-acquired",
                "node_id": "relay-1-g0",
                "shard": 5,
                "redis_epoch_ms": 1e12,
            },
        ],
    )
    lease_end = {
        "event": "shard-lost",
        "node_id": "relay-1-g0",
        "shard": 5,
        "redis_epoch_ms": (T0 + 9) * 1000,
        "reason": "expired-frozen",
    }
    stall = FaultRecord(
        Fault(0, 0, "relay-stall", "relay-1", 11), T0 + 1, T0 + 12, {"node_id": "relay-1-g0"}
    )
    check = duplicates_accounted(
        cfg(), observed(dup, relays=[stalled], faults=[stall], lease_ends=[lease_end])
    )
    assert check.ok and check.figures["by_cause"] == {"relay-stall": 1}


def shortage(**detail: Any) -> FaultRecord:
    values: dict[str, Any] = {
        "partition": 5,
        "isr_during": [3],
        "isr_at_end": [3],
        "below_min_s": 58.2,
        "attempts_budget_s": 30.0,
    }
    values.update(detail)
    return FaultRecord(Fault(0, 0, "kafka-isr-shortage", "kafka", 58.2), T0 + 1, T0 + 70, values)


@pytest.mark.parametrize(
    ("detail", "error", "ok"),
    [
        ({}, None, True),
        ({"below_min_s": 29.0}, None, False),  # not longer than max_attempts timeouts
        ({"isr_at_end": [3, 1]}, None, False),  # the ISR was full again before the end
        ({"isr_during": None, "below_min_s": None}, "TimeoutError: ISR of 1", False),
    ],
)
def test_an_isr_shortage_must_really_outlast_max_attempts_timeouts(
    detail: dict[str, Any], error: str | None, ok: bool
) -> None:
    """The run fails when its ISR shortage did not hold the partition below the
    minimum for longer than ``max_attempts`` message timeouts: "no row failed"
    would then say nothing about the refund."""
    rec = shortage(**{k: v for k, v in detail.items() if v is not None})
    for k, v in detail.items():
        if v is None:
            rec.detail.pop(k)
    rec.error = error
    checks = {c.name: c for c in run_checks(cfg(), observed([], faults=[rec]))}
    held = checks["ISR shortages outlasted max_attempts timeouts"]
    assert held.ok is ok, held.evidence
    assert held.figures["shortages"] == 1


def test_runs_without_an_isr_shortage_have_no_such_check() -> None:
    names = [c.name for c in run_checks(cfg(), observed([copy(0, 1), copy(1, 2), copy(2, 3)]))]
    assert "ISR shortages outlasted max_attempts timeouts" not in names


def test_a_row_failed_by_the_outage_fails_the_run() -> None:
    """What the ISR shortage shows when the cluster's refusals use attempts: rows
    ``failed`` at the end (and their key's later rows stuck behind them)."""
    assert nothing_stuck(observed([])).ok
    burnt = rows()
    burnt[0].status, burnt[0].attempts = "failed", 10
    burnt[1].status = "pending"
    check = nothing_stuck(observed([], rows=burnt))
    assert not check.ok
    assert check.figures["failed"] == 1 and check.figures["stuck"] == 2
