"""Drain on SIGTERM, in a real child process: readiness, finish, commit, exit record."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kafkahelp import FAST_GROUP, committed, end_offsets, http_get, make_events, produce, wait_for
from procs import ConsumerProcess

from outboxkit.consumer import Consumer, ConsumerSettings, Message

pytestmark = pytest.mark.integration


@pytest.fixture
def spawn(tmp_path: Path, kafka_bootstrap: str) -> Iterator[Callable[..., ConsumerProcess]]:
    procs: list[ConsumerProcess] = []

    def start(target: str, **env: str) -> ConsumerProcess:
        base = {
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_KAFKA_CONFIG": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
            "OUTBOXKIT_COMMIT_INTERVAL": "0.5",
            "OUTBOXKIT_CLOSE_TIMEOUT": "5",
            "OUTBOXKIT_SHUTDOWN_TIMEOUT": "30",
        }
        p = ConsumerProcess(target, env={**base, **env}, cwd=tmp_path)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


#: The same handler, sync (``time.sleep``) and ``async def`` (``asyncio.sleep``).
SLEEPY = pytest.mark.parametrize(
    "app", ["consumer_apps:Sleepy", "consumer_apps:SleepyAsync"], ids=["sync", "async"]
)


def _adds_up(record: dict[str, Any]) -> bool:
    parts = record["succeeded"] + record["failed"] + record["unknown"] + record["released"]
    return bool(record["batch_size"] == parts)


@SLEEPY
def test_sigterm_lets_the_slow_handler_finish_commits_and_exits_0(
    app: str, kafka_bootstrap: str, kafka_topics: Callable[..., str], spawn: Any
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    produce(kafka_bootstrap, topic, [(b"k", b"fast", "e0"), (b"k", b"sleep:3", "e1")])
    proc = spawn(
        app,
        OUTBOXKIT_TOPICS=topic,
        OUTBOXKIT_GROUP_ID=group,
        OUTBOXKIT_WORKER_DRAIN_TIMEOUT="10",
    )
    url = proc.health_url()
    proc.wait_event("handler-started", 20, lambda r: r["offset"] == 1)
    assert http_get(f"{url}/healthz/ready")[0] == 200

    signalled = time.monotonic()
    proc.signal(signal.SIGTERM)
    _, body = wait_for(
        lambda: (r := http_get(f"{url}/healthz/ready"))[0] == 503 and r, 1.0, 0.02, "ready 503"
    )
    assert body["state"] == "draining"
    assert time.monotonic() - signalled < 1.0
    assert proc.events("handler-finished")[-1]["offset"] == 0  # the slow one still runs

    assert proc.wait(20) == 0
    took = time.monotonic() - signalled
    assert took < 3 + 5 + 2  # handler + close_timeout + slack, well inside shutdown_timeout
    assert proc.events("handler-finished")[-1]["offset"] == 1
    record = proc.exit_record()
    assert record["signal"] == "SIGTERM"
    assert record["result"] == "clean"
    # The counts say what they count: the drain batch (the slow message), and
    # the run's totals (both messages) beside them.
    assert record["counts_of"] == "drain-batch"
    assert record["totals"] == {"success": 2}, record
    assert record["batch_size"] == 1
    assert record["succeeded"] == 1 and record["unknown"] == 0 and record["failed"] == 0
    assert _adds_up(record)
    assert record["committed"] == {f"{topic}/0": 2}, "".join(proc.raw)
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 2}


class Recorder(Consumer):
    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.offsets: list[int] = []
        self.lock = threading.Lock()

    def handle(self, message: Message) -> None:
        with self.lock:
            self.offsets.append(message.offset)


@SLEEPY
def test_handler_outliving_the_drain_timeout_is_unknown_and_redelivered(
    app: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    spawn: Any,
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    produce(
        kafka_bootstrap,
        topic,
        [(b"k", b"fast", "e0"), (b"k", b"sleep:60", "e1"), (b"k", b"fast", "e2")],
    )
    proc = spawn(
        app,
        OUTBOXKIT_TOPICS=topic,
        OUTBOXKIT_GROUP_ID=group,
        OUTBOXKIT_WORKER_DRAIN_TIMEOUT="1",
    )
    proc.wait_event("handler-started", 20, lambda r: r["offset"] == 1)
    signalled = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert time.monotonic() - signalled < 1 + 5 + 2
    record = proc.exit_record()
    assert record["unknown"] == 1
    assert record["result"] == "unknown-left"
    assert _adds_up(record)
    assert proc.events("consumer-exit")[0]["committed"] in ({}, {f"{topic}/0": 1})
    if app.endswith("Async"):
        # The coroutine was cancelled at the deadline (its except block ran), not
        # left running; the consumer says how many it cancelled.
        assert [r["offset"] for r in proc.events("handler-cancelled")] == [1]
        assert proc.wait_event("handlers-cancelled", 1)["cancelled"] == 1
    else:
        assert proc.events("handlers-cancelled") == []
    # Offset 1 was never finished: the group's position stays on it.
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}

    nxt = Recorder(settings(group_id=group, topics=(topic,)))
    with run_consumer(nxt) as running:
        wait_for(lambda: nxt.offsets == [1, 2], 20, what="redelivery of offset 1")
        assert running.stop() == 0


@SLEEPY
def test_second_signal_hurries_the_drain_and_the_counts_reach_the_pushgateway(
    app: str, kafka_bootstrap: str, kafka_topics: Callable[..., str], spawn: Any
) -> None:
    pushgateway = os.environ.get("OUTBOXKIT_TEST_PUSHGATEWAY_URL")
    if not pushgateway:
        reason = "OUTBOXKIT_TEST_PUSHGATEWAY_URL is not set"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)
        pytest.skip(reason)
    topic = kafka_topics(1)
    produce(kafka_bootstrap, topic, [(b"k", b"sleep:60", "e0")])
    proc = spawn(
        app,
        OUTBOXKIT_TOPICS=topic,
        OUTBOXKIT_GROUP_ID=f"g-{topic}",
        OUTBOXKIT_WORKER_DRAIN_TIMEOUT="20",
        OUTBOXKIT_PUSHGATEWAY_URL=str(pushgateway),
        OUTBOXKIT_SERVICE=f"svc-{topic}",
    )
    proc.wait_event("handler-started", 20)
    proc.signal(signal.SIGTERM)
    proc.wait_event("state-changed", 5, lambda r: r.get("to") == "draining")
    time.sleep(0.3)
    hurried = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert time.monotonic() - hurried < 5  # not the 20 s drain timeout
    hurry = proc.wait_event("hurry", 1)
    assert hurry["signal"] == "SIGTERM"
    assert proc.wait_event("drain-hurried", 1)["unfinished"] == 1
    record = proc.exit_record()
    assert record["unknown"] == 1 and _adds_up(record)
    if app.endswith("Async"):  # hurried: cancelled at once, not after the 20 s
        assert [r["offset"] for r in proc.events("handler-cancelled")] == [0]
    # The process is gone; its last numbers are not.
    with urllib.request.urlopen(f"{pushgateway}/metrics", timeout=5) as resp:  # noqa: S310
        text = resp.read().decode()
    node_id = record["node_id"]
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("worker_shutdown_released_messages{")
        and f'instance="{node_id}"' in line
        and 'job="outboxkit_consumer"' in line
    ]
    assert len(lines) == 1 and lines[0].endswith(" 1"), lines


def test_console_log_format_gives_readable_lines(
    spawn: Callable[..., ConsumerProcess],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
) -> None:
    topic = kafka_topics(partitions=1)
    produce(kafka_bootstrap, topic, [(b"k", b"hello", "e-1")])
    proc = spawn(
        "consumer_apps:Sleepy",
        OUTBOXKIT_TOPICS=topic,
        OUTBOXKIT_GROUP_ID=f"g-{topic}",
        OUTBOXKIT_LOG_FORMAT="console",
        OUTBOXKIT_WORKER_DRAIN_TIMEOUT="5",
    )
    wait_for(
        lambda: any(" handler-finished " in x for x in proc.raw) or proc.proc.poll() is not None,
        timeout=60,
        what="the message handled",
    )
    assert proc.proc.poll() is None, "".join(proc.raw)
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    line = re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+Z (?P<level>[A-Z]+) +(?P<event>[a-z-]+)(?P<rest>.*)")
    parsed = [m for m in map(line.fullmatch, (x.rstrip("\n") for x in proc.raw)) if m]
    assert proc.lines == [] and parsed, "".join(proc.raw)  # not one JSON line
    events = {m["event"]: m["rest"] for m in parsed}
    assert " partition=0 offset=0 logger=consumer_apps " in events["handler-finished"]
    assert " result=clean " in events["consumer-exit"], events["consumer-exit"]


def _handled(proc: ConsumerProcess) -> list[tuple[int, int]]:
    return [(r["partition"], r["offset"]) for r in proc.events("handled")]


def test_drain_at_a_cooperative_revocation_commits_once_the_rebalance_completes(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], spawn: Any
) -> None:
    """A rolling deploy with surge: the new member joins, the old one gets SIGTERM
    at its first revocation, with its drain batch empty. Its exit commit must
    land (after the rejoin the rebalance needs), so the new member handles none
    of what the old one finished on the partitions it kept."""
    parts = 4
    topic = kafka_topics(parts)
    group = f"g-{topic}"
    produce(kafka_bootstrap, topic, make_events(200, keys=20))
    common = {
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_GROUP_ID": group,
        # No periodic commit in between: what the old member finished is committed
        # on revoke (the partitions it gives up) or at exit (the ones it keeps).
        "OUTBOXKIT_COMMIT_INTERVAL": "600",
        "OUTBOXKIT_WORKER_DRAIN_TIMEOUT": "10",
    }
    old = spawn("consumer_apps:RollingMember", APP_TERM_AT_REVOKE="1", **common)
    wait_for(lambda: len(old.events("handled")) >= 200, 60, what="the backlog handled")
    new = spawn("consumer_apps:RollingMember", **common)
    assert old.wait(30) == 0, "".join(old.raw[-30:])
    revoked = {int(n.rsplit("/", 1)[1]) for n in old.events("partitions-revoked")[0]["partitions"]}
    kept = set(range(parts)) - revoked
    assert revoked and kept, "".join(old.raw[-30:])
    ends = end_offsets(kafka_bootstrap, topic, parts)
    # One more message per partition: once the new member handled each of them,
    # it has read every partition from the group's committed offset.
    for p in range(parts):
        produce(kafka_bootstrap, topic, [(None, b"marker", f"mm{p}")], partition=p)
    wait_for(
        lambda: {p for p, o in _handled(new) if o >= ends[p]} == set(range(parts)),
        60,
        what="the new member at every partition's end",
    )
    again = sorted((p, o) for p, o in _handled(new) if o < ends[p])
    assert again == [], f"handled again by the new member: {again[:10]} ({len(again)})"
    record = old.exit_record()
    assert record["signal"] == "SIGTERM"
    assert record["batch_size"] == 0 and _adds_up(record)
    assert (record["result"], record["committed"]) == (
        "clean",
        {f"{topic}/{p}": ends[p] for p in sorted(kept)},
    ), "".join(old.raw[-30:])
