"""End-of-run checks. Each is a hard failure with evidence: the rows, keys,
nodes and times involved, so that a failing seed can be read without a rerun."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from support.ownership import lease_events, ownership_intervals, ownership_overlaps

from chaos.config import RunConfig
from chaos.faults import FaultRecord
from chaos.procs import Proc

#: Fault kinds that can leave a copy in Kafka whose row is sent again.
DUPLICATE_CAUSES = (
    "relay-kill",
    "relay-redeploy",
    "relay-stall",
    "kafka-kill",
    "kafka-freeze",
    "redis-restart",
    "redis-freeze",
    "db-kill-connections",
    "db-restart",
    "net-latency",
    "net-timeout",
    "net-reset",
    "relay-bounded-queue",
    # a node of the cluster gone or frozen: a batch in flight to it may time out
    # (message.timeout.ms) and be sent again once the partition has a leader
    "kafka-leader-kill",
    "kafka-follower-freeze",
    "kafka-controller-kill",
    "kafka-coordinator-kill",
    "kafka-rolling-restart",
    "kafka-isr-shortage",
)
#: Relay faults that also cut every relay from a service: they explain any shard.
FLEET_WIDE = frozenset({"relay-bounded-queue"})
MAX_EVIDENCE = 20


@dataclass(slots=True)
class Row:
    id: int
    event_id: str
    key: str
    shard: int
    status: str
    attempts: int
    created: float
    delivered: float | None


@dataclass(slots=True)
class KafkaCopy:
    partition: int
    offset: int
    key: str
    event_id: str
    ts: float


@dataclass
class Observed:
    rows: list[Row]
    copies: list[KafkaCopy]
    effects: Counter[str]
    relays: list[Proc]
    consumers: list[Proc]
    faults: list[FaultRecord]
    lease_ends: list[dict[str, Any]]
    recovery_ahead: set[int]
    unexpected_exits: list[dict[str, Any]]
    dlq_messages: int
    #: (drained consumer, partition, offset): its exit commit stopped at an offset
    #: whose effect it had written since it was last assigned the partition
    processed_at_commit: set[tuple[str, int, int]]


@dataclass
class Check:
    name: str
    ok: bool
    summary: str
    evidence: list[str] = field(default_factory=list)
    #: wall time of the earliest evidence, to cut the schedule printed with it
    first_at: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)


def writer_done(cfg: RunConfig, exit_code: int | None, done: dict[str, Any] | None) -> Check:
    """The writer committed every event of the run (else the other checks would
    pass on what little it wrote)."""
    written = int(done["written"]) if done else 0
    ok = exit_code == 0 and written == cfg.events
    return Check(
        "writer committed every event",
        ok,
        f"writer exited {exit_code}, committed {written} of {cfg.events}",
        [] if ok else ["see writer.log"],
        figures={"written": written},
    )


def run_checks(cfg: RunConfig, obs: Observed) -> list[Check]:
    checks = [
        nothing_lost(obs),
        key_order(obs),
        duplicates_accounted(cfg, obs),
        nothing_stuck(obs),
        drains_clean(obs),
        one_owner(cfg, obs),
    ]
    if any(f.fault.kind == "kafka-isr-shortage" for f in obs.faults):
        checks.append(isr_shortage_held(obs))
    return checks


def isr_shortage_held(obs: Observed) -> Check:
    """Every ``kafka-isr-shortage`` really held its partition below
    ``min.insync.replicas`` (an ISR of one, still one at the end) for longer than
    ``max_attempts`` message timeouts; else "no row failed" would prove nothing
    about the refund. The rows themselves are judged by the other checks:
    nothing lost, per-key order, nothing stuck (no ``failed`` row)."""
    faults = [f for f in obs.faults if f.fault.kind == "kafka-isr-shortage"]
    evidence = []
    for f in faults:
        d = f.detail
        held = float(d.get("below_min_s", 0.0))
        budget = float(d.get("attempts_budget_s", float("inf")))
        short = len(d.get("isr_during") or [0, 0]) == 1 and len(d.get("isr_at_end") or [0, 0]) == 1
        if f.error or not short or held <= budget:
            evidence.append(
                f"#{f.fault.seq}: below the minimum {held} s (budget {budget} s), ISR "
                f"{d.get('isr_during')} -> {d.get('isr_at_end')}, error {f.error}"
            )
    return Check(
        "ISR shortages outlasted max_attempts timeouts",
        not evidence,
        f"{len(faults)} ISR shortages; held below min.insync.replicas "
        f"{[f.detail.get('below_min_s') for f in faults]} s, budget "
        f"{sorted({f.detail.get('attempts_budget_s') for f in faults}, key=str)} s",
        evidence,
        min((f.started for f in faults if f.error), default=None),
        {"shortages": len(faults), "short": len(faults) - len(evidence)},
    )


def nothing_lost(obs: Observed) -> Check:
    in_kafka = {c.event_id for c in obs.copies}
    missing = [r for r in obs.rows if r.event_id not in in_kafka]
    no_effect = [r for r in obs.rows if obs.effects.get(r.event_id, 0) == 0]
    twice = [r for r in obs.rows if obs.effects.get(r.event_id, 0) > 1]
    strays = set(obs.effects) - {r.event_id for r in obs.rows}
    evidence = [
        f"not in Kafka: row {r.id} {r.event_id} key {r.key} status {r.status}"
        for r in missing[:MAX_EVIDENCE]
    ]
    evidence += [
        f"no effect: row {r.id} {r.event_id} key {r.key}" for r in no_effect[:MAX_EVIDENCE]
    ]
    evidence += [
        f"effect x{obs.effects[r.event_id]}: row {r.id} {r.event_id} key {r.key}"
        for r in twice[:MAX_EVIDENCE]
    ]
    evidence += [f"effect of an event never committed: {e}" for e in sorted(strays)[:MAX_EVIDENCE]]
    if obs.dlq_messages:
        evidence.append(f"{obs.dlq_messages} message(s) in the dead-letter topic")
    bad = missing + no_effect + twice
    ok = not bad and not strays and not obs.dlq_messages
    return Check(
        "nothing lost",
        ok,
        f"{len(obs.rows)} committed; {len(missing)} missing in Kafka; effects: "
        f"{len(no_effect)} missing, {len(twice)} applied twice; dlq {obs.dlq_messages}",
        evidence,
        min((r.created for r in bad), default=None),
        {
            "committed": len(obs.rows),
            "lost_kafka": len(missing),
            "lost_effect": len(no_effect),
            "effect_twice": len(twice),
        },
    )


def key_order(obs: Observed) -> Check:
    """Per key, first copies in Kafka (offset order within the key's partition)
    must come in row id order, except rows the relay reported as acked ahead."""
    id_of = {r.event_id: r.id for r in obs.rows}
    reported = set(obs.recovery_ahead)
    for p in obs.relays:
        reported.update(int(e["row_id"]) for e in p.events("acked-out-of-order"))
    firsts: dict[str, list[tuple[int, KafkaCopy]]] = defaultdict(list)
    seen: set[str] = set()
    for c in sorted(obs.copies, key=lambda c: (c.partition, c.offset)):
        if c.event_id in seen or c.event_id not in id_of:
            continue
        seen.add(c.event_id)
        firsts[c.key].append((id_of[c.event_id], c))
    explained = unexplained = 0
    evidence: list[str] = []
    first_at: float | None = None
    for key, seq in firsts.items():
        high = -1
        ahead: list[int] = []
        for row_id, copy in seq:
            if row_id < high:
                overtakers = [i for i in ahead if i > row_id]
                if all(i in reported for i in overtakers):
                    explained += 1
                else:
                    unexplained += 1
                    first_at = copy.ts if first_at is None else min(first_at, copy.ts)
                    if len(evidence) < MAX_EVIDENCE:
                        evidence.append(
                            f"key {key}: row {row_id} first delivered at p{copy.partition}@"
                            f"{copy.offset} after rows {sorted(overtakers)[:5]} (not reported)"
                        )
            ahead.append(row_id)
            high = max(high, row_id)
    return Check(
        "per-key order",
        unexplained == 0,
        f"{len(firsts)} keys; {unexplained} unreported reorders; "
        f"{explained} reorders reported as acked-out-of-order ({len(reported)} rows reported)",
        evidence,
        first_at,
        {
            "unreported_reorders": unexplained,
            "reported_reorders": explained,
            "acked_out_of_order_rows": len(reported),
        },
    )


#: What a relay logs, with the row ids, when a copy of a row may be in Kafka
#: while the row is sent again: released while in flight to a broker, or its
#: send failed with no answer from the broker (docs/relay.md).
REPORTED_COPIES = ("released-in-flight", "possibly-written")


def reported_copies(obs: Observed) -> dict[str, Counter[str]]:
    """By event (name in :data:`REPORTED_COPIES`), how many times the relays
    reported a row as possibly written while it was sent again: each report may
    add one copy, by event id."""
    event_of = {r.id: r.event_id for r in obs.rows}
    times: dict[str, Counter[str]] = {name: Counter() for name in REPORTED_COPIES}
    for p in obs.relays:
        for name in REPORTED_COPIES:
            for e in p.events(name):
                for row_id in e.get("row_ids", []):
                    if int(row_id) in event_of:
                        times[name][event_of[int(row_id)]] += 1
    return times


def duplicates_accounted(cfg: RunConfig, obs: Observed) -> Check:
    """Every extra copy's first copy was produced while a fault could leave it
    unacknowledged: from one batch budget before the fault began until 2 s after
    it ended (a relay fault, kill, redeploy or stall, explains only rows of
    shards that relay owned at that moment, by the lease events); or, with no
    fault in reach, it is one a relay reported (its row released while a copy
    was in flight, ``released-in-flight``, or its send unanswered by the broker,
    ``possibly-written``: one extra copy per report). Counted by fault kind, or
    by the report for a broker slow on its own."""
    pre = cfg.timings.batch_budget_s + 1.0
    post = 2.0
    windows = [
        (f.started - pre, f.ended + post, f) for f in obs.faults if f.fault.kind in DUPLICATE_CAUSES
    ]
    shard_of = {r.event_id: r.shard for r in obs.rows}
    records = [r for p in obs.relays for r in p.read_records()] + obs.lease_ends
    owners = ownership_intervals(lease_events(records))

    def plausible(f: FaultRecord, event_id: str) -> bool:
        """A relay fault explains rows of shards the relay owned when it began (a
        stalled relay's batch may first be sent by the next owner, after expiry)."""
        node = f.detail.get("node_id")
        if not f.fault.kind.startswith("relay-") or f.fault.kind in FLEET_WIDE or node is None:
            return True
        spans = owners.get(shard_of.get(event_id, -1), [])
        return any(n == node and s <= f.started + 1 and e >= f.started - pre for n, s, e in spans)

    copies: dict[str, list[KafkaCopy]] = defaultdict(list)
    for c in obs.copies:
        copies[c.event_id].append(c)
    reported = reported_copies(obs)
    by_cause: Counter[str] = Counter()
    evidence: list[str] = []
    first_at: float | None = None
    for event_id, cs in copies.items():
        if len(cs) < 2:
            continue
        first = min(cs, key=lambda c: c.ts)
        extra = len(cs) - 1
        near = [w for w in windows if w[0] <= first.ts <= w[1] and plausible(w[2], event_id)]
        if near:  # the fault is the why; the relay's report, if any, only the how
            cause = min(near, key=lambda w: abs(w[2].started - first.ts))[2]
            by_cause[cause.fault.kind] += extra
            continue
        for name, times in reported.items():
            said = min(extra, times[event_id])
            if said:
                by_cause[name] += said
                extra -= said
        if extra:
            by_cause["unexplained"] += extra
            first_at = first.ts if first_at is None else min(first_at, first.ts)
            if len(evidence) < MAX_EVIDENCE:
                evidence.append(
                    f"{event_id} key {first.key}: {len(cs)} copies, first at {first.ts:.3f} "
                    f"(p{first.partition}@{[c.offset for c in cs]}), no fault in reach"
                )
    total = sum(by_cause.values())
    return Check(
        "duplicates accounted for",
        by_cause["unexplained"] == 0,
        f"{total} extra copies; by cause {dict(sorted(by_cause.items()))}",
        evidence,
        first_at,
        {"duplicates": total, "by_cause": dict(by_cause)},
    )


def nothing_stuck(obs: Observed) -> Check:
    counts = Counter(r.status for r in obs.rows)
    bad = [r for r in obs.rows if r.status != "delivered"]
    evidence = [
        f"row {r.id} {r.event_id} key {r.key} {r.status} attempts {r.attempts}"
        for r in bad[:MAX_EVIDENCE]
    ]
    delivered = [r for r in obs.rows if r.delivered is not None]
    worst = max(delivered, key=lambda r: (r.delivered or 0) - r.created, default=None)
    blocked = round((worst.delivered or 0) - worst.created, 2) if worst else 0.0
    return Check(
        "nothing stuck",
        not bad,
        f"statuses {dict(counts)}; longest commit-to-delivered {blocked} s"
        + (f" (row {worst.id}, key {worst.key})" if worst else ""),
        evidence,
        min((r.created for r in bad), default=None),
        {
            "stuck": len(bad),
            "failed": counts.get("failed", 0),
            "longest_blocked_s": blocked,
            "max_attempts": max((r.attempts for r in obs.rows), default=0),
        },
    )


def drains_clean(obs: Observed) -> Check:
    evidence: list[str] = []
    first_at: float | None = None
    relay_drains = consumer_drains = 0
    for p in obs.relays:
        if p.fate != "term":
            continue
        relay_drains += 1
        exits = p.events("relay-exit")
        rec = exits[-1] if exits else {}
        if p.exit_code != 0 or rec.get("result") != "clean" or rec.get("left_leased") != 0:
            evidence.append(
                f"relay {p.node_id}: exit {p.exit_code}, relay-exit "
                f"{json.dumps(rec, sort_keys=True) if rec else 'missing'}"
            )
            first_at = min(first_at or p.stopped_at or 0, p.stopped_at or 0)
    for p in obs.consumers:
        if p.fate != "term":
            continue
        consumer_drains += 1
        exits = p.events("consumer-exit")
        rec = exits[-1] if exits else {}
        problems = []
        if p.exit_code != 0 or rec.get("result") != "clean":
            problems.append(f"exit {p.exit_code} result {rec.get('result')}")
        for tp, committed in (rec.get("committed") or {}).items():
            partition = int(str(tp).rsplit("/", 1)[1])
            if (p.node_id, partition, committed) in obs.processed_at_commit:
                problems.append(f"{tp} committed {committed}, a message it had processed")
        if problems:
            evidence.append(
                f"consumer {p.node_id}: {'; '.join(problems)}; consumer-exit "
                f"{json.dumps(rec, sort_keys=True) if rec else 'missing'}"
            )
            first_at = min(first_at or p.stopped_at or 0, p.stopped_at or 0)
    return Check(
        "drains clean",
        not evidence,
        f"{relay_drains} relay drains, {consumer_drains} consumer drains; {len(evidence)} unclean",
        evidence,
        first_at,
        {
            "relay_drains": relay_drains,
            "consumer_drains": consumer_drains,
            "unclean": len(evidence),
        },
    )


def one_owner(cfg: RunConfig, obs: Observed) -> Check:
    records = [r for p in obs.relays for r in p.read_records()] + obs.lease_ends
    intervals, overlaps = ownership_overlaps(records)
    restarts = [f for f in obs.faults if f.fault.kind == "redis-restart"]
    reach = cfg.timings.shard_lease_ttl_s + 5
    evidence: list[str] = []
    after_restart = 0
    for o in overlaps:
        start = max(o.start, o.other_start)
        near = [f for f in restarts if f.started - 1 <= start <= f.ended + reach]
        if near:
            after_restart += 1
        if len(evidence) < MAX_EVIDENCE:
            why = f" [within {reach:.0f} s of redis-restart #{near[0].fault.seq}]" if near else ""
            evidence.append(str(o)[:600] + why)
    first_at = min((max(o.start, o.other_start) for o in overlaps), default=None)
    return Check(
        "no overlapping shard owners",
        not overlaps,
        f"{intervals} ownership intervals; {len(overlaps)} overlaps "
        f"({after_restart} right after a Redis restart)",
        evidence,
        first_at,
        {"intervals": intervals, "overlaps": len(overlaps), "after_redis_restart": after_restart},
    )


def faults_before(
    faults: Sequence[FaultRecord], at: float | None, slack: float = 30.0
) -> list[FaultRecord]:
    if at is None:
        return list(faults)
    return [f for f in faults if f.started <= at + slack]
