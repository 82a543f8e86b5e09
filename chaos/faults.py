"""Carrying out one fault of the schedule. Each returns what it did (node ids,
exit codes, lease ends observed in Redis) for the checks and the report."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa
from support.cluster import NODES, KafkaCluster
from support.waiting import wait_for

from chaos.cluster import RELAY_DB_USER, Cluster, reassign_replicas
from chaos.fleet import GROUP, REDIS_PREFIX, TABLE, Fleet
from chaos.procs import Proc
from chaos.schedule import Fault
from outboxkit.runtime.identity import read_identity
from outboxkit.runtime.rediskeys import lease_key


@dataclass
class FaultRecord:
    fault: Fault
    started: float
    ended: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class Injector:
    def __init__(self, fleet: Fleet, cluster: Cluster) -> None:
        self.fleet = fleet
        self.cluster = cluster
        self.t = fleet.cfg.timings
        #: lease ends the relays could not log (killed or frozen), on Redis's clock
        self.lease_ends: list[dict[str, Any]] = []
        self._outbox: str | None = None

    def outbox_key(self) -> str:
        """The identity the run's relays name their leases by (read once)."""
        if self._outbox is None:
            engine = self.cluster.engine(statement_timeout_s=10)
            try:
                with engine.connect() as conn:
                    self._outbox = read_identity(conn, TABLE).key
            finally:
                engine.dispose()
        return self._outbox

    def run(self, fault: Fault) -> FaultRecord:
        action = getattr(self, "_" + fault.kind.replace("-", "_"))
        retargeted_from = None
        if fault.kind == "consumer-rebalance-drain":
            retargeted_from, fault = fault.target, self._rebalance_target(fault)
        # one fault at a time per relay or consumer slot (the tracks run side by side)
        slot = self.fleet.slot_lock(fault.target) if fault.target in self.fleet.current else None
        with slot or contextlib.nullcontext():
            rec = FaultRecord(fault, time.time())
            if retargeted_from not in (None, fault.target):
                rec.detail["retargeted_from"] = retargeted_from
            self._act(action, fault, rec)
        return rec

    def _rebalance_target(self, fault: Fault) -> Fault:
        """The consumer slot a joining member is sure to take a partition from.

        The cooperative-sticky assignor moves partitions only off members above
        the new fair share; after a kill the partitions can sit unevenly (4 and
        2 of 6), and a surge deploy of the smaller holder revokes nothing from
        it; right after a Kafka outage the members hold nothing (their
        partitions lost) until the group settles. So the rolling deploy waits
        (60 s at most) for every partition to be held again, then replaces the
        consumer holding the most (the scheduled slot when it ties): the
        drain-at-revocation path is then walked by every such fault, not by
        chance."""
        deadline = time.monotonic() + 60
        while True:
            with self.fleet.lock:
                live = {s: self.fleet.current[s] for s in self.fleet.slots("consumer")}
            held = {slot: len(proc.assigned()) for slot, proc in live.items()}
            if sum(held.values()) >= self.fleet.cfg.partitions or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not held or held.get(fault.target, 0) >= max(held.values()):
            return fault
        return replace(fault, target=max(sorted(held), key=lambda s: held[s]))

    @staticmethod
    def _act(action: Any, fault: Fault, rec: FaultRecord) -> None:
        try:
            action(fault, rec)
        except Exception as exc:  # the run goes on; the report lists it
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.ended = time.time()

    # -- relays --------------------------------------------------------------
    def _relay_kill(self, f: Fault, rec: FaultRecord) -> None:
        with self.fleet.lock:
            proc = self.fleet.current[f.target]
            proc.fate = "kill"
            proc.stopped_at = time.time()
            proc.kill()
        rec.detail["node_id"] = proc.node_id
        self._note_lease_ends(proc, "killed")
        time.sleep(f.hold_s)
        rec.detail["replacement"] = self.fleet.start(f.target).node_id

    def _relay_redeploy(self, f: Fault, rec: FaultRecord) -> None:
        proc = self._terminate(f.target, rec)
        rec.detail["exit_code"] = proc.exit_code
        rec.detail["replacement"] = self.fleet.start(f.target).node_id

    def _relay_stall(self, f: Fault, rec: FaultRecord) -> None:
        proc = self.fleet.current[f.target]
        rec.detail["node_id"] = proc.node_id
        proc.signal(signal.SIGSTOP)
        time.sleep(0.3)  # a renewal sent just before the stop lands in Redis
        self._note_lease_ends(proc, "frozen")
        time.sleep(max(0.0, f.hold_s - 0.3))
        proc.signal(signal.SIGCONT)

    def _relay_bounded_queue(self, f: Fault, rec: FaultRecord) -> None:
        """A relay whose producer holds a twentieth of a batch loses Kafka (no
        data passes through the proxy, as ``net-timeout``) for longer than the
        message timeout, and is drained while its batch waits for room in the
        full queue: the drain must end within the flush budget with every row
        released (the drains-clean check), and nothing its queue still held may
        overtake a row sent again (the per-key order check). The outage reaches
        every relay, so the fault explains duplicates of any shard."""
        redeployed = self._terminate(f.target, rec)
        rec.detail["exit_code"] = redeployed.exit_code
        bounded = self.fleet.start(f.target, kafka_config=self.fleet.bounded_queue())
        rec.detail["bounded"] = bounded.node_id
        # Cut Kafka once it owns shards: the batches it then claims meet the full queue.
        bounded.wait_for_event("shard-acquired", 10)
        with self._toxic("kafka", f.kind, "timeout", {"timeout": 2000}):
            time.sleep(f.hold_s)
            drained = self._terminate(f.target, rec)
            rec.detail["bounded_exit_code"] = drained.exit_code
        # Unbounded again, unless the slot always is (fleet.BOUNDED_SLOT).
        rec.detail["replacement"] = self.fleet.start(f.target).node_id

    def _terminate(self, slot: str, rec: FaultRecord) -> Proc:
        with self.fleet.lock:
            proc = self.fleet.current[slot]
            proc.fate = "term"
            proc.stopped_at = time.time()
        rec.detail["node_id"] = proc.node_id
        # a pod gets no SIGTERM before it is up (one restarted by supervise() may not be)
        proc.wait_for_event("relay-started" if proc.role == "relay" else "partitions-assigned", 60)
        proc.signal(signal.SIGTERM)
        if proc.wait(45) is None:
            proc.kill()
            proc.exit_code = -9
            rec.detail["hung"] = True
        return proc

    def _note_lease_ends(self, proc: Proc, why: str) -> None:
        """A killed or frozen relay renews nothing: its leases end at Redis's
        ``TIME + PTTL``, which it cannot log itself. A killed relay whose lease
        of a shard is already gone (given back in Redis an instant before the
        kill, its ``shard-released`` line never written) held it until no later
        than now. A frozen relay gets no such line: it may still act on a shard
        it no longer holds once it resumes, which the check must see.

        Advisory locks: a killed relay's session ends with it, and the server
        drops its locks then (after the kill, before anyone else can take them),
        so every shard it held ends at the kill. A frozen relay keeps its session
        and so its locks: nothing ends."""
        if self.fleet.cfg.ownership == "advisory":
            if why == "killed":
                at = proc.stopped_at or time.time()
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))
                ts = f"{stamp}.{int(at % 1 * 1000):03d}Z"
                self.lease_ends.extend(
                    {
                        "event": "shard-lost",
                        "node_id": proc.node_id,
                        "shard": shard,
                        "ts": ts,
                        "reason": "session-ended-killed",
                    }
                    for shard in range(self.fleet.cfg.shards)
                )
            return
        client = self.cluster.redis_client()
        try:
            outbox = self.outbox_key()
            keys = [lease_key(REDIS_PREFIX, outbox, s) for s in range(self.fleet.cfg.shards)]
            values = client.mget(keys)
            sec, usec = client.time()
            now_ms = sec * 1000 + usec // 1000
            for shard, (key, value) in enumerate(zip(keys, values, strict=True)):
                if value is None and why == "killed":
                    # No lease at all: one this relay held had ended by now. It
                    # may have been given back in Redis just before the kill,
                    # with its shard-released line never written; the relay is
                    # dead, so it holds nothing from here (only ended leases are
                    # closed by this line: ownership_intervals skips the rest).
                    self.lease_ends.append(
                        {
                            "event": "shard-lost",
                            "node_id": proc.node_id,
                            "shard": shard,
                            "redis_epoch_ms": now_ms,
                            "reason": "gone-killed",
                        }
                    )
                elif value is not None and value.decode().rsplit(":", 1)[0] == proc.node_id:
                    pttl = client.pttl(key)
                    if pttl > 0:
                        self.lease_ends.append(
                            {
                                "event": "shard-lost",
                                "node_id": proc.node_id,
                                "shard": shard,
                                "redis_epoch_ms": now_ms + pttl,
                                "reason": f"expired-{why}",
                            }
                        )
        finally:
            client.close()

    # -- consumers -----------------------------------------------------------
    def _consumer_kill(self, f: Fault, rec: FaultRecord) -> None:
        with self.fleet.lock:
            proc = self.fleet.current[f.target]
            proc.fate = "kill"
            proc.stopped_at = time.time()
            proc.kill()
        rec.detail["node_id"] = proc.node_id
        time.sleep(f.hold_s)
        rec.detail["replacement"] = self.fleet.start(f.target).node_id

    def _consumer_drain(self, f: Fault, rec: FaultRecord) -> None:
        slow = self.fleet.slow_file(f.target)
        slow.touch()
        try:
            time.sleep(f.hold_s)
            proc = self._terminate(f.target, rec)
            rec.detail["exit_code"] = proc.exit_code
        finally:
            slow.unlink(missing_ok=True)
        rec.detail["replacement"] = self.fleet.start(f.target).node_id

    def _consumer_rebalance_drain(self, f: Fault, rec: FaultRecord) -> None:
        """A rolling deploy with surge: the replacement joins the group first, and
        the old consumer gets SIGTERM at the revocation that causes, so its drain
        and exit commit run while the group rebalances (cooperative: it must
        rejoin before the group takes its commit). The consumer signals itself
        when armed (chaos/apps.py). One that lost no partition by the time the
        replacement is up (and 5 s more) is sent SIGTERM by the harness instead,
        disarmed first so that it is not signalled twice (``at_revocation``
        false)."""
        with self.fleet.lock:
            old = self.fleet.current[f.target]
        rec.detail["node_id"] = old.node_id
        old.wait_for_event("partitions-assigned", 60)  # a pod is up before it is replaced
        armed = self.fleet.term_at_revoke_file(old.node_id)
        armed.touch()
        with self.fleet.lock:
            old.fate = "term"
            old.stopped_at = time.time()
        try:
            new = self.fleet.start(f.target, wait=False)
            rec.detail["replacement"] = new.node_id
            new.wait_for_event("partitions-assigned", 90)
            old.wait(5)
            try:
                armed.unlink()  # not signalled yet: the harness does it
            except FileNotFoundError:
                rec.detail["at_revocation"] = True
            else:
                rec.detail["at_revocation"] = False
                old.signal(signal.SIGTERM)
            if old.wait(45) is None:
                old.kill()
                old.exit_code = -9
                rec.detail["hung"] = True
        finally:
            armed.unlink(missing_ok=True)
        rec.detail["exit_code"] = old.exit_code

    # -- Kafka, Redis, MariaDB -----------------------------------------------
    def _kafka_kill(self, f: Fault, rec: FaultRecord) -> None:
        """Kafka is gone (on a cluster: every node at once, a total outage)."""
        self.cluster.kafka_kill()
        time.sleep(f.hold_s)
        t0 = time.monotonic()
        self.cluster.kafka_start()
        rec.detail["restart_s"] = round(time.monotonic() - t0, 1)

    def _kafka_freeze(self, f: Fault, rec: FaultRecord) -> None:
        nodes = self.cluster.kafka_nodes()
        for node in nodes:
            node.pause()
        try:
            time.sleep(f.hold_s)
        finally:
            for node in nodes:
                node.resume()

    # -- a three-node Kafka cluster (--kafka-brokers 3) ----------------------
    def _kafka_cluster(self) -> KafkaCluster:
        kafka = self.cluster.kafka
        assert isinstance(kafka, KafkaCluster), f"{self.cluster.name}: not a Kafka cluster"
        return kafka

    def _partition(self, f: Fault) -> int:
        """The partition of the run's topic a node fault aims at (by the fault's seq)."""
        return f.seq % self.fleet.cfg.partitions

    def _kill_node(self, k: int, f: Fault, rec: FaultRecord) -> None:
        """SIGKILL node ``k``; start it again after the hold; wait until every
        partition of the run has its full ISR again (recorded, bounded)."""
        kafka = self._kafka_cluster()
        rec.detail["node"] = k
        kafka.node(k).kill()
        time.sleep(f.hold_s)
        t0 = time.monotonic()
        kafka.node(k).start()
        rec.detail["restart_s"] = round(time.monotonic() - t0, 1)
        self._wait_isr(kafka, rec, t0)

    def _wait_isr(self, kafka: KafkaCluster, rec: FaultRecord, t0: float) -> None:
        try:
            kafka.wait_full_isr(self._topics(), timeout=self.t.isr_recovery_s)
        except Exception as exc:  # the run goes on: the next fault waits for it
            rec.detail["isr_not_full"] = f"{type(exc).__name__}: {exc}"[:200]
        rec.detail["isr_full_s"] = round(time.monotonic() - t0, 1)

    def _topics(self) -> list[str]:
        topic = self.fleet.topic
        return [topic, f"{topic}.dlq", f"{topic}.neighbour"]

    def _kafka_leader_kill(self, f: Fault, rec: FaultRecord) -> None:
        """kill -9 the leader of a partition the relays produce to, mid-backlog."""
        p = self._partition(f)
        rec.detail["partition"] = p
        self._kill_node(self._kafka_cluster().leader(self.fleet.topic, p), f, rec)

    def _kafka_controller_kill(self, f: Fault, rec: FaultRecord) -> None:
        """kill -9 the active controller (the quorum elects another)."""
        self._kill_node(self._kafka_cluster().active_controller(), f, rec)

    def _kafka_coordinator_kill(self, f: Fault, rec: FaultRecord) -> None:
        """kill -9 the consumer group's coordinator while the consumers commit."""
        self._kill_node(self._kafka_cluster().coordinator(GROUP), f, rec)

    def _kafka_follower_freeze(self, f: Fault, rec: FaultRecord) -> None:
        """SIGSTOP a follower of a partition for longer than the replica lag: its
        partitions' ISR shrinks to the leader and one more, those led by the frozen
        node move; the 2-replica partitions ``acks=all`` needs are still there
        unless a second node falls behind. Resume; wait for the full ISR."""
        kafka = self._kafka_cluster()
        p = self._partition(f)
        part = kafka.partitions(self.fleet.topic).get(p)
        followers = [r for r in part.replicas if r != part.leader] if part else []
        k = followers[f.seq % len(followers)] if followers else 1 + f.seq % NODES
        rec.detail.update(partition=p, node=k)
        kafka.freeze(k)
        try:
            time.sleep(f.hold_s)
            shrunk = kafka.partitions(self.fleet.topic).get(p)
            rec.detail["isr_at_end"] = list(shrunk.isr) if shrunk else None
        finally:
            kafka.resume(k)
        self._wait_isr(kafka, rec, time.monotonic())

    def _kafka_isr_shortage(self, f: Fault, rec: FaultRecord) -> None:
        """One partition of the run's topic below ``min.insync.replicas`` (2) for
        longer than ``max_attempts`` message timeouts and their backoff, the
        other partitions writable throughout.

        Every partition has all three nodes as replicas, so one node stopped
        leaves two in sync, still the minimum; two stopped would take the KRaft
        quorum (and every partition) with them. So the partition is first moved
        onto its leader and one follower (a reassignment that only drops a
        replica), then that follower is killed (``kill -9``): the ISR shrinks to
        the leader alone, which refuses every ``acks=all`` write
        (``NOT_ENOUGH_REPLICAS``), while every other partition keeps two in-sync
        replicas. Held from the moment the metadata shows the short ISR, then
        the node starts again, the partition gets its third replica back, and
        the fault waits for every full ISR. The record says how long the
        partition really was below the minimum (``below_min_s``) against
        ``max_attempts`` message timeouts (``attempts_budget_s``); the run's
        ISR-shortage check fails when it was not longer."""
        kafka = self._kafka_cluster()
        topic = self.fleet.topic
        p = self._partition(f)
        part = kafka.partitions(topic).get(p)
        if part is None or part.leader not in part.replicas or len(part.replicas) != NODES:
            raise RuntimeError(f"{topic}[{p}] has no leader or not {NODES} replicas: {part}")
        followers = [r for r in part.replicas if r != part.leader]
        k, dropped = followers[f.seq % 2], followers[(f.seq + 1) % 2]
        rec.detail.update(
            partition=p,
            node=k,
            leader=part.leader,
            replicas=list(part.replicas),
            min_insync_replicas=2,
            max_attempts=self.t.relay_max_attempts,
            message_timeout_s=self.t.message_timeout_s,
            attempts_budget_s=self.t.attempts_budget_s,
        )
        port = kafka.node(part.leader).port
        reassign_replicas(port, topic, p, [part.leader, k])
        wait_for(
            lambda: (q := kafka.partitions(topic).get(p)) and set(q.replicas) == {part.leader, k},
            timeout=60,
            interval=0.5,
            what=f"{topic}[{p}] on replicas {[part.leader, k]}",
        )
        kafka.node(k).kill()
        t0 = time.monotonic()
        try:
            short = kafka.wait_isr(topic, p, 1, timeout=self.t.isr_recovery_s)
            below = time.monotonic()
            rec.detail["isr_short_after_s"] = round(below - t0, 1)
            rec.detail["isr_during"] = list(short.isr)
            time.sleep(max(0.0, below + f.hold_s - time.monotonic()))
            still = kafka.partitions(topic).get(p)
            rec.detail["isr_at_end"] = list(still.isr) if still else None
            rec.detail["below_min_s"] = round(time.monotonic() - below, 1)
        finally:
            t1 = time.monotonic()
            kafka.node(k).start()
            rec.detail["restart_s"] = round(time.monotonic() - t1, 1)
            kafka.wait_isr(topic, p, 2, timeout=self.t.isr_recovery_s)
            reassign_replicas(port, topic, p, list(part.replicas))
        rec.detail["third_replica"] = dropped
        wait_for(
            lambda: (q := kafka.partitions(topic).get(p)) and len(q.replicas) == NODES,
            timeout=60,
            interval=0.5,
            what=f"{topic}[{p}] on {NODES} replicas again",
        )
        self._wait_isr(kafka, rec, t1)

    def _kafka_rolling_restart(self, f: Fault, rec: FaultRecord) -> None:
        """An upgrade: SIGTERM each node in turn, start it again, wait for every
        ISR to be full before the next."""
        kafka = self._kafka_cluster()
        took: list[float] = []
        for k in sorted(kafka.nodes):
            t0 = time.monotonic()
            kafka.node(k).stop()
            kafka.node(k).start()
            self._wait_isr(kafka, rec, t0)
            took.append(round(time.monotonic() - t0, 1))
        rec.detail["node_s"] = took

    def _redis_restart(self, f: Fault, rec: FaultRecord) -> None:
        self.cluster.redis.kill()
        self.cluster.redis.start()  # no persistence: every lease is forgotten

    def _redis_freeze(self, f: Fault, rec: FaultRecord) -> None:
        self._freeze(self.cluster.redis, f.hold_s)

    @staticmethod
    def _freeze(instance: Any, hold_s: float) -> None:
        instance.pause()
        try:
            time.sleep(hold_s)
        finally:
            instance.resume()

    def _db_kill_connections(self, f: Fault, rec: FaultRecord) -> None:
        if self.cluster.postgresql:
            rec.detail["killed_connections"] = self._pg_terminate_relay_sessions()
            return
        engine = self.cluster.engine()
        killed = 0
        try:
            for _ in range(3):
                with engine.connect() as conn:
                    ids = (
                        conn.execute(
                            sa.text(
                                "SELECT ID FROM information_schema.PROCESSLIST WHERE USER = :u"
                            ),
                            {"u": RELAY_DB_USER},
                        )
                        .scalars()
                        .all()
                    )
                    for i in ids:
                        with contextlib.suppress(sa.exc.DBAPIError):
                            conn.execute(sa.text(f"KILL CONNECTION {int(i)}"))
                            killed += 1
                time.sleep(0.5)
        finally:
            engine.dispose()
        rec.detail["killed_connections"] = killed

    def _pg_terminate_relay_sessions(self) -> int:
        """``pg_terminate_backend`` on every relay session, three times 0.5 s apart
        (a relay reconnects in between), as the superuser (outboxkit may not)."""
        engine = self.cluster.superuser_engine()
        killed = 0
        try:
            for _ in range(3):
                with engine.begin() as conn:
                    killed += int(
                        conn.execute(
                            sa.text(
                                "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid))"
                                " FROM pg_stat_activity WHERE usename = :u"
                            ),
                            {"u": RELAY_DB_USER},
                        ).scalar_one()
                    )
                time.sleep(0.5)
        finally:
            engine.dispose()
        return killed

    def _db_restart(self, f: Fault, rec: FaultRecord) -> None:
        t0 = time.monotonic()
        self.cluster.db.kill()
        self.cluster.db.start()
        rec.detail["restart_s"] = round(time.monotonic() - t0, 1)

    # -- network (relays <-> one service, through Toxiproxy) -----------------
    @contextlib.contextmanager
    def _toxic(
        self, target: str, name: str, kind: str, attributes: dict[str, int]
    ) -> Iterator[None]:
        """The toxic on every proxy in front of ``target`` (each node of a Kafka cluster)."""
        proxy = self.cluster.toxiproxy
        names = self.cluster.proxies(target)
        try:
            for n in names:
                proxy.add_toxic(n, name, kind, attributes)
            yield
        finally:
            for n in names:
                proxy.remove_toxic(n, name)

    def _net(self, f: Fault, kind: str, attributes: dict[str, int]) -> None:
        with self._toxic(f.target, f.kind, kind, attributes):
            time.sleep(f.hold_s)

    def _net_latency(self, f: Fault, rec: FaultRecord) -> None:
        self._net(f, "latency", {"latency": 300, "jitter": 200})

    def _net_timeout(self, f: Fault, rec: FaultRecord) -> None:
        # no data passes; connections close after 2 s
        self._net(f, "timeout", {"timeout": 2000})

    def _net_reset(self, f: Fault, rec: FaultRecord) -> None:
        self._net(f, "reset_peer", {"timeout": 500})
