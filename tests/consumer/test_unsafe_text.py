"""Text from records reaches headers and log lines safe, and never stops a partition.

A record is valid JSON whose decoded text holds a lone surrogate (``"\\ud800"``),
a line separator, a bidirectional override or an escape sequence; the handler
does what services do and puts that text into its exception. The dead-letter
copy's error header must still be UTF-8, the log lines one JSON object each
with none of those characters raw, and the next record handled.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from kafkahelp import FAST_GROUP, committed, read_all, wait_for
from procs import ConsumerProcess
from rawkafka import RawRecord, produce_raw

pytestmark = pytest.mark.integration

#: Characters a log line or a header must never carry raw: C0/C1 controls, DEL,
#: line and paragraph separators, bidirectional marks, lone surrogates.
RAW_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _env(bootstrap: str, topic: str, group: str) -> dict[str, str]:
    return {
        "OUTBOXKIT_KAFKA_BOOTSTRAP": bootstrap,
        "OUTBOXKIT_KAFKA_CONFIG": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
        "OUTBOXKIT_HEALTH_PORT": "0",
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_GROUP_ID": group,
        "OUTBOXKIT_COMMIT_INTERVAL": "0.5",
        "OUTBOXKIT_DLQ_TIMEOUT": "5",
        "OUTBOXKIT_LOG_FORMAT": "json",
    }


def _consume_all(
    bootstrap: str, topic: str, app: str, records: list[RawRecord], cwd: Path
) -> ConsumerProcess:
    """Produce ``records``, run ``app`` until the last one is handled and every
    offset committed, with no worker crash, then SIGTERM it (exit 0)."""
    group = f"g-{topic}"
    produce_raw(bootstrap, topic, records)
    proc = ConsumerProcess(app, env=_env(bootstrap, topic, group), cwd=cwd)
    last = len(records) - 1
    try:
        proc.wait_event("handled", 30, lambda r: r["offset"] == last)
        wait_for(
            lambda: committed(bootstrap, group, topic, 1) == {0: last + 1},
            30,
            0.2,
            f"offset {last + 1} committed",
        )
        assert proc.events("worker-crashed") == []
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    return proc


def test_a_surrogate_in_a_handlers_error_is_dead_lettered_safely_and_the_next_record_handled(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], tmp_path: Path
) -> None:
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    records = [
        RawRecord(b"k", b'{"type": "\\ud800"}', [(b"event_id", b"e-0")]),
        RawRecord(
            b"k",
            b'{"type": "a\\u2028b\\u202ec\\u001b[2J"}',
            [(b"event_id", b"e-1\xe2\x80\xa8x")],
        ),
        RawRecord(b"k", b'{"type": "paid"}', [(b"event_id", b"e-2")]),
    ]
    proc = _consume_all(kafka_bootstrap, topic, "consumer_apps:OrderTypes", records, tmp_path)

    letters = read_all(kafka_bootstrap, dlq, expect=2)
    assert len(letters) == 2
    errors = []
    for letter in letters:
        headers = {name: (value or b"").decode("utf-8") for name, value in letter.headers()}
        errors.append(headers["dlq.error.message"])
    assert not RAW_UNSAFE.findall("".join(errors)), errors
    # escaped, not dropped: the header still says what the type was
    assert errors[0] == "unknown order type \\ud800"
    assert errors[1] == "unknown order type a\\u2028b\\u202ec\\u001b[2J"

    # Every line is one JSON object, no unsafe character raw in it, and the values
    # decode back to the text: the gave-up lines name the error and the event id.
    for line in proc.raw:
        assert not RAW_UNSAFE.findall(line.rstrip("\n")), line
        json.loads(line)
    gave_up = proc.events("handler-gave-up")
    assert [r["offset"] for r in gave_up] == [0, 1]
    assert gave_up[1]["event_id"] == "e-1\u2028x"
    assert "a\u2028b\u202ec\x1b[2J" in gave_up[1]["error"]


def test_an_exception_that_cannot_be_printed_is_dead_lettered_and_the_next_record_handled(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], tmp_path: Path
) -> None:
    """A handler's exception whose ``str()`` raises (a broken ``__str__``) is still
    the handler's failure: dead-lettered with a stand-in text naming its class, the
    next record handled, no worker crash."""
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    records = [
        RawRecord(b"k", b'{"type": "bad"}', [(b"event_id", b"e-0")]),
        RawRecord(b"k", b'{"type": "paid"}', [(b"event_id", b"e-1")]),
    ]
    proc = _consume_all(
        kafka_bootstrap, topic, "consumer_apps:RaisesUnprintable", records, tmp_path
    )

    [letter] = read_all(kafka_bootstrap, dlq, expect=1)
    headers = {name: (value or b"").decode("utf-8") for name, value in letter.headers()}
    assert headers["dlq.error.class"].endswith("_Unprintable"), headers
    assert headers["dlq.error.message"] == "<_Unprintable: str() failed>", headers
    [gave_up] = proc.events("handler-gave-up")
    assert "_Unprintable" in gave_up["error"], gave_up
