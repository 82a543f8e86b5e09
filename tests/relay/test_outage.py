"""relay/outage.py: which timed-out sends the cluster caused, and their names.

The decision table, without a broker; tests/cluster/test_outages.py walks the
same cases on the real three-node cluster.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from confluent_kafka import KafkaError

from outboxkit.relay.accounting import possibly_written
from outboxkit.relay.delivery import CLUSTER_CODES, ErrorKind, Report, classify
from outboxkit.relay.finalize import Fate, decide
from outboxkit.relay.outage import PartitionState, explain
from outboxkit.relay.rows import ClaimedRow

pytestmark = pytest.mark.unit

TIMEOUT = KafkaError._MSG_TIMED_OUT


def _row(row_id: int, key: bytes, attempts: int = 1, topic: str = "t") -> ClaimedRow:
    return ClaimedRow(
        id=row_id,
        event_id=f"e{row_id}",
        topic=topic,
        key=key,
        payload=b"",
        headers=None,
        shard=0,
        attempts=attempts,
        age_at_claim=0.0,
        reclaimed_from=None,
    )


def _timeout(row_id: int, partition: int | None) -> Report:
    kind = classify(TIMEOUT)
    return Report(
        row_id, TIMEOUT, "_MSG_TIMED_OUT: Local: Message timed out", kind, partition, None, 0
    )


def _ok(row_id: int, partition: int) -> Report:
    return Report(row_id, None, None, None, partition, row_id, 0.0)


def _probe(states: Mapping[int, PartitionState] | None) -> object:
    asked: list[str] = []

    def probe(topic: str, timeout: float) -> Mapping[int, PartitionState] | None:
        asked.append(topic)
        return states

    probe.asked = asked  # type: ignore[attr-defined]
    return probe


def test_cluster_codes_cost_no_attempt_and_a_bare_timeout_is_only_retriable() -> None:
    assert classify(KafkaError.NOT_ENOUGH_REPLICAS) is ErrorKind.CLUSTER
    assert classify(KafkaError.LEADER_NOT_AVAILABLE) is ErrorKind.CLUSTER
    assert classify(KafkaError._TRANSPORT) is ErrorKind.CLUSTER
    assert classify(TIMEOUT) is ErrorKind.RETRIABLE
    assert KafkaError._MSG_TIMED_OUT not in CLUSTER_CODES


def test_a_partition_that_acknowledged_nothing_under_a_short_isr_is_not_enough_replicas() -> None:
    rows = [_row(1, b"a"), _row(2, b"b"), _row(3, b"c")]
    reports = {1: _timeout(1, 0), 2: _timeout(2, 0), 3: _ok(3, 1)}
    states = {
        0: PartitionState(leader=1, replicas=(1, 2), isr=(1,)),
        1: PartitionState(leader=2, replicas=(2, 1), isr=(2,)),
    }
    out = explain(reports, rows, _probe(states), min_isr=lambda t, s: 2)  # type: ignore[arg-type]
    for i in (1, 2):
        assert out[i].kind is ErrorKind.CLUSTER
        assert out[i].code == KafkaError.NOT_ENOUGH_REPLICAS
        assert out[i].sent_code == TIMEOUT
        assert (out[i].error or "").startswith("NOT_ENOUGH_REPLICAS: partition 0 of t")
        assert "ISR is [1] of replicas [1, 2], below min.insync.replicas=2" in (out[i].error or "")
    assert out[3] is reports[3]


def test_causes_named_from_the_partition_state() -> None:
    rows = [_row(1, b"a"), _row(2, b"b"), _row(3, b"c")]
    reports = {1: _timeout(1, 0), 2: _timeout(2, 1), 3: _timeout(3, None)}
    states = {
        0: PartitionState(leader=-1, replicas=(1, 2), isr=(1,)),
        1: PartitionState(leader=2, replicas=(2, 1), isr=(2, 1)),
    }
    out = explain(reports, rows, _probe(states))  # type: ignore[arg-type]
    assert out[1].code == KafkaError.LEADER_NOT_AVAILABLE
    # A leader and a full ISR: a hung or unreachable leader; still the cluster's.
    assert out[2].code == TIMEOUT and out[2].kind is ErrorKind.CLUSTER
    assert "hung or unreachable leader" in (out[2].error or "")
    assert out[3].kind is ErrorKind.CLUSTER
    # No broker answered, and the producer said every broker is down.
    down = explain(reports, rows, _probe(None), all_brokers_down=True)  # type: ignore[arg-type]
    assert {r.code for r in down.values()} == {KafkaError._ALL_BROKERS_DOWN}


@pytest.mark.parametrize("minimum", [None, 1, 2])
def test_a_short_isr_is_named_only_when_below_the_topics_minimum(minimum: int | None) -> None:
    """ISR 2 of 3 with min.insync.replicas=2 takes writes: a timeout there is a
    leader waiting for a frozen follower, and may have written. An unreadable
    minimum names no cause either."""
    rows = [_row(1, b"a")]
    states = {0: PartitionState(leader=1, replicas=(1, 2, 3), isr=(1, 2))}
    out = explain(
        {1: _timeout(1, 0)},
        rows,
        _probe(states),  # type: ignore[arg-type]
        min_isr=lambda topic, timeout: minimum,
    )
    assert out[1].kind is ErrorKind.CLUSTER and out[1].code == TIMEOUT
    assert f"ISR [1, 2] of replicas [1, 2, 3] (min.insync.replicas {minimum or 'unknown'})" in (
        out[1].error or ""
    )
    (d,) = decide(rows, out, max_attempts=1, refund_unknown=True)
    assert d.refund and possibly_written(d)
    one = explain(
        {1: _timeout(1, 0)},
        rows,
        _probe({0: PartitionState(leader=1, replicas=(1, 2, 3), isr=(1,))}),  # type: ignore[arg-type]
        min_isr=lambda topic, timeout: minimum,
    )
    assert one[1].code == (KafkaError.NOT_ENOUGH_REPLICAS if minimum == 2 else TIMEOUT)


def test_a_timeout_beside_acknowledged_messages_of_its_partition_keeps_its_attempt() -> None:
    rows = [_row(1, b"a"), _row(2, b"b")]
    reports = {1: _ok(1, 0), 2: _timeout(2, 0)}
    probe = _probe({0: PartitionState(leader=1, replicas=(1, 2), isr=(1,))})
    out = explain(reports, rows, probe)  # type: ignore[arg-type]
    assert out == reports
    assert probe.asked == []  # type: ignore[attr-defined]
    (_, d2) = decide(rows, out, max_attempts=1, refund_unknown=True)
    assert d2.fate is Fate.FAILED


def test_a_cluster_fault_is_retried_with_the_attempt_refunded_past_max_attempts() -> None:
    rows = [_row(1, b"a", attempts=5), _row(2, b"a", attempts=5)]
    reports = {1: _timeout(1, 0), 2: _ok(2, 0)}
    states = {0: PartitionState(leader=1, replicas=(1, 2), isr=(1,))}
    # Row 2 acknowledged on partition 0 too: row 1's timeout is not explained.
    assert explain(reports, rows, _probe(states)) == reports  # type: ignore[arg-type]
    reports = {1: _timeout(1, 0), 2: _timeout(2, 0)}
    d1, d2 = decide(
        rows,
        explain(reports, rows, _probe(states), min_isr=lambda t, s: 2),  # type: ignore[arg-type]
        max_attempts=2,
        refund_unknown=True,
    )
    for d in (d1, d2):
        assert d.fate is Fate.RETRYABLE and d.refund
        assert d.error_code == KafkaError.NOT_ENOUGH_REPLICAS and d.sent_code == TIMEOUT
        # The leader refused the write before appending it: not possibly written.
        assert not possibly_written(d)


def test_a_hung_leader_timeout_may_have_been_written() -> None:
    rows = [_row(1, b"a")]
    states = {0: PartitionState(leader=3, replicas=(3, 1, 2), isr=(3, 1, 2))}
    out = explain({1: _timeout(1, 0)}, rows, _probe(states))  # type: ignore[arg-type]
    (d,) = decide(rows, out, max_attempts=1, refund_unknown=True)
    assert d.fate is Fate.RETRYABLE and d.refund
    assert possibly_written(d)
