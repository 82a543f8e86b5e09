"""A local three-node Kafka cluster for the cluster tests (``deploy/local/kafka-cluster.sh``).

Three combined broker+controller nodes, replication factor 3 and
``min.insync.replicas=2`` by default, unclean leader election off. Node ``k``
(1..3) is a :class:`~support.services.KafkaInstance` named ``<name>-<k>``, so
each node is stopped (SIGTERM), killed (SIGKILL), frozen (SIGSTOP) and resumed
on its own::

    with KafkaCluster("c1", first_free_run(6)) as cluster:
        topic = cluster.create_topic("t", partitions=3)
        leader = cluster.leader(topic, 0)
        cluster.node(leader).kill()
        cluster.restore()            # every node up again, every ISR full

Cluster state (leaders, ISRs, the group coordinator) is read with fresh
clients bootstrapped only to the nodes that are not down or frozen: a client
that knows a frozen node may send its request there and wait for nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from support.services import LOCAL_DIR, SCRIPT_TIMEOUT_S, STATE_DIR, KafkaInstance, port_block
from support.waiting import wait_for

__all__ = ["KafkaCluster", "Partition", "first_free_run", "shared_cluster"]

NODES = 3


@dataclass(frozen=True)
class Partition:
    """One partition as the cluster's metadata shows it."""

    id: int
    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


def first_free_run(count: int) -> int:
    """The first of ``count`` consecutive free ports in this process's block."""

    block = port_block()
    start = block.start + (os.getpid() * 7) % max(1, len(block) - count)
    for base in [*range(start, block.stop - count), *range(block.start, start)]:
        ok = True
        for port in range(base, base + count):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return int(base)
    raise RuntimeError(f"no {count} consecutive free ports in {block.start}-{block.stop - 1}")


class ClusterNode(KafkaInstance):
    """One node of a cluster: started again with the cluster's flags, never as a
    broker of its own (even when its state folder is gone)."""

    def __init__(
        self,
        name: str,
        port: int,
        controller_port: int,
        cluster_args: list[str],
        *,
        proxied_port: int | None = None,
        proxied_advertised_port: int | None = None,
    ) -> None:
        super().__init__(
            name,
            port,
            controller_port,
            proxied_port=proxied_port,
            proxied_advertised_port=proxied_advertised_port,
        )
        self.cluster_args = cluster_args

    def _extra_args(self) -> list[str]:
        return [*super()._extra_args(), *self.cluster_args]


