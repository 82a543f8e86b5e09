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
  - ISR below the topic's ``min.insync.replicas``: ``NOT_ENOUGH_REPLICAS``
    (the leader refuses ``acks=all`` writes before appending them). The
    setting is read with ``min_isr`` (a DescribeConfigs request, cached by the
    caller); when it cannot be read (no DescribeConfigs right, no answer), a
    short ISR is shown in the text but not named as the cause: an ISR shorter
    than the replicas yet not below the minimum still takes writes, and a
    timeout there (a leader waiting for a frozen follower) may have written;
  - no broker answered the metadata request and the producer reported every
    broker down: ``_ALL_BROKERS_DOWN``;
  - otherwise (a leader and a full ISR: a hung leader, a network dropping the
    requests): the timeout itself, ``_MSG_TIMED_OUT``, still the cluster's.

* A message timeout on a partition that acknowledged other messages of the
  batch stays an ordinary retriable error: the attempt counts, so
  ``--max-attempts`` still bounds whatever it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from confluent_kafka import KafkaError

from outboxkit.relay.delivery import ErrorKind, Report
from outboxkit.relay.rows import ClaimedRow
from outboxkit.relay.settings import RelaySettings
from outboxkit.runtime.kafkaclient import client_config

__all__ = ["ClusterProbe", "MinIsr", "PartitionState", "TopicProbe", "explain"]

#: The timeouts a cluster can cause without naming itself.
TIMEOUTS = frozenset({KafkaError._MSG_TIMED_OUT, KafkaError._TIMED_OUT})
#: Longest time all probes of one batch may take (a broker that does not
#: answer makes each wait its whole timeout).
PROBE_BUDGET_S = 2.0
#: How long a topic's ``min.insync.replicas`` is remembered (an unreadable one a
#: fifth of it).
MIN_ISR_TTL_S = 300.0
#: Topics whose ``min.insync.replicas`` is remembered (a bound, not a knob).
_MAX_TOPICS = 10_000
#: The admin client's own log lines.
_ADMIN_LOG = logging.getLogger("outboxkit.relay.kafka.admin")


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One partition as the cluster's metadata shows it."""

    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


#: ``probe(topic, timeout_s)``: the topic's partitions, or None when no broker
#: answered in time.
TopicProbe = Callable[[str, float], Mapping[int, PartitionState] | None]
#: ``min_isr(topic, timeout_s)``: the topic's ``min.insync.replicas``, or None
#: when it could not be read.
MinIsr = Callable[[str, float], int | None]


def explain(
    reports: Mapping[int, Report],
    rows: Sequence[ClaimedRow],
    probe: TopicProbe,
    *,
    min_isr: MinIsr | None = None,
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
        minimum = None
        short = states and any(len(p.isr) < len(p.replicas) for p in states.values())
        left = deadline - time.monotonic()
        if short and min_isr is not None and left > 0:
            try:
                minimum = min_isr(topic, min(1.0, left))
            except Exception:  # the cause stays unnamed
                minimum = None
        for report in timed_out:
            out[report.row_id] = _named(report, topic, states, minimum, all_brokers_down)
    return out


def _named(
    report: Report,
    topic: str,
    states: Mapping[int, PartitionState] | None,
    minimum: int | None,
    all_brokers_down: bool,
) -> Report:
    sent = KafkaError(report.code or KafkaError._MSG_TIMED_OUT).name()
    where = f"partition {report.partition} of {topic}" if report.partition is not None else topic
    quiet = f"{where} acknowledged nothing of the batch within message.timeout.ms ({sent})"
    state = states.get(report.partition) if states and report.partition is not None else None
    if state is not None and state.leader < 0:
        code = KafkaError.LEADER_NOT_AVAILABLE
        text = f"{quiet}; it has no leader (replicas {list(state.replicas)})"
    elif state is not None and minimum is not None and len(state.isr) < minimum:
        code = KafkaError.NOT_ENOUGH_REPLICAS
        text = (
            f"{quiet}; its ISR is {list(state.isr)} of replicas {list(state.replicas)}, "
            f"below min.insync.replicas={minimum}: acks=all writes are refused"
        )
    elif states is None and all_brokers_down:
        code = KafkaError._ALL_BROKERS_DOWN
        text = f"{quiet}; every broker was down"
    else:
        code = report.code or KafkaError._MSG_TIMED_OUT
        if state is not None and len(state.isr) < len(state.replicas):
            floor = "unknown" if minimum is None else str(minimum)
            text = (
                f"{quiet}; its leader is broker {state.leader}, its ISR {list(state.isr)} "
                f"of replicas {list(state.replicas)} (min.insync.replicas {floor})"
            )
        elif state is not None:
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


class ClusterProbe:
    """What the cluster itself says about a topic: its partitions (a metadata
    request on the relay's producer) and its ``min.insync.replicas`` (a
    DescribeConfigs request on an admin client built on first use with the
    producer's connection settings). Used only while finalizing a batch that
    had timeouts; never raises."""

    def __init__(self, settings: RelaySettings, producer: Callable[[], Any]) -> None:
        self._settings = settings
        self._producer = producer
        self._admin: Any = None
        self._min_isr: dict[str, tuple[float, int | None]] = {}

    def partitions(self, topic: str, timeout: float) -> dict[int, PartitionState] | None:
        """The topic's partitions now (at most ``timeout`` s); None if no broker
        answered or the topic is not in the answer."""
        try:
            meta = self._producer().list_topics(topic, timeout=timeout).topics.get(topic)
        except Exception:  # a fatal error surfaces on the producer's next poll
            return None
        if meta is None or meta.error is not None:
            return None
        return {
            p.id: PartitionState(p.leader, tuple(p.replicas), tuple(p.isrs))
            for p in meta.partitions.values()
        }

    def min_insync_replicas(self, topic: str, timeout: float) -> int | None:
        """The topic's ``min.insync.replicas``, remembered for
        :data:`MIN_ISR_TTL_S`; None when it cannot be read (no DescribeConfigs
        right, no answer within ``timeout`` s), remembered a fifth of that so
        that a refusal is not asked again every batch."""
        now = time.monotonic()
        cached = self._min_isr.get(topic)
        if cached is not None and cached[0] > now:
            return cached[1]
        value: int | None = None
        try:
            from confluent_kafka.admin import AdminClient
            from confluent_kafka.admin._config import ConfigResource

            if self._admin is None:
                config = client_config(self._settings, logger=_ADMIN_LOG)
                config["log_level"] = 3  # errors only: not the producer properties it ignores
                self._admin = AdminClient(config)
            resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
            futures = self._admin.describe_configs([resource], request_timeout=timeout)
            entries = futures[resource].result(timeout=timeout)
            value = int(entries["min.insync.replicas"].value)
        except Exception:  # unknown: the cause stays unnamed
            value = None
        if len(self._min_isr) >= _MAX_TOPICS:
            self._min_isr.clear()
        ttl = MIN_ISR_TTL_S if value is not None else MIN_ISR_TTL_S / 5
        self._min_isr[topic] = (now + ttl, value)
        return value
