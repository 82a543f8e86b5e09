"""A consumer prunes the old exit groups of its own consumer group, and no other.

Each consumer pushes its exit metrics into a group of its own (job
``outboxkit_consumer``, ``instance=<node id>``, ``consumer_group=<group id>``).
With pod names as node ids no later exit replaces that group; so a consumer,
once running, deletes the groups of its consumer group's members that were
pushed more than ``pushgateway_prune_after`` ago and alert on nothing
(outboxkit/runtime/pushgroups.py). Another service's consumers may share the
Pushgateway: their groups are theirs to prune. Before, a consumer deleted every
old clean group of the job, whichever service had pushed it.

On the real Pushgateway, with two pod-named consumers of one group run one after
the other (embedded); every group here has node ids of this test only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafkahelp import wait_for
from prometheus_client import CollectorRegistry, Gauge
from support.prometheus import delete_pushed_groups

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.consumer.base import PUSH_JOB
from outboxkit.runtime.metrics import push_metrics

pytestmark = pytest.mark.integration


class Quiet(Consumer):
    def handle(self, message: Message) -> None:
        pass


@pytest.fixture
def pushgateway() -> Iterator[tuple[str, list[str]]]:
    """The test Pushgateway's URL and a list of node ids whose groups are deleted after."""
    url = os.environ.get("OUTBOXKIT_TEST_PUSHGATEWAY_URL", "").rstrip("/")
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2):  # noqa: S310
            pass
    except (OSError, ValueError) as exc:
        reason = f"no Pushgateway at OUTBOXKIT_TEST_PUSHGATEWAY_URL={url!r}: {exc}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
        pytest.skip(reason)
    node_ids: list[str] = []
    yield url, node_ids
    for node_id in node_ids:
        with contextlib.suppress(OSError):
            delete_pushed_groups(url, job=PUSH_JOB, instance=node_id)


def _groups(url: str) -> dict[str, dict[str, Any]]:
    """The consumer job's groups by instance."""
    with urllib.request.urlopen(f"{url}/api/v1/metrics", timeout=5) as resp:  # noqa: S310
        data = json.loads(resp.read())["data"]
    return {g["labels"]["instance"]: g for g in data if g["labels"].get("job") == PUSH_JOB}


def _pushed_at(group: dict[str, Any]) -> float:
    return float(group["push_time_seconds"]["metrics"][0]["value"])


def test_a_running_consumer_prunes_its_groups_old_clean_records_and_no_other_groups(
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    pushgateway: tuple[str, list[str]],
) -> None:
    url, node_ids = pushgateway
    topic = kafka_topics(1)
    tag = uuid.uuid4().hex[:8]
    group = f"prune-{tag}"
    pod_a, pod_b, elsewhere = (f"consumer-{tag}-{n}" for n in ("a", "b", "elsewhere"))
    node_ids.extend([pod_a, pod_b, elsewhere])

    def run(node_id: str, *, until: Callable[[], bool]) -> None:
        consumer = Quiet(
            settings(
                group_id=group,
                topics=(topic,),
                node_id=node_id,
                pushgateway_url=url,
                pushgateway_prune_after=1.0,
            )
        )
        with run_consumer(consumer) as running:
            wait_for(lambda: consumer.lifecycle.state.value == "running", 30, what="running")
            wait_for(until, 30, what="the consumer's effect on the Pushgateway")
            assert running.stop() == 0

    # A first pod comes and goes: its group is left behind, labelled with its group.
    run(pod_a, until=lambda: True)
    first = _groups(url)[pod_a]
    assert first["labels"] == {"job": PUSH_JOB, "instance": pod_a, "consumer_group": group}
    # An old clean exit of another service's consumers on the same Pushgateway.
    registry = CollectorRegistry()
    Gauge("worker_shutdown_released_messages", "released", registry=registry).set(0)
    assert push_metrics(
        url,
        job=PUSH_JOB,
        grouping_key={"instance": elsewhere, "consumer_group": f"other-{tag}"},
        registry=registry,
    )
    wait_for(
        lambda: all(time.time() - _pushed_at(_groups(url)[n]) > 1.5 for n in (pod_a, elsewhere)),
        10,
        what="the groups to age past pushgateway_prune_after",
    )

    # The next pod of the same group deletes the first one's group once running.
    run(pod_b, until=lambda: pod_a not in _groups(url))

    groups = _groups(url)
    assert pod_b in groups, "the new pod's own exit group"
    assert elsewhere in groups, "another consumer group's records are not this one's to prune"
