"""Run sizes and the timings every process of a run shares."""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass, field

#: Fault kinds in the order they were built; the schedule draws from these.
KINDS: tuple[str, ...] = (
    "relay-kill",
    "relay-redeploy",
    "relay-stall",
    "consumer-kill",
    "consumer-drain",
    "consumer-rebalance-drain",
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
)
#: Fault kinds of a three-node Kafka cluster (``--kafka-brokers 3``), beside the
#: others (where ``kafka-kill`` and ``kafka-freeze`` take every node at once).
CLUSTER_KINDS: tuple[str, ...] = (
    "kafka-leader-kill",
    "kafka-follower-freeze",
    "kafka-controller-kill",
    "kafka-coordinator-kill",
    "kafka-rolling-restart",
    "kafka-isr-shortage",
)
#: Takes one partition of the run's topic below ``min.insync.replicas`` for
#: longer than the relays' retry budget (``chaos.faults.Injector``).
ISR_SHORTAGE = "kafka-isr-shortage"
#: The relays' ``--max-attempts`` in a run with ``kafka-isr-shortage``: the
#: shipped default, so that the shortage can outlast the whole retry budget
#: (``max_attempts`` x (message timeout + backoff cap)) in about a minute.
ISR_SHORTAGE_MAX_ATTEMPTS = 10


@dataclass(frozen=True)
class Timings:
    """Short timeouts so a fault resolves in seconds. The relations the relay checks
    at start hold: lease_ttl > batch deadline (message timeout + 2 s) + flush;
    shard_lease_ttl > 2 x renew + batch budget (batch deadline + 1 s)."""

    message_timeout_s: float = 3.0
    lease_ttl_s: float = 8.0
    flush_timeout_s: float = 1.0
    shard_lease_ttl_s: float = 8.0
    shard_renew_s: float = 0.5
    relay_batch_size: int = 200
    relay_max_attempts: int = 100
    #: the relays' ``OUTBOXKIT_RETRY_BACKOFF_CAP``
    retry_backoff_cap_s: float = 2.0
    #: ``queue.buffering.max.messages`` of a relay under ``relay-bounded-queue``:
    #: a twentieth of a batch fits into its producer.
    bounded_queue_messages: int = 10
    consumer_session_timeout_ms: int = 6000
    slow_handler_s: float = 0.3
    #: a cluster's ``replica.lag.time.max.ms`` (support.cluster.KafkaCluster's)
    replica_lag_s: float = 4.0
    #: how long a cluster node fault waits for every ISR to be full again
    isr_recovery_s: float = 90.0

    @property
    def batch_budget_s(self) -> float:
        return self.message_timeout_s + 2.0 + 1.0

    @property
    def attempts_budget_s(self) -> float:
        """``max_attempts`` message timeouts: what an outage must outlast to burn
        a row's whole retry budget if its attempts were not refunded."""
        return self.relay_max_attempts * self.message_timeout_s

    @property
    def attempts_wall_s(self) -> float:
        """How long ``max_attempts`` attempts of a row the cluster refuses take at
        most: each waits out the message timeout and a backoff (capped)."""
        return self.relay_max_attempts * (self.message_timeout_s + self.retry_backoff_cap_s)


