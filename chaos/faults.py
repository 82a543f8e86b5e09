"""Carrying out one fault of the schedule. Each returns what it did (node ids,
exit codes, lease ends observed in Redis) for the checks and the report."""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from chaos.cluster import RELAY_DB_USER, Cluster
from chaos.fleet import REDIS_PREFIX, TABLE, Fleet
from chaos.procs import Proc
from chaos.schedule import Fault
from outboxkit.relay.leases import lease_key
from outboxkit.runtime.identity import read_identity


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
        # one fault at a time per relay or consumer slot (the tracks run side by side)
        slot = self.fleet.slot_lock(fault.target) if fault.target in self.fleet.current else None
        with slot or contextlib.nullcontext():
            rec = FaultRecord(fault, time.time())
            self._act(action, fault, rec)
        return rec

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
        proxy = self.cluster.toxiproxy
        proxy.add_toxic("kafka", f.kind, "timeout", {"timeout": 2000})
        try:
            time.sleep(f.hold_s)
            drained = self._terminate(f.target, rec)
            rec.detail["bounded_exit_code"] = drained.exit_code
        finally:
            proxy.remove_toxic("kafka", f.kind)
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
        ``TIME + PTTL``, which it cannot log itself.

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
                if value is not None and value.decode().rsplit(":", 1)[0] == proc.node_id:
                    pttl = client.pttl(key)
                    if pttl > 0:
                        self.lease_ends.append(
                            {
                                "event": "shard-lost",
                                "node_id": proc.node_id,
                                "shard": shard,
                                "redis_ms": now_ms + pttl,
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
        self.cluster.kafka.kill()
        time.sleep(f.hold_s)
        t0 = time.monotonic()
        self.cluster.kafka.start()
        rec.detail["restart_s"] = round(time.monotonic() - t0, 1)

    def _kafka_freeze(self, f: Fault, rec: FaultRecord) -> None:
        self._freeze(self.cluster.kafka, f.hold_s)

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
    def _net(self, f: Fault, kind: str, attributes: dict[str, int]) -> None:
        proxy = self.cluster.toxiproxy
        proxy.add_toxic(f.target, f.kind, kind, attributes)
        try:
            time.sleep(f.hold_s)
        finally:
            proxy.remove_toxic(f.target, f.kind)

    def _net_latency(self, f: Fault, rec: FaultRecord) -> None:
        self._net(f, "latency", {"latency": 300, "jitter": 200})

    def _net_timeout(self, f: Fault, rec: FaultRecord) -> None:
        # no data passes; connections close after 2 s
        self._net(f, "timeout", {"timeout": 2000})

    def _net_reset(self, f: Fault, rec: FaultRecord) -> None:
        self._net(f, "reset_peer", {"timeout": 500})
