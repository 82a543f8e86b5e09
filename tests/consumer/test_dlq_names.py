"""A dead-letter topic the consumer itself reads is refused at start (exit 2).

With ``--dlq-suffix ""`` or ``--dlq-topic`` naming a consumed topic, one poison
record went back to the topic it came from, was read again, failed again:
an endless loop, one more copy (and one more set of ``dlq.*`` headers) each
round. A regex subscription (a topic starting with ``^``) needs an explicit
dead-letter topic that no pattern matches: the derived ``<topic><suffix>`` of
the topics a pattern will match cannot be checked, nor created, in advance,
and a pattern like ``^orders\\..*`` matches its own derived names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import HERE

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.runtime import ConfigError

pytestmark = pytest.mark.unit

_SUFFIX = "--dlq-suffix / OUTBOXKIT_DLQ_SUFFIX"
_TOPIC = "--dlq-topic / OUTBOXKIT_DLQ_TOPIC"
_TOPICS = "--topics / OUTBOXKIT_TOPICS"


class Orders(Consumer):
    group_id = "g"

    def handle(self, message: Message) -> None:
        pass


def _problems(**values: object) -> str:
    settings = ConsumerSettings(kafka_bootstrap="127.0.0.1:1", health_port=0, **values)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        Orders(settings)
    return str(info.value)


def _accepted(**values: object) -> None:
    Orders(ConsumerSettings(kafka_bootstrap="127.0.0.1:1", health_port=0, **values))  # type: ignore[arg-type]


def test_an_empty_suffix_would_dead_letter_into_the_consumed_topic() -> None:
    message = _problems(topics=("orders",), dlq_suffix="")
    assert _SUFFIX in message and "orders" in message


def test_a_dead_letter_topic_among_the_consumed_ones_is_refused() -> None:
    message = _problems(topics=("orders", "payments"), dlq_topic="payments")
    assert _TOPIC in message and "payments" in message
    # the derived name of one topic is another consumed topic: a chain, refused too
    message = _problems(topics=("orders", "orders.dlq"))
    assert _SUFFIX in message and "orders.dlq" in message


def test_a_class_level_dead_letter_topic_is_checked_the_same_way() -> None:
    class Looping(Orders):
        topics = ("orders",)
        dlq_topic = "orders"

    with pytest.raises(ConfigError, match="class attribute dlq_topic"):
        Looping(ConsumerSettings(kafka_bootstrap="127.0.0.1:1", health_port=0))


def test_a_regex_subscription_needs_a_dead_letter_topic_it_does_not_match() -> None:
    message = _problems(topics=(r"^orders\..*",))
    assert _TOPIC in message and "regex" in message
    message = _problems(topics=(r"^orders\..*",), dlq_topic="orders.dlq")
    assert _TOPIC in message and r"^orders\..*" in message
    message = _problems(topics=("^orders[",), dlq_topic="dead")
    assert _TOPICS in message and "regular expression" in message
    _accepted(topics=(r"^orders\..*", "payments"), dlq_topic="dead-letters")


def test_ordinary_names_are_accepted() -> None:
    _accepted(topics=("orders", "payments"))
    _accepted(topics=("orders",), dlq_suffix="-dlq")
    _accepted(topics=("orders", "payments"), dlq_topic="dead-letters")


def test_the_console_exits_2_naming_the_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    for extra in (["--dlq-suffix", ""], ["--dlq-topic", "t"]):
        done = subprocess.run(
            [
                sys.executable, "-m", "outboxkit", "consume", "consumer_apps:Sleepy",
                "--kafka-bootstrap", "127.0.0.1:1", "--group-id", "g", "--topics", "t",
                "--health-port", "0", "--connect-timeout", "1", *extra,
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "health-server-started" not in done.stderr
        assert (_SUFFIX if extra[0] == "--dlq-suffix" else _TOPIC) in done.stderr
