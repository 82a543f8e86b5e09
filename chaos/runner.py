"""One chaos run from start to verdict:

1. start named MariaDB, Kafka, Redis and Toxiproxy on free ports; schema, topic;
2. start the relays, the consumers and the writer; run the fault schedule while
   the writer commits; print progress;
3. settle: wait until every committed row is delivered and consumed;
4. SIGTERM everything (these drains are checked too), read Kafka, the database
   and the logs back, run the checks, print the verdict and the figures;
5. stop and delete the instances (``--keep`` keeps them).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import signal
import sys
import threading
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import tenacity
from support.lifeline import HARNESS_ENV, mark_this_run, reap_orphans

from bench.dblog import log_settings
from chaos.checks import (
    Check,
    KafkaCopy,
    Observed,
    Row,
    faults_before,
    run_checks,
    writer_done,
)
from chaos.cluster import Cluster
from chaos.config import RunConfig, parse_args
from chaos.faults import FaultRecord, Injector
from chaos.fleet import NEIGHBOUR_SLOT, TABLE, Fleet
from chaos.procs import Proc
from chaos.schedule import Fault, make_schedule

RECOVERY_AHEAD = "SELECT detail FROM outboxkit_recovery_events WHERE kind = 'acked-out-of-order'"
RESULTS = Path(__file__).resolve().parent / "results"
TOPIC = "chaos.events"


def say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if not os.environ.get(HARNESS_ENV):  # on its own, not under a test session
        reaped = reap_orphans()
        if reaped:
            say(f"killed {len(reaped)} process(es) a killed earlier run left running")
    mark_this_run()
    schedule = make_schedule(cfg)
    # The database and the process id keep two runs started in the same second
    # (the suite's two smoke runs, on two workers) out of each other's logs.
    kafka = "" if cfg.kafka_brokers == 1 else f"-kafka{cfg.kafka_brokers}"
    run_id = (
        f"{cfg.name}-{cfg.database}{kafka}-{cfg.seed}-{time.strftime('%Y%m%dT%H%M%S')}"
        f"-{os.getpid()}"
    )
    logs = RESULTS / run_id
    logs.mkdir(parents=True, exist_ok=False)
    say(
        f"run {run_id}: seed {cfg.seed} (replay: ./chaos/run.sh"
        f"{'' if cfg.name == 'full' else ' --' + cfg.name} --seed {cfg.seed}"
        f" --database {cfg.database} --ownership {cfg.ownership}"
        f"{'' if cfg.pipeline is None else ' --pipeline' if cfg.pipeline else ' --no-pipeline'}"
        f"{'' if cfg.kafka_brokers == 1 else f' --kafka-brokers {cfg.kafka_brokers}'}"
        f"{'' if cfg.binlog or cfg.database != 'mariadb' else ' --binlog off'})"
    )
    say(
        f"{cfg.events} events, {cfg.keys} keys, {cfg.relays} relays, {cfg.consumers} consumers, "
        f"{cfg.duration_s:.0f} s, {cfg.total_faults} faults; logs in {logs}"
    )
    print("fault schedule:\n" + "\n".join(f"  {f}" for f in schedule), flush=True)
    cluster: Cluster | None = None
    fleet: Fleet | None = None
    # A SIGTERM'd run (a CI timeout, pkill) still stops its processes and its
    # named instances: without this, they outlived it and kept loading the machine.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        database = (
            "PostgreSQL"
            if cfg.database == "postgresql"
            else f"MariaDB (binary log {'on' if cfg.binlog else 'off'})"
        )
        brokers = "Kafka" if cfg.kafka_brokers == 1 else f"a {cfg.kafka_brokers}-node Kafka cluster"
        say(f"starting {database}, {brokers}, Redis and Toxiproxy (named instances)")
        cluster = start_cluster(
            f"chaos{os.getpid()}", logs, cfg.database, cfg.kafka_brokers, binlog=cfg.binlog
        )
        cluster.prepare(TOPIC, cfg.partitions, cfg.shards)
        fleet = Fleet(cfg, cluster, TOPIC, logs)
        return Run(cfg, schedule, cluster, fleet, logs, run_id).go()
    finally:
        if fleet is not None:
            fleet.close()
        if cluster is not None:
            say("stopping the named instances")
            cluster.stop(cfg.keep)


def start_cluster(
    name: str,
    logs: Path,
    database: str = "mariadb",
    kafka_brokers: int = 1,
    *,
    binlog: bool = True,
) -> Cluster:
    """Plan free ports and start the instances. A free port is only free until a
    service binds it: another process (another chaos run, a test) may take it
    meanwhile ("Address already in use"). Then the instances are stopped and
    started again on newly chosen ports, three times at most."""

    def attempt() -> Cluster:
        cluster = Cluster.plan(name, logs, database, kafka_brokers, binlog=binlog)
        try:
            cluster.start()
        except BaseException as exc:
            say(f"the instances did not start ({type(exc).__name__}); new ports")
            cluster.stop(keep=False)
            raise
        return cluster

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(Exception),
        stop=tenacity.stop_after_attempt(3),
        reraise=True,
    )
    return retrying(attempt)


class Run:
    def __init__(
        self,
        cfg: RunConfig,
        schedule: list[Fault],
        cluster: Cluster,
        fleet: Fleet,
        logs: Path,
        run_id: str,
    ) -> None:
        self.cfg, self.schedule, self.cluster, self.fleet = cfg, schedule, cluster, fleet
        self.logs, self.run_id = logs, run_id
        self.injector = Injector(fleet, cluster)
        self.injector.outbox_key()  # read while the database is surely up
        self.done: list[FaultRecord] = []
        self.engine = cluster.engine(statement_timeout_s=30)
        self.neighbour_engine = sa.create_engine(
            cluster.neighbour(cluster.db_url), pool_pre_ping=True
        )

    def go(self) -> int:
        started = time.time()
        for slot in self.fleet.slots("relay") + self.fleet.slots("consumer"):
            self.fleet.start(slot)
        # Another service's outbox on the same server, Redis and prefix: its relay
        # and writer run beside the run's own, through the same faults.
        self.fleet.start(NEIGHBOUR_SLOT)
        neighbour_writer = Proc.start(
            "writer",
            "neighbour-writer",
            "neighbour-writer",
            [
                "-m",
                "chaos.writer",
                self.cluster.neighbour(self.cluster.db_url),
                f"{TOPIC}.neighbour",
                str(self.neighbour_events),
                str(max(1, self.cfg.keys // 10)),
                str(self.cfg.duration_s),
                str(self.cfg.seed + 1),
            ],
            {},
            self.logs,
        )
        self.fleet.others.append(neighbour_writer)
        writer = Proc.start(
            "writer",
            "writer",
            "writer",
            [
                "-m",
                "chaos.writer",
                self.cluster.db_url,
                TOPIC,
                str(self.cfg.events),
                str(self.cfg.keys),
                str(self.cfg.duration_s),
                str(self.cfg.seed),
            ],
            {},
            self.logs,
        )
        self.fleet.others.append(writer)
        t0 = time.monotonic()
        tracks = [
            threading.Thread(
                target=self._run_schedule,
                args=(t0, [f for f in self.schedule if f.track == track]),
                name=f"chaos-{track}",
                daemon=True,
            )
            for track in sorted({f.track for f in self.schedule})
        ]
        for thread in tracks:
            thread.start()
        last = 0.0
        while writer.alive() or any(t.is_alive() for t in tracks):
            self.fleet.supervise()
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                self._progress(t0)
            time.sleep(1)
        writer.wait(5)
        neighbour_writer.wait(60)
        self.done.sort(key=lambda r: r.started)  # the two tracks interleave
        wrote = writer.events("writer-done")
        say(f"writer exited {writer.exit_code}: {wrote[-1] if wrote else writer.tail(5)}")
        settled = self._settle(t0)
        say("stopping relays and consumers (SIGTERM; these drains are checked too)")
        self.fleet.stop_all()
        obs = self._observe()
        checks = [
            writer_done(self.cfg, writer.exit_code, wrote[-1] if wrote else None),
            *run_checks(self.cfg, obs),
            self._neighbour_check(neighbour_writer.exit_code),
        ]
        summary = self._summary(checks, obs, started, settled, writer)
        return self._verdict(checks, summary)

    # -- phases --------------------------------------------------------------
    def _run_schedule(self, t0: float, track: list[Fault]) -> None:
        """One track's faults, one at a time, each at its planned offset or as soon
        as the previous one of the track has ended."""
        for f in track:
            wait = t0 + f.at_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            rec = self.injector.run(f)
            self.done.append(rec)
            took = rec.ended - rec.started
            extra = f" ERROR {rec.error}" if rec.error else ""
            say(
                f"fault {f.seq + 1}/{len(self.schedule)} {f.kind} {f.target} "
                f"({took:.1f} s) {json.dumps(rec.detail)}{extra}"
            )

    @property
    def neighbour_events(self) -> int:
        return max(100, self.cfg.events // 10)

    def _neighbour_counts(self) -> tuple[int, int] | None:
        """(written, delivered) of the neighbour outbox."""
        try:
            with self.neighbour_engine.connect() as conn:
                written, delivered = conn.execute(
                    sa.text(
                        "SELECT COUNT(*),"
                        " COALESCE(SUM(CASE WHEN status = 'delivered' THEN 1 ELSE 0 END), 0)"
                        f" FROM {TABLE}"
                    )
                ).one()
        except sa.exc.SQLAlchemyError:
            return None
        return int(written), int(delivered)

    def _neighbour_check(self, writer_exit: int | None) -> Check:
        """The neighbour outbox, sharing the server, Redis and prefix, was delivered
        whole: no shard of it was held by the run's relays or left to nobody."""
        counts = self._neighbour_counts() or (0, -1)
        in_kafka = {c.event_id for c in read_topic(self.cluster.bootstrap, f"{TOPIC}.neighbour")}
        written, delivered = counts
        ok = writer_exit == 0 and written == self.neighbour_events == delivered
        ok = ok and len(in_kafka) == written
        return Check(
            "neighbour outbox delivered",
            ok,
            f"neighbour writer exited {writer_exit}; {delivered} of {written} rows delivered "
            f"({self.neighbour_events} planned), {len(in_kafka)} distinct events in Kafka",
            [] if ok else ["see neighbour-writer.log and the neighbour-0 relay logs"],
            figures={"written": written, "delivered": delivered, "in_kafka": len(in_kafka)},
        )

    def _counts(self) -> dict[str, int] | None:
        try:
            with self.engine.connect() as conn:
                written, delivered = conn.execute(
                    sa.text(
                        "SELECT COUNT(*),"
                        " COALESCE(SUM(CASE WHEN status = 'delivered' THEN 1 ELSE 0 END), 0)"
                        f" FROM {TABLE}"
                    )
                ).one()
                consumed = conn.execute(sa.text("SELECT COUNT(*) FROM chaos_effects")).scalar_one()
        except sa.exc.SQLAlchemyError:
            return None
        return {"written": int(written), "delivered": int(delivered), "consumed": int(consumed)}

    def _progress(self, t0: float) -> None:
        c = self._counts()
        kinds = Counter(r.fault.kind for r in self.done)
        live = sum(p.alive() for p in self.fleet.current.values())
        counts = (
            "database unreachable"
            if c is None
            else f"written {c['written']}, delivered {c['delivered']}, consumed {c['consumed']}"
        )
        say(
            f"t+{time.monotonic() - t0:.0f}s {counts}; faults {len(self.done)}/"
            f"{len(self.schedule)} {dict(kinds)}; {live} processes up"
        )

    def _settle(self, t0: float) -> float:
        """Wait until every committed row is delivered and has an effect."""
        say("writer and schedule done; settling (every row delivered and consumed)")
        deadline = time.monotonic() + self.cfg.settle_timeout_s
        began = time.monotonic()
        last = 0.0
        while time.monotonic() < deadline:
            self.fleet.supervise()
            c = self._counts()
            if c is not None:
                with self.engine.connect() as conn:
                    distinct = conn.execute(
                        sa.text("SELECT COUNT(DISTINCT event_id) FROM chaos_effects")
                    ).scalar_one()
                n = self._neighbour_counts()
                neighbour_done = n is not None and n[0] == n[1]
                if c["delivered"] == c["written"] and distinct >= c["written"] and neighbour_done:
                    # a lease TTL more, so anything late would show
                    time.sleep(self.cfg.timings.lease_ttl_s)
                    say(f"settled in {time.monotonic() - began:.0f} s")
                    return time.monotonic() - began
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                self._progress(t0)
            time.sleep(1)
        say(f"did not settle in {self.cfg.settle_timeout_s:.0f} s; checking what is there")
        return time.monotonic() - began

    # -- reading back ----------------------------------------------------------
    def _observe(self) -> Observed:
        say("reading back the outbox, the effects and Kafka")
        with self.engine.connect() as conn:
            rows = [
                Row(
                    int(i),
                    str(e),
                    (k or b"").decode(),
                    int(sh),
                    str(s),
                    int(a),
                    epoch(c),
                    epoch(d) if d is not None else None,
                )
                for i, e, k, sh, s, a, c, d in conn.execute(
                    sa.text(
                        "SELECT id, event_id, message_key, shard, status, attempts, created_at,"
                        f" delivered_at FROM {TABLE} ORDER BY id"
                    )
                )
            ]
            effects: Counter[str] = Counter(
                str(e) for (e,) in conn.execute(sa.text("SELECT event_id FROM chaos_effects"))
            )
            offsets = self._processed_at_commit(conn)
            ahead: set[int] = set()
            for (detail,) in conn.execute(sa.text(RECOVERY_AHEAD)):
                ahead.update(int(r["row_id"]) for r in json.loads(detail).get("rows", []))
        copies = read_topic(self.cluster.bootstrap, TOPIC)
        dlq = len(read_topic(self.cluster.bootstrap, f"{TOPIC}.dlq"))
        relays = [p for p in self.fleet.history if p.role == "relay"]
        consumers = [p for p in self.fleet.history if p.role == "consumer"]
        return Observed(
            rows,
            copies,
            effects,
            relays,
            consumers,
            self.done,
            self.injector.lease_ends,
            ahead,
            self.fleet.unexpected_exits,
            dlq,
            offsets,
        )

    def _processed_at_commit(self, conn: sa.Connection) -> set[tuple[str, int, int]]:
        """(node, partition, offset) for each drained consumer whose exit commit
        stopped at an offset whose effect that consumer had written since it was
        last assigned the partition: it processed the message and did not commit
        it. (With several workers a later offset may finish before an earlier
        one, so only the committed offset itself is evidence.)"""
        out: set[tuple[str, int, int]] = set()
        for p in self.fleet.history:
            if p.role != "consumer" or p.fate != "term":
                continue
            since: dict[int, str] = {}
            for r in p.read_records():
                if r.get("event") == "partitions-assigned":
                    for tp in r.get("partitions", []):
                        since[int(str(tp).rsplit("/", 1)[1])] = str(r["ts"])
            exits = p.events("consumer-exit")
            committed = (exits[-1].get("committed") or {}) if exits else {}
            for tp, offset in committed.items():
                partition = int(str(tp).rsplit("/", 1)[1])
                if partition not in since:
                    continue
                hit = conn.execute(
                    sa.text(
                        "SELECT COUNT(*) FROM chaos_effects WHERE node_id = :n"
                        " AND kafka_partition = :p AND kafka_offset = :o AND at >= :since"
                    ),
                    {
                        "n": p.node_id,
                        "p": partition,
                        "o": int(offset),
                        "since": dt.datetime.strptime(since[partition], "%Y-%m-%dT%H:%M:%S.%fZ"),
                    },
                ).scalar_one()
                if hit:
                    out.add((p.node_id, partition, int(offset)))
        return out

    # -- verdict ---------------------------------------------------------------
    def _summary(
        self, checks: list[Check], obs: Observed, started: float, settled: float, writer: Proc
    ) -> dict[str, Any]:
        kinds = Counter(r.fault.kind for r in self.done)
        errors = [f"#{r.fault.seq} {r.fault.kind}: {r.error}" for r in self.done if r.error]
        summary = {
            "run_id": self.run_id,
            "seed": self.cfg.seed,
            "size": self.cfg.name,
            "config": self.cfg.describe(),
            "events": len(obs.rows),
            "kafka_copies": len(obs.copies),
            "faults": dict(sorted(kinds.items())),
            "faults_total": len(self.done),
            "fault_errors": errors,
            "unexpected_exits": [
                {k: v for k, v in e.items() if k != "tail"} for e in obs.unexpected_exits
            ],
            "start_failures": self.fleet.start_failures,
            "checks": {c.name: {"ok": c.ok, "summary": c.summary, **c.figures} for c in checks},
            "ok": all(c.ok for c in checks),
            "wall_s": round(time.time() - started, 1),
            "settle_s": round(settled, 1),
            "writer": (writer.events("writer-done") or [{}])[-1],
            "versions": versions(self.engine),
            # What the server really logged (the configuration asked is in "config").
            "database_log": log_settings(self.engine),
            "finished": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        text = json.dumps(summary, indent=2, default=str)
        (self.logs / "summary.json").write_text(text)
        (RESULTS / "latest.json").write_text(text)
        (self.logs / "lease_ends.json").write_text(json.dumps(obs.lease_ends, indent=1))
        (self.logs / "faults.txt").write_text(
            "\n".join(
                f"{r.fault} started {r.started:.3f} ended {r.ended:.3f} {json.dumps(r.detail)}"
                f"{' ERROR ' + r.error if r.error else ''}"
                for r in self.done
            )
            + "\n"
        )
        return summary

    def _verdict(self, checks: list[Check], summary: dict[str, Any]) -> int:
        print("\n==== chaos verdict ====", flush=True)
        print(
            f"run {self.run_id}  seed {self.cfg.seed}  "
            f"events {summary['events']}  faults {summary['faults_total']} {summary['faults']}"
        )
        for c in checks:
            print(f"  [{'PASS' if c.ok else 'FAIL'}] {c.name}: {c.summary}")
        if summary["fault_errors"]:
            print("  fault errors: " + "; ".join(summary["fault_errors"]))
        if summary["unexpected_exits"]:
            print(f"  unexpected exits: {summary['unexpected_exits']}")
        for c in checks:
            if c.ok:
                continue
            print(f"\n---- FAILED: {c.name} (seed {self.cfg.seed}) ----")
            for line in c.evidence:
                print(f"  {line}")
            print("  fault schedule up to the failure (wall clock):")
            for r in faults_before(self.done, c.first_at):
                print(f"    {r.fault}  at {r.started:.3f}-{r.ended:.3f} {json.dumps(r.detail)}")
        print("\n" + markdown_table(summary))
        print(f"\nsummary: {self.logs / 'summary.json'}")
        print(
            f"CHAOS RESULT: {'PASS' if summary['ok'] else 'FAIL'} seed={self.cfg.seed}", flush=True
        )
        return 0 if summary["ok"] else 1


def _kafka_figure(brokers: int) -> str:
    if brokers == 1:
        return "one broker"
    return f"{brokers}-node KRaft cluster, replication factor {brokers}, min.insync.replicas 2"


def _database_figure(cfg: dict[str, Any]) -> str:
    if cfg.get("database", "mariadb") == "postgresql":
        return "PostgreSQL"
    # Runs before the setting existed ran with the binary log off.
    return "MariaDB, binary log " + ("on (ROW, FULL images)" if cfg.get("binlog") else "off")


def markdown_table(s: dict[str, Any]) -> str:
    """The figures of a run as the table in docs/reliability.md."""
    c = s["checks"]
    lost, order, dup = c["nothing lost"], c["per-key order"], c["duplicates accounted for"]
    stuck, drains, owners = c["nothing stuck"], c["drains clean"], c["no overlapping shard owners"]
    cfg = s["config"]
    by_cause = ", ".join(f"{k} {v}" for k, v in sorted(dup["by_cause"].items())) or "none"
    kinds = ", ".join(f"{k} {v}" for k, v in s["faults"].items())
    rows = [
        ("run", f"{s['size']}, seed {s['seed']}, {s['finished']}, {s['wall_s']:.0f} s wall"),
        ("events / keys", f"{s['events']:,} / {cfg['keys']:,}"),
        ("relays / consumers", f"{cfg['relays']} / {cfg['consumers']}"),
        ("database", _database_figure(cfg)),
        ("Kafka", _kafka_figure(cfg.get("kafka_brokers", 1))),
        ("faults", f"{s['faults_total']}: {kinds}"),
        ("lost (Kafka / effect)", f"{lost['lost_kafka']} / {lost['lost_effect']}"),
        ("effects applied twice", str(lost["effect_twice"])),
        ("duplicate copies in Kafka", f"{dup['duplicates']} ({by_cause})"),
        ("reorders reported (acked-out-of-order)", str(order["reported_reorders"])),
        ("unreported reorders", str(order["unreported_reorders"])),
        ("stuck / failed rows", f"{stuck['stuck']} / {stuck['failed']}"),
        (
            "drains (relay / consumer), unclean",
            f"{drains['relay_drains']} / {drains['consumer_drains']}, {drains['unclean']}",
        ),
        ("overlapping shard owners", f"{owners['overlaps']} of {owners['intervals']} intervals"),
        ("longest commit-to-delivered", f"{stuck['longest_blocked_s']} s"),
        ("unexpected process exits", str(len(s["unexpected_exits"]))),
        (
            "starts failed on a dependency outage (exit 3), restarted",
            str(len(s.get("start_failures", []))),
        ),
        ("verdict", "PASS" if s["ok"] else "FAIL"),
    ]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def epoch(d: dt.datetime) -> float:
    """A naive UTC datetime from the database as a Unix time."""
    return d.replace(tzinfo=dt.UTC).timestamp()


def read_topic(bootstrap: str, topic: str) -> list[KafkaCopy]:
    """Every record of ``topic`` up to the high watermarks seen at the start."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"chaos-check-{os.getpid()}",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    out: list[KafkaCopy] = []
    try:
        md = consumer.list_topics(topic, timeout=30)
        parts = sorted(md.topics[topic].partitions)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in parts
        }
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        pos = dict.fromkeys(parts, 0)
        deadline = time.monotonic() + 600
        while any(pos[p] < ends[p] for p in parts) and time.monotonic() < deadline:
            for m in consumer.consume(1000, timeout=1.0):
                if m.error():
                    continue
                p, off = int(m.partition() or 0), int(m.offset() or 0)
                pos[p] = off + 1
                headers = dict(m.headers() or [])
                key, event_id = m.key() or b"", headers.get("event_id") or b""
                out.append(
                    KafkaCopy(
                        p,
                        off,
                        key.decode() if isinstance(key, bytes) else key,
                        event_id.decode() if isinstance(event_id, bytes) else event_id,
                        m.timestamp()[1] / 1000,
                    )
                )
    finally:
        consumer.close()
    return out


def versions(engine: sa.Engine) -> dict[str, str]:
    out = {"outboxkit": version("outboxkit"), "python": platform.python_version()}
    try:
        import confluent_kafka

        out["confluent-kafka"] = version("confluent-kafka")
        out["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        pass
    with engine.connect() as conn:
        out[engine.dialect.name] = str(conn.execute(sa.text("SELECT VERSION()")).scalar_one())
    out["kafka"] = "4.4.0 (deploy/local/kafka/pom.xml)"
    import subprocess

    out["redis"] = (
        subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        .stdout.split()[2]
        .removeprefix("v=")
    )
    out["toxiproxy"] = os.environ.get("TOXIPROXY_VERSION", "v2.12.0")
    return out


if __name__ == "__main__":
    sys.exit(main())