@dataclass(frozen=True)
class RunConfig:
    name: str
    seed: int
    events: int
    keys: int
    relays: int
    consumers: int
    #: seconds over which the writer commits and the schedule runs
    duration_s: float
    #: faults per kind
    faults: dict[str, int]
    partitions: int = 6
    #: worker threads per consumer (each message is one inbox transaction)
    consumer_concurrency: int = 2
    shards: int = 64
    settle_timeout_s: float = 600.0
    #: "mariadb" or "postgresql": the run's own named database instance.
    database: str = "mariadb"
    #: How relays share shards: "redis" (shard leases, either database) or
    #: "advisory" (PostgreSQL session advisory locks; the relays get no Redis).
    ownership: str = "redis"
    #: The relays overlap two batches (``OUTBOXKIT_PIPELINE``): True or False as
    #: asked; None leaves the relay's own default (on with PostgreSQL only).
    pipeline: bool | None = None
    #: 1: one broker; 3: a three-node KRaft cluster (replication factor 3,
    #: min.insync.replicas 2) and the cluster fault kinds
    kafka_brokers: int = 1
    #: MariaDB's binary log: on (row format, full images, as production runs
    #: it) or off. PostgreSQL always logs its WAL.
    binlog: bool = True
    keep: bool = False
    timings: Timings = field(default_factory=Timings)

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())

    def describe(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d.pop("keep")
        return d


def _preset(name: str, kafka_brokers: int = 1) -> dict[str, object]:
    if kafka_brokers == 3:
        return _cluster_preset(name)
    if name == "smoke":
        per = dict.fromkeys(KINDS, 1)
        per.update({"relay-kill": 2, "relay-redeploy": 2})
        return {
            "events": 20_000,
            "keys": 2_000,
            "relays": 3,
            "consumers": 2,
            "duration_s": 90.0,
            "faults": per,
        }
    if name == "medium":
        per = dict.fromkeys(KINDS, 2)
        per.update({"relay-kill": 4, "relay-redeploy": 8})
        return {
            "events": 100_000,
            "keys": 5_000,
            "relays": 3,
            "consumers": 2,
            "duration_s": 300.0,
            "faults": per,
        }
    per = dict.fromkeys(KINDS, 9)
    per.update({"relay-kill": 15, "relay-redeploy": 100})
    return {
        "events": 1_000_000,
        "keys": 10_000,
        "relays": 3,
        "consumers": 2,
        "duration_s": 1500.0,
        "consumer_concurrency": 4,
        "faults": per,
    }


def _cluster_preset(name: str) -> dict[str, object]:
    """The runs on a three-node cluster: the single-broker schedule's kinds, and
    the cluster's (each node fault takes 10 to 50 s: a restart and the ISR's
    recovery, so the runs are longer for their events)."""
    if name == "smoke":
        # Not the total outages (kafka-kill, kafka-freeze of every node): the
        # single-broker smoke has them, and here they cost half a minute each.
        # Nor the ISR shortage: it outlasts the retry budget (about a minute and
        # the node's restart); it runs at medium and full size, or with --only.
        per = {k: 1 for k in KINDS if k not in ("kafka-kill", "kafka-freeze")}
        per.update({k: 1 for k in CLUSTER_KINDS if k != ISR_SHORTAGE})
        per.update({"relay-redeploy": 2})
        return {
            "events": 20_000,
            "keys": 2_000,
            "relays": 3,
            "consumers": 2,
            "duration_s": 150.0,
            "faults": per,
        }
    if name == "medium":
        per = dict.fromkeys(KINDS, 1)
        per.update(dict.fromkeys(CLUSTER_KINDS, 4))
        per.update({"relay-redeploy": 8, ISR_SHORTAGE: 2})
        return {
            "events": 100_000,
            "keys": 5_000,
            "relays": 3,
            "consumers": 2,
            "duration_s": 600.0,
            "faults": per,
        }
    per = dict.fromkeys(KINDS, 4)
    per.update(
        {
            "kafka-leader-kill": 30,
            "kafka-follower-freeze": 25,
            "kafka-controller-kill": 15,
            "kafka-coordinator-kill": 20,
            "kafka-rolling-restart": 10,
            ISR_SHORTAGE: 4,
            "relay-redeploy": 60,
        }
    )
    return {
        "events": 500_000,
        "keys": 10_000,
        "relays": 3,
        "consumers": 2,
        "duration_s": 2400.0,
        "consumer_concurrency": 4,
        "faults": per,
    }


def parse_args(argv: list[str] | None = None) -> RunConfig:
    p = argparse.ArgumentParser(
        prog="chaos/run.sh",
        description="Run relays and inbox consumers under a seeded fault schedule and check "
        "that nothing is lost, keys stay in order and every duplicate has a cause.",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--smoke",
        action="store_const",
        dest="size",
        const="smoke",
        help="about 2 minutes, 20,000 events, every fault kind (the test suite's)",
    )
    size.add_argument(
        "--medium",
        action="store_const",
        dest="size",
        const="medium",
        help="about 5 minutes, 100,000 events",
    )
    p.add_argument("--seed", type=int, help="replay this seed (default: a random one, printed)")
    p.add_argument("--events", type=int, help="events the writer commits")
    p.add_argument("--keys", type=int, help="distinct message keys")
    p.add_argument("--duration", type=float, help="seconds of writing and faults")
    p.add_argument("--relays", type=int)
    p.add_argument("--consumers", type=int)
    p.add_argument("--concurrency", type=int, help="worker threads per consumer")
    p.add_argument("--only", help="comma-separated fault kinds to keep (replay a subset)")
    p.add_argument(
        "--faults", help="per-kind counts, e.g. redis-restart=10,relay-kill=5 (others unchanged)"
    )
    p.add_argument(
        "--database",
        choices=("mariadb", "postgresql"),
        default="mariadb",
        help="the database the run starts its own instance of (default mariadb)",
    )
    p.add_argument(
        "--ownership",
        choices=("redis", "advisory"),
        help="how relays share shards: Redis leases (default on MariaDB) or PostgreSQL "
        "advisory locks (default on PostgreSQL; the relays then get no Redis)",
    )
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the relays with the pipeline on (two batches in flight) or off; "
        "default: the relay's own default, on with PostgreSQL only (docs/relay.md)",
    )
    p.add_argument(
        "--kafka-brokers",
        type=int,
        choices=(1, 3),
        default=1,
        help="1: one broker (default); 3: a three-node KRaft cluster (replication factor 3, "
        "min.insync.replicas 2) with the cluster fault kinds: " + ", ".join(CLUSTER_KINDS),
    )
    p.add_argument(
        "--binlog",
        choices=("on", "off"),
        default="on",
        help="MariaDB's binary log: on (default: row format, full row images, as production "
        "runs it) or off",
    )
    p.add_argument("--keep", action="store_true", help="keep the named instances' state")
    a = p.parse_args(argv)
    known = KINDS + (CLUSTER_KINDS if a.kafka_brokers == 3 else ())
    ownership = a.ownership or ("advisory" if a.database == "postgresql" else "redis")
    if ownership == "advisory" and a.database != "postgresql":
        p.error("--ownership advisory needs --database postgresql")
    name = a.size or "full"
    values = _preset(name, a.kafka_brokers)
    for k in ("events", "keys", "relays", "consumers"):
        if getattr(a, k) is not None:
            values[k] = getattr(a, k)
    if a.duration is not None:
        values["duration_s"] = a.duration
    if a.concurrency is not None:
        values["consumer_concurrency"] = a.concurrency
    faults = dict(values.pop("faults"))  # type: ignore[call-overload]
    for item in filter(None, (a.faults or "").split(",")):
        kind, _, count = item.partition("=")
        if kind.strip() not in known or not count.strip().isdigit():
            p.error(f"bad --faults item {item!r}; known kinds: {', '.join(known)}")
        faults[kind.strip()] = int(count)
    if a.only:
        keep = {k.strip() for k in a.only.split(",")}
        unknown = keep - set(known)
        if unknown:
            p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(known)}")
        # a kind the size leaves out (the cluster smoke's outages) runs once
        faults = {k: faults.get(k, 1) for k in sorted(keep)}
    if ownership == "advisory":
        # The relays use no Redis then (nor does anything else): its faults would test nothing.
        faults = {k: n for k, n in faults.items() if not k.startswith("redis-")}
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 1_000_000)
    if faults.get(ISR_SHORTAGE):
        values["timings"] = Timings(relay_max_attempts=ISR_SHORTAGE_MAX_ATTEMPTS)
    values.update(
        database=a.database,
        ownership=ownership,
        pipeline=a.pipeline,
        kafka_brokers=a.kafka_brokers,
        binlog=a.binlog == "on",
    )
    return RunConfig(name=name, seed=seed, faults=faults, keep=a.keep, **values)  # type: ignore[arg-type]
