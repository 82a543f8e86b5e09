"""The run's own named service instances and the Toxiproxy in front of them.

The database (MariaDB or PostgreSQL), Kafka and Redis are named instances of
``deploy/local/*.sh`` on ports the OS hands out, so killing them disturbs
nothing else on the machine. The
relays reach all three through Toxiproxy (network faults touch only them);
the writer, the consumers and the checks connect directly. Kafka has a second
listener whose advertised port is the proxy's, so a relay that bootstraps
through the proxy stays behind it.

With ``--kafka-brokers 3`` Kafka is a three-node KRaft cluster
(``deploy/local/kafka-cluster.sh``: replication factor 3, ``min.insync.replicas``
2, unclean leader election off), each node behind a proxy of its own
(``kafka-1`` .. ``kafka-3``); a network fault on ``kafka`` hits all three.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis as redis_lib
import sqlalchemy as sa
from support.cluster import (
    NODES,
    KafkaCluster,
    _read_uvarint,
    _recv_exactly,
    _uvarint,
    first_free_run,
)
from support.services import (
    STATE_DIR,
    KafkaInstance,
    MariaDBInstance,
    PostgresInstance,
    RedisInstance,
    free_ports,
)

from chaos.apps import create_effect_table
from outboxkit.schema import apply_schema

HERE = Path(__file__).resolve().parent
RELAY_DB_USER = "chaos_relay"
#: The neighbour outbox: another service's ``outbox_events`` on the same server
#: (a database of its own on MariaDB, a schema of its own on PostgreSQL) whose
#: relay shares the run's Redis and prefix. Its rows must all be delivered and
#: the run's own must be unaffected: every shared name carries the outbox.
NEIGHBOUR = "outboxkit_neighbour"


class Toxiproxy:
    """The Toxiproxy server, driven over its HTTP API with the standard library."""

    def __init__(self, port: int, logs: Path) -> None:
        self.port = port
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = subprocess.run(
            [str(HERE / "toxiproxy.sh")], check=True, capture_output=True, text=True
        ).stdout.strip()
        log = (self.logs / "toxiproxy.log").open("ab")
        self.proc = subprocess.Popen(
            [binary, "-host", "127.0.0.1", "-port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                self._call("GET", "/version")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (our http:// URL)
            raw = resp.read()
        return json.loads(raw) if raw else None

    def proxy(self, name: str, listen: int, upstream: int) -> None:
        self._call(
            "POST",
            "/proxies",
            {
                "name": name,
                "listen": f"127.0.0.1:{listen}",
                "upstream": f"127.0.0.1:{upstream}",
                "enabled": True,
            },
        )

    def add_toxic(self, proxy: str, toxic: str, kind: str, attributes: dict[str, int]) -> None:
        for stream in ("downstream", "upstream"):
            self._call(
                "POST",
                f"/proxies/{proxy}/toxics",
                {
                    "name": f"{toxic}-{stream}",
                    "type": kind,
                    "stream": stream,
                    "toxicity": 1.0,
                    "attributes": attributes,
                },
            )

    def remove_toxic(self, proxy: str, toxic: str) -> None:
        for stream in ("downstream", "upstream"):
            with contextlib.suppress(OSError):
                self._call("DELETE", f"/proxies/{proxy}/toxics/{toxic}-{stream}")


@dataclass
class Cluster:
    name: str
    logs: Path
    db: MariaDBInstance | PostgresInstance
    #: one broker, or (``--kafka-brokers 3``) the three-node cluster
    kafka: KafkaInstance | KafkaCluster
    redis: RedisInstance
    toxiproxy: Toxiproxy
    #: Toxiproxy's listening port of each proxy ("db", "redis", "kafka" or
    #: "kafka-1".."kafka-3") and its upstream
    proxy_ports: dict[str, int]
    upstreams: dict[str, int]

    @classmethod
    def plan(
        cls,
        name: str,
        logs: Path,
        database: str = "mariadb",
        kafka_brokers: int = 1,
        *,
        binlog: bool = True,
    ) -> Cluster:
        kafka: KafkaInstance | KafkaCluster
        if kafka_brokers == 1:
            (db, port, controller, proxied, rds, toxi, p_db, p_kafka, p_redis) = free_ports(9)
            kafka = KafkaInstance(
                f"{name}-kafka",
                port,
                controller,
                proxied_port=proxied,
                proxied_advertised_port=p_kafka,
            )
            kafka_proxies = {"kafka": (p_kafka, proxied)}
        else:
            # brokers and controllers on 6 ports, then the proxied listeners and
            # the proxies in front of them on 6 more
            run = first_free_run(4 * NODES)
            taken = range(run, run + 4 * NODES)
            db, rds, toxi, p_db, p_redis = [p for p in free_ports(20) if p not in taken][:5]
            kafka = KafkaCluster(f"{name}-kafka", run, proxied_port=run + 2 * NODES)
            kafka_proxies = {
                f"kafka-{k}": (run + 3 * NODES + k - 1, run + 2 * NODES + k - 1)
                for k in range(1, NODES + 1)
            }
        db_instance = (
            PostgresInstance(f"{name}-db", db)
            if database == "postgresql"
            else MariaDBInstance(f"{name}-db", db, binlog=binlog)
        )
        redis = RedisInstance(f"{name}-redis", rds)
        proxies = {
            "db": (p_db, db_instance.port),
            "redis": (p_redis, redis.port),
            **kafka_proxies,
        }
        return cls(
            name=name,
            logs=logs,
            db=db_instance,
            kafka=kafka,
            redis=redis,
            toxiproxy=Toxiproxy(toxi, logs),
            proxy_ports={n: listen for n, (listen, _) in proxies.items()},
            upstreams={n: up for n, (_, up) in proxies.items()},
        )

    @property
    def brokers(self) -> int:
        return NODES if isinstance(self.kafka, KafkaCluster) else 1

    def proxies(self, target: str) -> list[str]:
        """The Toxiproxy proxies a network fault on ``target`` (db, kafka, redis) hits."""
        return sorted(n for n in self.proxy_ports if n.split("-")[0] == target)

    def kafka_nodes(self) -> list[KafkaInstance]:
        """Every Kafka process of the run (one broker, or the cluster's nodes)."""
        if isinstance(self.kafka, KafkaCluster):
            return list(self.kafka.nodes.values())
        return [self.kafka]

    # -- addresses -----------------------------------------------------------
    @property
    def db_url(self) -> str:
        return self.db.url

    @property
    def postgresql(self) -> bool:
        return isinstance(self.db, PostgresInstance)

    @property
    def relay_db_url(self) -> str:
        pw = RELAY_DB_USER
        driver = "postgresql+psycopg" if self.postgresql else "mysql+pymysql"
        return f"{driver}://{RELAY_DB_USER}:{pw}@127.0.0.1:{self.proxy_ports['db']}/outboxkit_test"

    def neighbour(self, url: str) -> str:
        """``url`` (the run's database) pointed at the neighbour outbox."""
        u = sa.make_url(url)
        if self.postgresql:
            u = u.update_query_dict({"options": f"-csearch_path={NEIGHBOUR}"})
        else:
            u = u.set(database=NEIGHBOUR)
        return u.render_as_string(hide_password=False)

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    @property
    def relay_bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.proxy_ports[n]}" for n in self.proxies("kafka"))

    @property
    def relay_redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.proxy_ports['redis']}/0"

    # -- life cycle ----------------------------------------------------------
    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.toxiproxy.start()
        errors: list[BaseException] = []

        def up(instance: Any) -> None:
            try:
                instance.start(fresh=True)
            except BaseException as exc:  # reported below
                errors.append(exc)

        def up_kafka(kafka: KafkaCluster) -> None:
            try:
                kafka.start()  # a fresh cluster: the run's name is new
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=up, args=(i,)) for i in (self.db, self.redis)]
        threads.append(
            threading.Thread(target=up_kafka, args=(self.kafka,))
            if isinstance(self.kafka, KafkaCluster)
            else threading.Thread(target=up, args=(self.kafka,))
        )
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for proxy, listen in self.proxy_ports.items():
            self.toxiproxy.proxy(proxy, listen, self.upstreams[proxy])

    def kafka_kill(self) -> None:
        """SIGKILL every Kafka process."""
        for node in self.kafka_nodes():
            node.kill()

    def kafka_start(self) -> None:
        """Start whatever Kafka process is down (a cluster's nodes together: a node
        answers only once a quorum of controllers is up)."""
        self.kafka.start()

    def prepare(self, topic: str, partitions: int, shards: int) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        engine = self.engine()
        with engine.begin() as conn:
            if not self.postgresql:
                conn.execute(
                    sa.text(
                        f"CREATE USER IF NOT EXISTS '{RELAY_DB_USER}'@'127.0.0.1' "
                        f"IDENTIFIED BY '{RELAY_DB_USER}'"
                    )
                )
                conn.execute(
                    sa.text(f"GRANT ALL ON outboxkit_test.* TO '{RELAY_DB_USER}'@'127.0.0.1'")
                )
            create_effect_table(conn)
            if self.postgresql:
                conn.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {NEIGHBOUR}"))
            else:
                conn.execute(sa.text(f"CREATE DATABASE IF NOT EXISTS {NEIGHBOUR}"))
                conn.execute(
                    sa.text(f"GRANT ALL ON {NEIGHBOUR}.* TO '{RELAY_DB_USER}'@'127.0.0.1'")
                )
        apply_schema(engine, shards=shards)
        engine.dispose()
        neighbour = sa.create_engine(self.neighbour(self.db_url))
        apply_schema(neighbour, shards=shards, inbox=None)
        neighbour.dispose()
        if self.postgresql:
            # outboxkit may not create roles; the instance's superuser does.
            su = self.superuser_engine()
            with su.begin() as conn:
                conn.execute(
                    sa.text(f"CREATE ROLE {RELAY_DB_USER} LOGIN PASSWORD '{RELAY_DB_USER}'")
                )
            su.dispose()
            su = self.superuser_engine("outboxkit_test")
            with su.begin() as conn:
                conn.execute(sa.text(f"GRANT USAGE ON SCHEMA {NEIGHBOUR} TO {RELAY_DB_USER}"))
                for what in ("TABLES", "SEQUENCES", "FUNCTIONS"):
                    for schema in ("public", NEIGHBOUR):
                        conn.execute(
                            sa.text(
                                f"GRANT ALL ON ALL {what} IN SCHEMA {schema} TO {RELAY_DB_USER}"
                            )
                        )
            su.dispose()
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        rf = self.brokers  # and min.insync.replicas 2 on the cluster (its default)
        futures = admin.create_topics(
            [
                NewTopic(topic, num_partitions=partitions, replication_factor=rf),
                NewTopic(f"{topic}.dlq", num_partitions=1, replication_factor=rf),
                NewTopic(f"{topic}.neighbour", num_partitions=partitions, replication_factor=rf),
            ]
        )
        for f in futures.values():
            f.result(30)
        del admin  # its background threads would log every broker kill on stderr

    def engine(self, statement_timeout_s: float | None = None) -> sa.Engine:
        """An engine on the run's database as its owner (not through the proxy).
        ``statement_timeout_s``: give up on a read that hangs that long."""
        connect_args: dict[str, object] = {}
        if statement_timeout_s is not None:
            if self.postgresql:
                ms = int(statement_timeout_s * 1000)
                connect_args = {"connect_timeout": 10, "options": f"-c statement_timeout={ms}"}
            else:
                connect_args = {"read_timeout": int(statement_timeout_s)}
        return sa.create_engine(self.db_url, pool_pre_ping=True, connect_args=connect_args)

    def superuser_engine(self, database: str = "postgres") -> sa.Engine:
        """PostgreSQL's superuser through the instance's own unix socket (no password:
        the socket is reachable by the server's user and root only)."""
        assert isinstance(self.db, PostgresInstance)
        socket_dir = self.db.state_dir / "run"
        return sa.create_engine(
            f"postgresql+psycopg://postgres@/{database}?host={socket_dir}&port={self.db.port}",
            pool_pre_ping=True,
        )

    def redis_client(self) -> redis_lib.Redis[bytes]:
        return redis_lib.Redis.from_url(self.redis.url, socket_timeout=5)

    def stop(self, keep: bool) -> None:
        if isinstance(self.kafka, KafkaCluster):
            with contextlib.suppress(Exception):
                self.kafka.stop() if keep else self.kafka.destroy()
        for instance in (self.db, self.redis) + (
            () if isinstance(self.kafka, KafkaCluster) else (self.kafka,)
        ):
            with contextlib.suppress(Exception):
                instance.stop()
            if not keep:
                shutil.rmtree(STATE_DIR / f"{instance.service}-{instance.name}", ignore_errors=True)
        self.toxiproxy.stop()


