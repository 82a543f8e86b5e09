"""Which timed-out sends were the Kafka cluster's fault, and what its cause was.

A produce the leader refuses for the cluster's sake (``NOT_ENOUGH_REPLICAS``
while the ISR is below ``min.insync.replicas``, ``NOT_LEADER_FOR_PARTITION``
during a leader change) is retried inside librdkafka until
``message.timeout.ms``; the delivery report then says ``_MSG_TIMED_OUT`` and
nothing more. The broker's last answer is not in the report (librdkafka 2.x
names it in some versions and code paths only), the error callback does not
see per-message broker errors, and the statistics count errors without naming
them (all checked against a three-node cluster). What the cluster reports about
the partition itself is robust and costs one metadata request: its leader,
replicas and in-sync replicas, read when the batch's reports are in.

:func:`explain` applies these rules to a batch's reports (pure; the metadata
comes from the ``probe`` it is given):

* A message timeout (``_MSG_TIMED_OUT``, ``_TIMED_OUT``) is the cluster's fault
  when its partition acknowledged **none** of the batch's messages: the
  partition, not the row, accepted nothing for a whole message timeout (a
  whole batch timed out on an unreachable broker is this case on every
  partition). It becomes a ``CLUSTER`` report (retried, attempt refunded) named
  by the partition's state:

  - no leader: ``LEADER_NOT_AVAILABLE``;
  - ISR shorter than its replicas: ``NOT_ENOUGH_REPLICAS``. The relay does not
    read the topic's ``min.insync.replicas`` (that needs a DescribeConfigs
    right the relay otherwise never needs); a partition that accepted nothing
    for a whole message timeout while its ISR is short is one whose leader
    refuses ``acks=all`` writes, and the text shows the ISR and replicas;
  - no broker answered the metadata request and the producer reported every
    broker down: ``_ALL_BROKERS_DOWN``;
  - otherwise (a leader and a full ISR: a hung leader, a network dropping the
    requests): the timeout itself, ``_MSG_TIMED_OUT``, still the cluster's.

* A message timeout on a partition that acknowledged other messages of the
  batch stays an ordinary retriable error: the attempt counts, so
  ``--max-attempts`` still bounds whatever it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from confluent_kafka import KafkaError

from outboxkit.relay.delivery import ErrorKind, Report
from outboxkit.relay.rows import ClaimedRow

__all__ = ["PartitionState", "TopicProbe", "explain"]

#: The timeouts a cluster can cause without naming itself.
TIMEOUTS = frozenset({KafkaError._MSG_TIMED_OUT, KafkaError._TIMED_OUT})
#: Longest time all probes of one batch may take (a broker that does not
#: answer makes each wait its whole timeout).
PROBE_BUDGET_S = 2.0


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One partition as the cluster's metadata shows it."""

    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


#: ``probe(topic, timeout_s)``: the topic's partitions, or None when no broker
#: answered in time.
TopicProbe = Callable[[str, float], Mapping[int, PartitionState] | None]


def explain(
    reports: Mapping[int, Report],
    rows: Sequence[ClaimedRow],
    probe: TopicProbe,
    *,
    all_brokers_down: bool = False,
    budget_s: float = PROBE_BUDGET_S,
) -> dict[int, Report]:
    """``reports`` with the timeouts the cluster caused turned into ``CLUSTER``
    reports naming the cause (see the module); every other report as it is.

    ``all_brokers_down``: the producer reported every broker down during the
    batch (its error callback's ``_ALL_BROKERS_DOWN``)."""
    topic_of = {r.id: r.topic for r in rows}
    acked: set[tuple[str, int | None]] = set()
    acked_topics: set[str] = set()
    for row_id, report in reports.items():
        if report.ok:
            acked.add((topic_of[row_id], report.partition))
            acked_topics.add(topic_of[row_id])
    out = dict(reports)
    cluster_side: dict[str, list[Report]] = {}
    for row_id, report in reports.items():
        if report.kind is not ErrorKind.RETRIABLE or report.code not in TIMEOUTS:
            continue
        topic = topic_of[row_id]
        if report.partition is None:
            quiet = topic not in acked_topics  # no partition chosen: the topic answered nothing
        else:
            quiet = (topic, report.partition) not in acked
        if quiet:
            cluster_side.setdefault(topic, []).append(report)
    if not cluster_side:
        return out
    deadline = time.monotonic() + budget_s
    answered = True
    for topic, timed_out in sorted(cluster_side.items()):
        states: Mapping[int, PartitionState] | None = None
        left = deadline - time.monotonic()
        if answered and left > 0:
            try:
                states = probe(topic, min(1.0, left))
            except Exception:  # a probe never breaks the finalize: the cause stays unnamed
                states = None
            answered = states is not None  # one that did not answer: the rest would not either
        for report in timed_out:
            out[report.row_id] = _named(report, topic, states, all_brokers_down)
    return out


def _named(
    report: Report,
    topic: str,
    states: Mapping[int, PartitionState] | None,
    all_brokers_down: bool,
) -> Report:
    sent = KafkaError(report.code or KafkaError._MSG_TIMED_OUT).name()
    where = f"partition {report.partition} of {topic}" if report.partition is not None else topic
    quiet = f"{where} acknowledged nothing of the batch within message.timeout.ms ({sent})"
    state = states.get(report.partition) if states and report.partition is not None else None
    if state is not None and state.leader < 0:
        code = KafkaError.LEADER_NOT_AVAILABLE
        text = f"{quiet}; it has no leader (replicas {list(state.replicas)})"
    elif state is not None and len(state.isr) < len(state.replicas):
        code = KafkaError.NOT_ENOUGH_REPLICAS
        text = (
            f"{quiet}; its ISR is {list(state.isr)} of replicas {list(state.replicas)} "
            "(acks=all writes are refused while the ISR is below min.insync.replicas)"
        )
    elif states is None and all_brokers_down:
        code = KafkaError._ALL_BROKERS_DOWN
        text = f"{quiet}; every broker was down"
    else:
        code = report.code or KafkaError._MSG_TIMED_OUT
        if state is not None:
            text = (
                f"{quiet}; its leader is broker {state.leader} and its ISR full: "
                "a hung or unreachable leader"
            )
        else:
            text = f"{quiet}; no broker answered a metadata request"
    name = KafkaError(code).name()
    return replace(
        report,
        code=code,
        error=f"{name}: {text}",
        kind=ErrorKind.CLUSTER,
        sent_code=report.code,
    )
