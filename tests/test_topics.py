"""``outboxkit topics ensure|check`` against the local Kafka (one broker: RF 1)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.naming import missing_service, unique_name
from support.procs import run_captured

from outboxkit.topics import TopicSettings, TopicState, differences

REPO = Path(__file__).resolve().parents[1]
SINGLE_BROKER = ("--replication-factor", "1", "--min-insync-replicas", "1")


def topics(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return run_captured(
        [sys.executable, "-P", "-m", "outboxkit", "topics", *args],
        env={**clean, **(env or {})},
        cwd=REPO,
        timeout=120,
    )


@pytest.fixture
def new_topic(kafka_bootstrap: str) -> Iterator[Callable[[], str]]:
    """Names of topics that do not exist yet; whatever a test creates is deleted."""
    from confluent_kafka.admin import AdminClient

    names: list[str] = []

    def make() -> str:
        names.append(unique_name("okt"))
        return names[-1]

    yield make
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for fut in admin.delete_topics(names, operation_timeout=15).values():
        with contextlib.suppress(Exception):  # never created, or best-effort cleanup
            fut.result(timeout=20)


def describe(kafka_bootstrap: str, name: str) -> tuple[int, int, str]:
    """Partitions, replicas of partition 0 and min.insync.replicas, as Kafka says."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    meta = admin.list_topics(name, timeout=15).topics[name]
    if meta.error is not None:
        missing_service(f"Kafka at {kafka_bootstrap} does not describe {name}: {meta.error}")
    (future,) = admin.describe_configs([ConfigResource("topic", name)]).values()
    config = future.result(timeout=15)
    isr = config["min.insync.replicas"].value
    return len(meta.partitions), len(meta.partitions[0].replicas), isr


def test_ensure_creates_then_finds_the_topics_as_asked(
    kafka_bootstrap: str, new_topic: Callable[[], str]
) -> None:
    a, b = new_topic(), new_topic()
    first = topics("ensure", a, b, "--kafka-bootstrap", kafka_bootstrap, "--partitions", "4",
                   *SINGLE_BROKER)  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    wanted = "4 partitions, replication factor 1, min.insync.replicas=1"
    assert first.stdout.splitlines() == [f"{a}: created: {wanted}", f"{b}: created: {wanted}"]
    assert describe(kafka_bootstrap, a) == (4, 1, "1")
    # Idempotent: the same command again (settings from the environment this time).
    again = topics(
        "ensure",
        a,
        b,
        env={
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_PARTITIONS": "4",
            "OUTBOXKIT_REPLICATION_FACTOR": "1",
            "OUTBOXKIT_MIN_INSYNC_REPLICAS": "1",
        },
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines() == [f"{a}: ok: {wanted}", f"{b}: ok: {wanted}"]
    assert describe(kafka_bootstrap, a) == (4, 1, "1")


def test_a_topic_short_of_what_is_asked_is_reported_and_left_alone(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], new_topic: Callable[[], str]
) -> None:
    existing = kafka_topics(partitions=1)  # RF 1, the broker's min.insync.replicas (1)
    fewer = topics("ensure", existing, "--kafka-bootstrap", kafka_bootstrap, "--partitions", "3",
                   *SINGLE_BROKER)  # fmt: skip
    assert fewer.returncode == 1, fewer.stdout + fewer.stderr
    assert f"{existing}: differs: 1 partitions, fewer than --partitions 3" in fewer.stdout
    assert f"--alter --topic {existing} --partitions 3" in fewer.stdout
    assert describe(kafka_bootstrap, existing) == (1, 1, "1")  # not altered

    # The production settings (RF 3, min.insync.replicas 2, the defaults) on this
    # single-broker topic: both named, and a missing topic under `check`.
    absent = new_topic()
    checked = topics("check", existing, absent, "--kafka-bootstrap", kafka_bootstrap,
                     "--partitions", "1")  # fmt: skip
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"{existing}: differs: replication factor 1, below --replication-factor 3" in (
        checked.stdout
    )
    assert f"{existing}: differs: min.insync.replicas=1, below --min-insync-replicas 2" in (
        checked.stdout
    )
    assert f"{absent}: missing" in checked.stdout
    assert describe_missing(kafka_bootstrap, absent)


def describe_missing(kafka_bootstrap: str, name: str) -> bool:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=15)
    return name not in meta.topics


def test_more_replicas_than_brokers_names_the_setting(
    kafka_bootstrap: str, new_topic: Callable[[], str]
) -> None:
    result = topics("ensure", new_topic(), "--kafka-bootstrap", kafka_bootstrap)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "invalid --replication-factor / OUTBOXKIT_REPLICATION_FACTOR" in result.stderr


def test_settings_are_checked_before_kafka_is_asked() -> None:
    no_bootstrap = topics("ensure", "orders")
    assert no_bootstrap.returncode == 2
    assert "missing --kafka-bootstrap / OUTBOXKIT_KAFKA_BOOTSTRAP" in no_bootstrap.stderr
    isr = topics("ensure", "orders", "--kafka-bootstrap", "127.0.0.1:1",
                 "--replication-factor", "1", "--min-insync-replicas", "2")  # fmt: skip
    assert isr.returncode == 2
    assert "invalid --min-insync-replicas / OUTBOXKIT_MIN_INSYNC_REPLICAS" in isr.stderr
    bad_name = topics("ensure", "bad topic!", "--kafka-bootstrap", "127.0.0.1:1")
    assert bad_name.returncode == 2
    assert "is not a name Kafka accepts" in bad_name.stderr


def test_kafka_unreachable_is_exit_3() -> None:
    result = topics("check", "orders", "--kafka-bootstrap", "127.0.0.1:1",
                    "--request-timeout", "2")  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    assert "cannot reach Kafka at 127.0.0.1:1" in result.stderr


def test_more_than_asked_is_no_difference() -> None:
    want = TopicSettings(partitions=3, replication_factor=3, min_insync_replicas=2)
    assert differences("t", TopicState(12, 5, 3, unclean_leader_election=False), want) == []
    unclean = differences("t", TopicState(3, 3, 2, unclean_leader_election=True), want)
    assert [line.split(":")[0] for line in unclean] == ["unclean.leader.election.enable=true"]


def test_the_module_loads_no_kafka_client() -> None:
    code = "import sys, outboxkit.topics; print('confluent_kafka' in sys.modules)"
    shown = run_captured([sys.executable, "-P", "-c", code], cwd=REPO)
    assert shown.stdout.strip() == "False", shown.stdout + shown.stderr