class KafkaCluster:
    """Three KRaft nodes on ``port``..``port+5`` (brokers on the first three).

    ``proxied_port`` Q: node ``k`` also listens on Q+k-1 and advertises Q+3+k-1
    there, where a TCP proxy in front of it keeps its clients behind the proxies
    (:attr:`proxied_bootstrap`; see ``deploy/local/kafka-cluster.sh``)."""

    def __init__(
        self,
        name: str,
        port: int,
        *,
        heap: str = "320m",
        replica_lag_ms: int = 4000,
        proxied_port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.heap = heap
        self.replica_lag_ms = replica_lag_ms
        self.proxied_port = proxied_port
        voters = ",".join(f"{k}@127.0.0.1:{port + NODES + k - 1}" for k in range(1, NODES + 1))
        self.nodes = {
            k: ClusterNode(
                f"{name}-{k}",
                port + k - 1,
                port + NODES + k - 1,
                cluster_args=[
                    *("--node-id", str(k), "--voters", voters, "--replication", str(NODES)),
                    *("--min-isr", "2", "--replica-lag-ms", str(replica_lag_ms), "--heap", heap),
                ],
                proxied_port=None if proxied_port is None else proxied_port + k - 1,
                proxied_advertised_port=(
                    None if proxied_port is None else proxied_port + NODES + k - 1
                ),
            )
            for k in range(1, NODES + 1)
        }
        #: Nodes a test froze (SIGSTOP) and has not resumed: never asked anything.
        self.frozen: set[int] = set()

    # -- lifecycle ---------------------------------------------------------
    def _script(self, command: str, *extra: str) -> None:
        args = [
            str(LOCAL_DIR / "kafka-cluster.sh"),
            command,
            "--name",
            self.name,
            "--port",
            str(self.port),
            "--heap",
            self.heap,
            "--replica-lag-ms",
            str(self.replica_lag_ms),
            *(() if self.proxied_port is None else ("--proxied-port", str(self.proxied_port))),
            *extra,
        ]
        proc = subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kafka-cluster.sh {command} {self.name}: {proc.stderr}")

    def start(self) -> Self:
        self._script("start")
        return self

    def stop(self) -> None:
        for k in list(self.frozen):
            self.resume(k)
        self._script("stop")

    def destroy(self) -> None:
        """Stop every node and delete the cluster's state (data, logs)."""
        self.stop()
        for k in self.nodes:
            shutil.rmtree(self.nodes[k].state_dir, ignore_errors=True)
        shutil.rmtree(STATE_DIR / f"kafka-cluster-{self.name}", ignore_errors=True)
        (STATE_DIR / f"kafka-cluster-{self.name}.tests.lock").unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the cluster alone (a file lock shared by every process of the run)."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        with _locked(STATE_DIR / f"kafka-cluster-{self.name}.tests.lock"):
            yield

    def node(self, k: int) -> KafkaInstance:
        return self.nodes[k]

    def freeze(self, k: int) -> None:
        """SIGSTOP node ``k``: its sockets stay open, it answers nothing."""
        self.frozen.add(k)
        self.nodes[k].pause()

    def resume(self, k: int) -> None:
        self.nodes[k].resume()
        self.frozen.discard(k)

    def restart(self, k: int, *, hard: bool = False) -> None:
        """Stop node ``k`` (SIGTERM, or SIGKILL with ``hard``) and start it again."""
        node = self.nodes[k]
        node.kill() if hard else node.stop()
        node.start()

    def restore(self, topics: Sequence[str] = ()) -> None:
        """Every node running and answering, and every partition of ``topics``
        (and of the offsets topic) with its full ISR: what a test that broke
        a node leaves behind for the next one."""
        for k in list(self.frozen):
            self.resume(k)
        for node in self.nodes.values():
            node.resume()  # a node frozen outside freeze()
            node.start()  # no-op when it answers
        self.wait_full_isr(topics)

    # -- addresses and clients ---------------------------------------------
    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes.values())

    @property
    def proxied_bootstrap(self) -> str:
        """The proxies' addresses (see the class); only with ``proxied_port``."""
        assert self.proxied_port is not None, "started without proxied_port"
        return ",".join(f"127.0.0.1:{self.proxied_port + NODES + k - 1}" for k in self.nodes)

    def up_bootstrap(self, exclude: Sequence[int] = ()) -> str:
        """Bootstrap list without frozen nodes and ``exclude``."""
        skip = self.frozen | set(exclude)
        return ",".join(n.bootstrap for k, n in self.nodes.items() if k not in skip)

    @contextlib.contextmanager
    def admin(self, exclude: Sequence[int] = ()) -> Iterator[Any]:
        from confluent_kafka.admin import AdminClient

        yield AdminClient({"bootstrap.servers": self.up_bootstrap(exclude), "log_level": 0})

    # -- state ---------------------------------------------------------------
    def partitions(self, topic: str, exclude: Sequence[int] = ()) -> dict[int, Partition]:
        """The topic's partitions from a fresh client's metadata request ({} if
        no node answered in time or the topic does not exist)."""
        from confluent_kafka import KafkaException, Producer

        client = Producer({"bootstrap.servers": self.up_bootstrap(exclude), "log_level": 0})
        try:
            md = client.list_topics(topic, timeout=5)
        except KafkaException:
            return {}
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            return {}
        return {
            p.id: Partition(p.id, p.leader, tuple(p.replicas), tuple(p.isrs))
            for p in meta.partitions.values()
        }

    def leader(self, topic: str, partition: int) -> int:
        found = wait_for(
            lambda: (p := self.partitions(topic).get(partition)) and p.leader > 0 and p.leader,
            timeout=30,
            what=f"a leader for {topic}[{partition}]",
        )
        assert isinstance(found, int)
        return found

    def wait_full_isr(self, topics: Sequence[str] = (), timeout: float = 60) -> None:
        """Wait until every node is a live broker and every partition of
        ``topics`` and ``__consumer_offsets`` has all its replicas in sync."""

        def full() -> bool:
            for topic in ["__consumer_offsets", *topics]:
                parts = self.partitions(topic)
                if not parts and topic == "__consumer_offsets":
                    # Created with the first consumer group; every node must answer.
                    if not self._all_brokers_listed():
                        return False
                    continue
                if not parts:
                    return False
                if any(set(p.isr) != set(p.replicas) or p.leader < 0 for p in parts.values()):
                    return False
            return True

        wait_for(full, timeout=timeout, interval=0.5, what=f"full ISRs on {self.name}")

    def _all_brokers_listed(self) -> bool:
        from confluent_kafka import KafkaException, Producer

        client = Producer({"bootstrap.servers": self.up_bootstrap(), "log_level": 0})
        try:
            return len(client.list_topics(timeout=5).brokers) == NODES
        except KafkaException:
            return False

    def wait_isr(self, topic: str, partition: int, size: int, timeout: float = 60) -> Partition:
        """Wait until the partition's ISR has ``size`` members."""
        found = wait_for(
            lambda: (p := self.partitions(topic).get(partition)) and len(p.isr) == size and p,
            timeout=timeout,
            interval=0.5,
            what=f"ISR of {size} for {topic}[{partition}]",
        )
        assert isinstance(found, Partition)
        return found

    def coordinator(self, group: str, exclude: Sequence[int] = ()) -> int:
        """The node id that coordinates ``group`` now.

        Asked from a child process: librdkafka's admin client (2.16) can abort
        the whole process on an assertion when a broker resets the connection
        under a describe_consumer_groups request, as brokers being killed do."""

        def ask() -> int | None:
            proc = subprocess.run(
                [sys.executable, "-c", _ASK_COORDINATOR, self.up_bootstrap(exclude), group],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            out = proc.stdout.strip()
            return int(out) if proc.returncode == 0 and out.isdigit() and int(out) > 0 else None

        found = wait_for(ask, timeout=30, interval=0.5, what=f"coordinator of {group}")
        assert isinstance(found, int)
        return found

    def active_controller(self, exclude: Sequence[int] = ()) -> int:
        """The node id of the active KRaft controller (the metadata quorum's leader).

        Asked with a DescribeQuorum request to a node that is up, as
        ``kafka-metadata-quorum describe --status`` does: the broker forwards it
        to the controllers. (A metadata response's controller id is a random
        broker under KRaft, not the active controller.)"""
        skip = self.frozen | set(exclude)

        def ask() -> int | None:
            for k, node in self.nodes.items():
                if k in skip:
                    continue
                with contextlib.suppress(OSError, ValueError, struct.error, IndexError):
                    leader = _describe_quorum_leader(node.port)
                    if leader > 0 and leader not in skip:
                        return leader
            return None

        found = wait_for(
            ask, timeout=30, interval=0.5, what=f"the active controller of {self.name}"
        )
        assert isinstance(found, int)
        return found

    def create_topic(
        self,
        topic: str,
        partitions: int = 3,
        *,
        replication: int = NODES,
        config: dict[str, str] | None = None,
        assignment: Sequence[Sequence[int]] | None = None,
    ) -> str:
        """Create ``topic`` (replication factor 3 unless ``assignment`` places
        each partition's replicas, first one preferred leader), wait until every
        partition has a leader and its full ISR."""
        from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

        if assignment is not None:
            new = NewTopic(
                topic,
                num_partitions=len(assignment),
                replica_assignment=[list(a) for a in assignment],
                config=config or {},
            )
        else:
            new = NewTopic(
                topic,
                num_partitions=partitions,
                replication_factor=replication,
                config=config or {},
            )
        with self.admin() as admin:
            admin.create_topics([new], operation_timeout=20, request_timeout=20)[topic].result(30)
        self.wait_full_isr([topic])
        return topic

    def delete_topics(self, topics: Sequence[str]) -> None:
        if not topics:
            return
        with self.admin() as admin:
            for fut in admin.delete_topics(list(topics), operation_timeout=15).values():
                with contextlib.suppress(Exception):
                    fut.result(timeout=20)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _read_uvarint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _describe_quorum_leader(port: int) -> int:
    """The leader id of ``__cluster_metadata`` by a DescribeQuorum v0 request
    (API key 55, a flexible version) to the broker on ``port``; -1 on an error."""
    client, topic = b"outboxkit-tests", b"__cluster_metadata"
    header = struct.pack(">hhih", 55, 0, 1, len(client)) + client + _uvarint(0)
    body = (
        _uvarint(2)  # one topic
        + _uvarint(len(topic) + 1)
        + topic
        + _uvarint(2)  # one partition
        + struct.pack(">i", 0)
        + _uvarint(0)  # partition's tagged fields
        + _uvarint(0)  # topic's tagged fields
        + _uvarint(0)  # request's tagged fields
    )
    request = header + body
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        s.sendall(struct.pack(">i", len(request)) + request)
        size = struct.unpack(">i", _recv_exactly(s, 4))[0]
        buf = _recv_exactly(s, size)
    _, i = _read_uvarint(buf, 4)  # after the correlation id: the header's tagged fields
    (error,) = struct.unpack_from(">h", buf, i)
    if error:
        return -1
    _, i = _read_uvarint(buf, i + 2)  # topics
    name_len, i = _read_uvarint(buf, i)
    _, i = _read_uvarint(buf, i + name_len - 1)  # partitions
    _, part_error, leader = struct.unpack_from(">ihi", buf, i)
    return int(leader) if part_error == 0 else -1


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return buf


_ASK_COORDINATOR = """
import sys
from confluent_kafka.admin import AdminClient
admin = AdminClient({"bootstrap.servers": sys.argv[1], "log_level": 0})
desc = admin.describe_consumer_groups([sys.argv[2]], request_timeout=5)[sys.argv[2]].result(10)
print(desc.coordinator.id)
"""


@contextlib.contextmanager
def shared_cluster(run_id: str, *, keep: bool = False, **kwargs: Any) -> Iterator[KafkaCluster]:
    """The cluster of this test run, started by the first pytest-xdist worker
    that needs it and stopped (its state deleted) by the last one to let go.

    ``run_id`` names the run (``PYTEST_XDIST_TESTRUNUID``): every worker of a
    run shares one cluster, so a run starts three JVMs, not three per worker.
    The workers' count of users is kept under a file lock in the state folder.
    With ``keep`` the last one leaves it running (a later run with the same
    ``run_id`` finds it up in a second): for working on the cluster tests.
    """
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    name = f"cl{run_id[:10]}"
    ledger = STATE_DIR / f"kafka-cluster-users-{name}"
    lock_path = STATE_DIR / f"kafka-cluster-users-{name}.lock"
    with _locked(lock_path):
        users, port = _read_ledger(ledger)
        if port is None:
            port = first_free_run(2 * NODES)
        cluster = KafkaCluster(name, port, **kwargs)
        if users == 0:
            cluster.start()
        else:
            cluster.restore()
        ledger.write_text(f"{users + 1} {port}\n")
    try:
        yield cluster
    finally:
        with _locked(lock_path):
            users, _ = _read_ledger(ledger)
            if users <= 1 and keep:
                ledger.write_text(f"0 {port}\n")
            elif users <= 1:
                cluster.destroy()
                ledger.unlink(missing_ok=True)
            else:
                ledger.write_text(f"{users - 1} {port}\n")
        if not ledger.exists() and not keep:
            lock_path.unlink(missing_ok=True)


def _read_ledger(path: Path) -> tuple[int, int | None]:
    try:
        users, port = path.read_text().split()
        return int(users), int(port)
    except (OSError, ValueError):
        return 0, None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
