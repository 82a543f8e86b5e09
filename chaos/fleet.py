"""The relays and consumers of a run, by slot, with every process ever started.

A slot (``relay-1``) always has one current process; a replacement gets a new
node id (``relay-1-g3``). A process that exits without the harness asking is
restarted by ``supervise()`` and reported as an unexpected exit.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenacity

from chaos.cluster import Cluster
from chaos.config import RunConfig
from chaos.procs import Proc

TABLE = "outbox_events"
#: starts of one slot's process before a failing start counts as an unexpected exit
START_ATTEMPTS = 20
REDIS_PREFIX = "chaos:"
#: The consumers' group (its coordinator is the target of ``kafka-coordinator-kill``).
GROUP = "chaos"
#: The relay slot whose every process runs with a bounded producer queue
#: (``Timings.bounded_queue_messages``): Kafka faults meet one such relay in
#: every run, under load (docs/reliability.md).
BOUNDED_SLOT = "relay-0"
#: The slot of the neighbour outbox's relay (``chaos.cluster.NEIGHBOUR``).
NEIGHBOUR_SLOT = "neighbour-0"


@dataclass
class Fleet:
    cfg: RunConfig
    cluster: Cluster
    topic: str
    logs: Path
    current: dict[str, Proc] = field(default_factory=dict)
    history: list[Proc] = field(default_factory=list)
    unexpected_exits: list[dict[str, Any]] = field(default_factory=list)
    #: processes that exited 3 at start (a dependency down for longer than their
    #: connect timeout): designed behaviour, restarted as an orchestrator would
    start_failures: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: Other processes of the run (the writer), killed with the fleet at the end.
    others: list[Proc] = field(default_factory=list)
    #: Set when the run ends: a fault thread still running starts nothing more.
    closed: bool = False
    _generation: dict[str, int] = field(default_factory=dict)
    _slot_locks: dict[str, threading.Lock] = field(default_factory=dict)

    def slot_lock(self, slot: str) -> threading.Lock:
        """Held by a fault for as long as it acts on ``slot``'s process."""
        with self.lock:
            return self._slot_locks.setdefault(slot, threading.Lock())

    # -- settings ------------------------------------------------------------
    def relay_env(self, node_id: str, kafka_config: str = "") -> dict[str, str]:
        """``kafka_config``: more ``OUTBOXKIT_KAFKA_CONFIG`` items (``k=v,k=v``)."""
        t = self.cfg.timings
        return {
            "OUTBOXKIT_DB_URL": self.cluster.relay_db_url,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": self.cluster.relay_bootstrap,
            "OUTBOXKIT_KAFKA_CONFIG": ",".join(
                filter(
                    None, [f"message.timeout.ms={int(t.message_timeout_s * 1000)}", kafka_config]
                )
            ),
            "OUTBOXKIT_TABLE": TABLE,
            "OUTBOXKIT_NODE_ID": node_id,
            "OUTBOXKIT_SERVICE": "chaos-relay",
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_START_JITTER": "0.2",
            "OUTBOXKIT_POLL_INTERVAL": "0.2",
            "OUTBOXKIT_BATCH_SIZE": str(t.relay_batch_size),
            "OUTBOXKIT_LEASE_TTL": str(t.lease_ttl_s),
            "OUTBOXKIT_FLUSH_TIMEOUT": str(t.flush_timeout_s),
            "OUTBOXKIT_SHUTDOWN_TIMEOUT": "20",
            "OUTBOXKIT_RETRY_BACKOFF_BASE": "0.2",
            "OUTBOXKIT_RETRY_BACKOFF_CAP": str(t.retry_backoff_cap_s),
            "OUTBOXKIT_MAX_ATTEMPTS": str(t.relay_max_attempts),
            "OUTBOXKIT_SHARD_LEASE_TTL": str(t.shard_lease_ttl_s),
            "OUTBOXKIT_SHARD_RENEW_INTERVAL": str(t.shard_renew_s),
            "OUTBOXKIT_CONNECT_TIMEOUT": "15",
            "OUTBOXKIT_METRICS_INTERVAL": "5",
            **(
                {}
                if self.cfg.pipeline is None  # the relay's own default
                else {"OUTBOXKIT_PIPELINE": "true" if self.cfg.pipeline else "false"}
            ),
            # Advisory-lock ownership (PostgreSQL): the relays get no Redis at all, so
            # they own shards by advisory locks and wake up on the writer's NOTIFY.
            **(
                {}
                if self.cfg.ownership == "advisory"
                else {
                    "OUTBOXKIT_REDIS_URL": self.cluster.relay_redis_url,
                    "OUTBOXKIT_REDIS_PREFIX": REDIS_PREFIX,
                }
            ),
        }

    def neighbour_env(self, node_id: str) -> dict[str, str]:
        """The neighbour outbox's relay: the run's relay settings, Redis and prefix,
        on the other outbox of the same server (see ``chaos.cluster.NEIGHBOUR``)."""
        return {
            **self.relay_env(node_id),
            "OUTBOXKIT_DB_URL": self.cluster.neighbour(self.cluster.relay_db_url),
            "OUTBOXKIT_SERVICE": "chaos-neighbour",
        }

    def consumer_env(self, node_id: str, slot: str) -> dict[str, str]:
        t = self.cfg.timings
        return {
            "OUTBOXKIT_KAFKA_BOOTSTRAP": self.cluster.bootstrap,
            "OUTBOXKIT_KAFKA_CONFIG": (
                f"session.timeout.ms={t.consumer_session_timeout_ms},heartbeat.interval.ms=1000"
            ),
            "OUTBOXKIT_DB_URL": self.cluster.db_url,
            "OUTBOXKIT_INBOX": "true",
            "OUTBOXKIT_GROUP_ID": GROUP,
            "OUTBOXKIT_TOPICS": self.topic,
            "OUTBOXKIT_NODE_ID": node_id,
            "OUTBOXKIT_SERVICE": "chaos-consumer",
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_CONCURRENCY": str(self.cfg.consumer_concurrency),
            "OUTBOXKIT_COMMIT_INTERVAL": "1",
            "OUTBOXKIT_WORKER_DRAIN_TIMEOUT": "8",
            "OUTBOXKIT_CLOSE_TIMEOUT": "5",
            "OUTBOXKIT_SHUTDOWN_TIMEOUT": "20",
            # database restarts are transient: retry rather than dead-letter
            "OUTBOXKIT_MAX_ATTEMPTS": "1000",
            "OUTBOXKIT_RETRY_BACKOFF_CAP": "2",
            "OUTBOXKIT_RETRY_MAX_TIME": "900",
            "CHAOS_SLOW_FILE": str(self.slow_file(slot)),
            "CHAOS_SLOW_S": str(t.slow_handler_s),
            "CHAOS_TERM_AT_REVOKE_FILE": str(self.term_at_revoke_file(node_id)),
        }

    def slow_file(self, slot: str) -> Path:
        return self.logs / f"slow-{slot}"

    def term_at_revoke_file(self, node_id: str) -> Path:
        """While it exists, the consumer ``node_id`` sends itself SIGTERM at its next
        revocation (chaos/apps.py): a drain that starts during a rebalance."""
        return self.logs / f"term-at-revoke-{node_id}"

    # -- processes -----------------------------------------------------------
    def start(self, slot: str, *, wait: bool = True, kafka_config: str = "") -> Proc:
        """Start ``slot``'s next process. With ``wait``, until it is up (its signal
        handlers installed): one that exits at start because a dependency is down
        (exit 3, ``start-failed``) is started again with backoff, as a pod would be.
        ``kafka_config``: more producer settings for a relay (``k=v,k=v``)."""
        if not wait:
            return self._spawn(slot, kafka_config=kafka_config)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda proc: proc.fate == "start-failed"),
            wait=tenacity.wait_exponential(multiplier=0.5, max=5.0),
            stop=tenacity.stop_after_attempt(START_ATTEMPTS),
            retry_error_callback=self._gave_up,
        )
        proc: Proc = retrying(self._spawn_and_wait, slot, kafka_config)
        return proc

    def _gave_up(self, state: tenacity.RetryCallState) -> Proc:
        """Every start failed: that is no longer an outage, it is reported."""
        assert state.outcome is not None
        proc: Proc = state.outcome.result()
        with self.lock:
            proc.fate = "exited"
            self.unexpected_exits.append(
                {"node_id": proc.node_id, "exit_code": proc.exit_code, "at": time.time(),
                 "tail": proc.tail(8)}
            )  # fmt: skip
        return proc

    def _spawn_and_wait(self, slot: str, kafka_config: str = "") -> Proc:
        proc = self._spawn(slot, fate="starting", kafka_config=kafka_config)
        relay = slot.startswith(("relay", NEIGHBOUR_SLOT))
        started_event = "relay-started" if relay else "partitions-assigned"
        up = proc.wait_for_event(started_event, 60)
        with self.lock:
            if not up and not proc.alive() and self._failed_start(proc):
                proc.fate = "start-failed"
            else:  # up, or slow: supervise() takes it from here
                proc.fate = None
        return proc

    def _failed_start(self, proc: Proc) -> bool:
        """Did ``proc`` exit 3 with ``start-failed`` (a dependency unreachable for its
        whole connect timeout)? Then it is recorded as a start failure."""
        code = proc.wait(5)
        failed = proc.events("start-failed")
        if code != 3 or not failed or failed[-1].get("kind") != "dependency":
            return False
        self.start_failures.append(
            {"node_id": proc.node_id, "at": time.time(), "error": failed[-1].get("error")}
        )
        print(f"[chaos] {proc.node_id} failed to start (exit 3): {failed[-1].get('error')}")
        return True

    def bounded_queue(self) -> str:
        """The producer setting of a relay with a bounded queue (``k=v``)."""
        return f"queue.buffering.max.messages={self.cfg.timings.bounded_queue_messages}"

    def _spawn(self, slot: str, fate: str | None = None, kafka_config: str = "") -> Proc:
        with self.lock:
            if self.closed:
                raise RuntimeError(f"the run is over: {slot} is not started again")
            gen = self._generation.get(slot, -1) + 1
            self._generation[slot] = gen
            node_id = f"{slot}-g{gen}"
            if slot == BOUNDED_SLOT:  # every Kafka fault meets a relay with a small queue
                kafka_config = kafka_config or self.bounded_queue()
            if slot == NEIGHBOUR_SLOT:  # its own role: the run's checks are of the run's outbox
                proc = Proc.start(
                    "neighbour",
                    slot,
                    node_id,
                    ["-m", "outboxkit", "relay"],
                    self.neighbour_env(node_id),
                    self.logs,
                )
            elif slot.startswith("relay"):
                proc = Proc.start(
                    "relay",
                    slot,
                    node_id,
                    ["-m", "outboxkit", "relay"],
                    self.relay_env(node_id, kafka_config),
                    self.logs,
                )
            else:
                proc = Proc.start(
                    "consumer",
                    slot,
                    node_id,
                    ["-m", "outboxkit", "consume", "chaos.apps:EffectConsumer"],
                    self.consumer_env(node_id, slot),
                    self.logs,
                )
            proc.fate = fate
            self.current[slot] = proc
            self.history.append(proc)
        return proc

    def slots(self, role: str) -> list[str]:
        n = self.cfg.relays if role == "relay" else self.cfg.consumers
        return [f"{role}-{i}" for i in range(n)]

    def supervise(self) -> None:
        """Restart a current process that exited on its own (called every second)."""
        with self.lock:
            for slot, proc in list(self.current.items()):
                if proc.fate is None and not proc.alive():
                    if self._failed_start(proc):
                        proc.fate = "start-failed"
                        self.start(slot, wait=False)
                        continue
                    code = proc.wait(1)
                    proc.fate = "exited"
                    self.unexpected_exits.append(
                        {
                            "node_id": proc.node_id,
                            "exit_code": code,
                            "at": time.time(),
                            "tail": proc.tail(8),
                        }
                    )
                    print(
                        f"[chaos] {proc.node_id} exited on its own (code {code}); restarting",
                        flush=True,
                    )
                    self.start(slot, wait=False)

    def stop_all(self, timeout: float = 40.0) -> None:
        with self.lock:
            procs = [p for p in self.current.values() if p.alive()]
            for p in procs:
                p.fate = "term"
                p.stopped_at = time.time()
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
            for p in procs:
                if p.wait(timeout) is None:
                    p.kill()
                    p.exit_code = -9

    def close(self) -> None:
        """The run is over: start nothing more, kill whatever still runs."""
        with self.lock:
            self.closed = True
            procs = [p for p in [*self.history, *self.others] if p.alive()]
        for p in procs:
            p.kill()
