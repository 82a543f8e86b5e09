"""A drain whose commit or close cannot reach the broker.

Found by the chaos suite's full run: a consumer that had lost its partitions at
a broker fault was sent SIGTERM while the broker was still away; it had nothing
to commit, but leaving the group timed out, and its exit record said
``commit-incomplete``. The result is about offsets: a close that times out
after a finished commit is logged (``close-timed-out``) and the result is ``clean``.
An exit commit the broker never takes is ``commit-incomplete`` with exit code 3,
not 0: what the consumer finished since its last commit is handled again.

A dedicated broker is frozen (SIGSTOP), so the shared one serves the others.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafkahelp import committed, produce, wait_for
from support.kafka_acl import create_topic
from support.services import KafkaInstance, free_ports

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.runtime.testing import capture_json_logs

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture(scope="module")
def broker() -> Iterator[KafkaInstance]:
    kafka = KafkaInstance(f"close-{uuid.uuid4().hex[:6]}", *free_ports(2))
    try:
        kafka.start(fresh=True)
    except Exception as exc:
        pytest.fail(f"dedicated Kafka broker did not start: {exc}", pytrace=False)
    yield kafka
    kafka.stop()
    shutil.rmtree(kafka.state_dir, ignore_errors=True)


class Counted(Consumer):
    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.seen: list[int] = []

    def handle(self, message: Message) -> None:
        self.seen.append(message.offset)


def test_a_close_that_times_out_after_the_commit_is_an_ok_drain(
    broker: KafkaInstance,
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = f"okt-close-{uuid.uuid4().hex[:8]}"
    group = f"g-{topic}"
    create_topic(broker, topic)
    produce(broker.bootstrap, topic, [(b"k", b"x", f"ev-{i}") for i in range(5)])
    consumer = Counted(
        settings(
            group_id=group, topics=(topic,), kafka_bootstrap=broker.bootstrap, close_timeout=2.0
        )
    )
    with capture_json_logs(level="INFO") as logs, run_consumer(consumer) as running:
        wait_for(lambda: consumer.seen == [0, 1, 2, 3, 4], 60, what="five messages handled")
        wait_for(
            lambda: committed(broker.bootstrap, group, topic, 1) == {0: 5},
            30,
            what="offset 5 committed by the periodic commit",
        )
        wait_for(
            lambda: (
                consumer._loop is not None
                and consumer._loop.commits.committed_offsets() == {f"{topic}/0": 5}
            ),
            30,
            what="the commit confirmed to the consumer",
        )
        broker.pause()
        try:
            assert running.stop() == 0
        finally:
            broker.resume()
    (record,) = logs.events("consumer-exit")
    assert logs.events("close-timed-out"), "the close could not reach the frozen broker"
    assert record["committed"] == {f"{topic}/0": 5}
    assert record["result"] == "clean", record


def test_an_exit_commit_the_broker_never_takes_exits_3_commit_incomplete(
    broker: KafkaInstance,
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = f"okt-close-{uuid.uuid4().hex[:8]}"
    group = f"g-{topic}"
    create_topic(broker, topic)
    produce(broker.bootstrap, topic, [(b"k", b"x", f"ev-{i}") for i in range(5)])
    consumer = Counted(
        settings(
            group_id=group,
            topics=(topic,),
            kafka_bootstrap=broker.bootstrap,
            commit_interval=600.0,  # only the exit commit would cover the five
            worker_drain_timeout=1.0,
            close_timeout=2.0,
        )
    )
    with capture_json_logs(level="INFO") as logs, run_consumer(consumer) as running:
        wait_for(lambda: consumer.seen == [0, 1, 2, 3, 4], 60, what="five messages handled")
        broker.pause()
        try:
            code = running.stop()
        finally:
            broker.resume()
    (record,) = logs.events("consumer-exit")
    assert (code, record["exit_code"], record["result"]) == (3, 3, "commit-incomplete"), record
    assert record["committed"] == {}
