"""The three-node Kafka cluster the tests in this folder share.

One cluster per test run (``support.cluster.shared_cluster``): started by the
first worker that needs it (about 30 s cold on two cores), stopped and deleted
by the last. ``cluster`` hands it to one test and, after it, brings back every
node the test stopped, killed or froze and waits for every ISR to be full
again, so faults never leak into the next test.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cluster import KafkaCluster, shared_cluster

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent / "relay", HERE.parent / "consumer"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

#: A follower silent this long leaves the ISR (Kafka's default is 30 s).
REPLICA_LAG_MS = 4000


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[KafkaCluster]:
    # OUTBOXKIT_TEST_KEEP_CLUSTER=<name>: use (or start) the cluster of that name
    # and leave it running after the run, for quick reruns while working on these
    # tests (stop it with deploy/local/down.sh or kafka-cluster.sh stop).
    kept = os.environ.get("OUTBOXKIT_TEST_KEEP_CLUSTER", "")
    run_id = kept or os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
    try:
        manager = shared_cluster(run_id, keep=bool(kept), replica_lag_ms=REPLICA_LAG_MS)
        cluster = manager.__enter__()
    except (RuntimeError, OSError) as exc:
        if IN_CI:
            pytest.fail(f"the local Kafka cluster did not start under CI: {exc}", pytrace=False)
        pytest.skip(f"the local Kafka cluster did not start: {exc}")
    try:
        yield cluster
    finally:
        manager.__exit__(None, None, None)


@pytest.fixture
def cluster(kafka_cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The shared cluster, whole again after the test (nodes up, ISRs full).

    One test at a time on it, across the pytest-xdist workers (a file lock):
    each test breaks one node at a time, and two tests breaking two nodes at
    once would take the controller quorum away from both."""
    with kafka_cluster.exclusive():
        kafka_cluster.restore()
        yield kafka_cluster
        kafka_cluster.restore()


@pytest.fixture
def cluster_topic(cluster: KafkaCluster) -> Iterator[Callable[..., str]]:
    """``cluster_topic(partitions=3, **kw)``: a new topic on the cluster (RF 3 and
    ``min.insync.replicas=2`` unless ``kw`` says otherwise), deleted afterwards."""
    created: list[str] = []

    def make(partitions: int = 3, **kw: Any) -> str:
        topic = cluster.create_topic(f"okc_{uuid.uuid4().hex[:10]}", partitions, **kw)
        created.append(topic)
        return topic

    yield make
    cluster.restore(created)
    cluster.delete_topics(created)


@pytest.fixture
def embedded() -> Iterator[Callable[..., Any]]:
    """``embedded(settings)``: a relay running in a thread, drained after the test."""
    from relay_support import EmbeddedRelay

    from outboxkit.relay import Relay

    started: list[EmbeddedRelay] = []

    def start(settings: Any, **kwargs: Any) -> EmbeddedRelay:
        er = EmbeddedRelay(Relay(settings, **kwargs)).start()
        started.append(er)
        return er

    yield start
    for er in started:
        if er.thread.is_alive():
            er.stop()