def reassign_replicas(port: int, topic: str, partition: int, replicas: Sequence[int]) -> None:
    """Move ``topic[partition]`` onto ``replicas`` (the first one preferred leader)
    with an AlterPartitionReassignments v0 request (API key 45, a flexible version)
    to the broker on ``port``, which forwards it to the active controller (the
    Python client has no call for it, and the local Kafka has no tools jar).
    Returns once the controller accepted it; the move itself completes when the
    new replicas caught up (watch the partition's metadata). Raises on an error."""
    client, name = b"outboxkit-chaos", topic.encode()
    header = struct.pack(">hhih", 45, 0, 1, len(client)) + client + _uvarint(0)
    body = (
        struct.pack(">i", 30_000)  # timeout_ms
        + _uvarint(2)  # one topic
        + _uvarint(len(name) + 1)
        + name
        + _uvarint(2)  # one partition
        + struct.pack(">i", partition)
        + _uvarint(len(replicas) + 1)
        + b"".join(struct.pack(">i", r) for r in replicas)
        + _uvarint(0)  # partition's tagged fields
        + _uvarint(0)  # topic's tagged fields
        + _uvarint(0)  # request's tagged fields
    )
    request = header + body
    with socket.create_connection(("127.0.0.1", port), timeout=35) as sock:
        sock.settimeout(35)
        sock.sendall(struct.pack(">i", len(request)) + request)
        size = struct.unpack(">i", _recv_exactly(sock, 4))[0]
        buf = _recv_exactly(sock, size)
    _, i = _read_uvarint(buf, 4)  # after the correlation id: the header's tagged fields
    (error,) = struct.unpack_from(">h", buf, i + 4)  # after throttle_time_ms
    message, i = _compact_string(buf, i + 6)
    if error:
        raise RuntimeError(f"AlterPartitionReassignments: error {error} {message}")
    _, i = _read_uvarint(buf, i)  # responses
    _, i = _compact_string(buf, i)  # topic name
    _, i = _read_uvarint(buf, i)  # partitions
    _, part_error = struct.unpack_from(">ih", buf, i)
    part_message, _ = _compact_string(buf, i + 6)
    if part_error:
        raise RuntimeError(
            f"AlterPartitionReassignments {topic}[{partition}] -> {list(replicas)}: "
            f"error {part_error} {part_message}"
        )


def _compact_string(buf: bytes, i: int) -> tuple[str | None, int]:
    n, i = _read_uvarint(buf, i)
    if n == 0:
        return None, i
    return buf[i : i + n - 1].decode(), i + n - 1
