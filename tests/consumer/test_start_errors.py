"""``outboxkit consume`` start failures read like the relay's: one clean line, an exit code.

Kafka unreachable and a health host that cannot be bound are dependencies:
``start-failed kind=dependency`` with the reason, exit 3, no traceback (the
relay's answer to the same). A connect timeout no connection could meet is a
setting: exit 2 naming it. librdkafka's own log lines (``--kafka-config
debug=...``) are log records in the configured format, never raw text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from procs import HERE, ConsumerProcess

from outboxkit.consumer import ConsumerSettings
from outboxkit.runtime import ConfigError, load

pytestmark = pytest.mark.integration

_TIMEOUT = "--connect-timeout / OUTBOXKIT_CONNECT_TIMEOUT"


def _consume(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [
            sys.executable, "-m", "outboxkit", "consume", "consumer_apps:Sleepy",
            "--group-id", "g", "--topics", "t", "--health-port", "0", "--log-format", "json",
            *args,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def _records(stderr: str) -> list[dict[str, object]]:
    """Every line of ``stderr`` as a JSON record: a line that is not one fails."""
    out = []
    for line in stderr.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"a line outside the log format: {line!r}") from None
    return out


def _start_failed(stderr: str) -> dict[str, object]:
    assert "Traceback" not in stderr, "a traceback was logged"
    records = _records(stderr)
    failed = [r for r in records if r["event"] == "start-failed"]
    assert len(failed) == 1, [r["event"] for r in records]
    return failed[0]


@pytest.mark.unit
def test_kafka_unreachable_is_one_clean_line_and_exit_3(tmp_path: Path) -> None:
    done = _consume(tmp_path, "--kafka-bootstrap", "127.0.0.1:1", "--connect-timeout", "1")
    assert done.returncode == 3, done.stderr
    record = _start_failed(done.stderr)
    assert record["kind"] == "dependency" and record["exit_code"] == 3
    assert "Kafka unreachable" in str(record["error"])


@pytest.mark.unit
def test_a_health_host_that_cannot_be_bound_is_one_clean_line_and_exit_3(
    tmp_path: Path,
) -> None:
    done = _consume(tmp_path, "--kafka-bootstrap", "127.0.0.1:1", "--health-host", "256.1.1.1")
    assert done.returncode == 3, done.stderr
    record = _start_failed(done.stderr)
    assert record["kind"] == "dependency"
    assert "--health-host" in str(record["error"]) and "256.1.1.1" in str(record["error"])


@pytest.mark.parametrize("value", ["0.001", "1e-320"])
def test_a_connect_timeout_no_connection_can_meet_exits_2_naming_it(
    tmp_path: Path, kafka_bootstrap: str, value: str
) -> None:
    """Before, these were accepted and the start then reported "Kafka unreachable"
    (exit 3) against a broker that was up."""
    done = _consume(tmp_path, "--kafka-bootstrap", kafka_bootstrap, "--connect-timeout", value)
    assert done.returncode == 2, done.stderr
    assert _TIMEOUT in done.stderr and "Traceback" not in done.stderr
    assert "health-server-started" not in done.stderr


@pytest.mark.unit
def test_the_connect_timeout_is_at_least_one_second() -> None:
    for value in ("0.999", "500ms", "0"):
        with pytest.raises(ConfigError) as info:
            load(ConsumerSettings, environ={"OUTBOXKIT_CONNECT_TIMEOUT": value})
        assert _TIMEOUT in str(info.value) and "at least 1 s" in str(info.value)
    assert load(ConsumerSettings, environ={"OUTBOXKIT_CONNECT_TIMEOUT": "1"}).connect_timeout == 1


def test_librdkafka_debug_lines_are_log_records(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: Callable[..., str]
) -> None:
    topic = kafka_topics(1)
    kafka_topics(1, name=f"{topic}.dlq")
    proc = ConsumerProcess(
        "consumer_apps:Sleepy",
        env={
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_TOPICS": topic,
            "OUTBOXKIT_GROUP_ID": f"g-{topic}",
            "OUTBOXKIT_LOG_FORMAT": "json",
            "OUTBOXKIT_LOG_LEVEL": "DEBUG",
        },
        args=["--kafka-config", "debug=metadata"],
        cwd=tmp_path,
    )
    try:
        proc.wait_event("state-changed", 60, lambda r: r.get("to") == "running")
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    records = _records("".join(proc.raw))
    # the debug lines are there, as records of the Kafka client's logger
    assert any(r["logger"] == "outboxkit.consumer.kafka" and r["level"] == "DEBUG" for r in records)
