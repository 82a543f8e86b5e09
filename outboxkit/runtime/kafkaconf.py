"""librdkafka properties outboxkit treats specially: which hold secrets, which
the delivery guarantees depend on, and a check of the rest against librdkafka.

``SENSITIVE_KAFKA_PROPERTIES`` lists every property that can carry key material
or credentials. It contains the properties librdkafka itself flags as sensitive
(``_RK_SENSITIVE`` in ``src/rdkafka_conf.c``), the aliases and newer names that
carry the same material, and the OAUTHBEARER extensions (free-form key=value
pairs that usually carry tokens). Their values never reach a log line: the
start-up line shows ``***`` (see :func:`outboxkit.runtime.logs.is_secret_key`,
which also masks any property whose name says password, passphrase, secret,
token, credential or private key, so a future property is covered by its name).
``tests/runtime/test_kafkaconf.py`` checks the list against librdkafka's
configuration reference.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "CONSUMER_GUARDED",
    "KAFKA_CONFIG",
    "RELAY_GUARDED",
    "SENSITIVE_KAFKA_PROPERTIES",
    "Guard",
    "guarded_problems",
    "librdkafka_problem",
]

KAFKA_CONFIG = "--kafka-config / OUTBOXKIT_KAFKA_CONFIG"

SENSITIVE_KAFKA_PROPERTIES: frozenset[str] = frozenset(
    {
        # TLS client key: the key itself, its location, its password.
        "ssl.key.pem",
        "ssl_key",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.keystore.password",
        # librdkafka flags the CA PEM as sensitive; follow it.
        "ssl.ca.pem",
        # Client key of the HTTPS (OIDC) client, in librdkafka releases that have one.
        "https.client.key.pem",
        "https.client.key.location",
        "https.client.key.password",
        # SASL credentials.
        "sasl.username",
        "sasl.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.extensions",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.client.credentials.client.secret",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.private.key.passphrase",
    }
)


@dataclasses.dataclass(frozen=True)
class Guard:
    """A property the service sets itself: ``allowed`` values (compared without
    case) are accepted because they change nothing; ``allowed=()`` refuses any."""

    allowed: tuple[str, ...]
    reason: str


# Callables the service installs; a text value could only break them.
_CALLBACK = Guard((), "set by outboxkit itself (a callback), not settable from text")

RELAY_GUARDED: Mapping[str, Guard] = {
    "enable.idempotence": Guard(
        ("true",),
        "the relay needs an idempotent producer: per-key order and no duplicates on "
        "producer retries depend on it",
    ),
    "acks": Guard(
        ("all", "-1"),
        "a row is marked delivered only once every in-sync replica has it (acks=all)",
    ),
    "request.required.acks": Guard(
        ("all", "-1"),
        "alias of acks: a row is marked delivered only once every in-sync replica has it",
    ),
    "delivery.report.only.error": Guard(
        ("false",), "rows are marked delivered from their delivery reports"
    ),
    "transactional.id": Guard(
        (), "the relay does not use Kafka transactions; every produce would fail"
    ),
    "partitioner": Guard(
        ("murmur2_random", "murmur2", "consistent", "consistent_random", "fnv1a", "fnv1a_random"),
        "partitioner=random spreads the events of one key over partitions and breaks per-key order",
    ),
    **{
        name: _CALLBACK
        for name in ("error_cb", "logger", "dr_cb", "dr_msg_cb", "on_delivery", "stats_cb")
    },
}

CONSUMER_GUARDED: Mapping[str, Guard] = {
    "enable.auto.commit": Guard(
        ("true",),
        "the consumer stores an offset only after its message was processed and lets "
        "librdkafka commit the stored offsets; without auto commit nothing is committed "
        "until a rebalance or exit",
    ),
    "enable.auto.offset.store": Guard(
        ("false",), "offsets are stored only after processing; it must stay false"
    ),
    "partition.assignment.strategy": Guard(
        ("cooperative-sticky",),
        "the rebalance callbacks assume incremental (cooperative-sticky) assignment",
    ),
    "group.protocol": Guard(
        ("classic",),
        "the rebalance callbacks assume the classic group protocol with cooperative-sticky",
    ),
    "group.id": Guard((), "set by --group-id / OUTBOXKIT_GROUP_ID (or the class attribute)"),
    "auto.commit.interval.ms": Guard((), "set by --commit-interval / OUTBOXKIT_COMMIT_INTERVAL"),
    "statistics.interval.ms": Guard((), "set by --stats-interval / OUTBOXKIT_STATS_INTERVAL"),
    **{
        name: _CALLBACK
        for name in (
            "error_cb",
            "logger",
            "stats_cb",
            "on_commit",
            "throttle_cb",
            "oauth_cb",
        )
    },
}


def guarded_problems(config: Mapping[str, str], guards: Mapping[str, Guard]) -> list[str]:
    """One message per property of ``config`` that a guard refuses, naming it and why."""
    problems = []
    for key, raw in config.items():
        guard = guards.get(key.strip())
        if guard is None:
            continue
        if str(raw).strip().lower() in guard.allowed:
            continue
        if guard.allowed:
            expected = " or ".join(f"{key}={v}" for v in guard.allowed[:2])
            problems.append(
                f"invalid {KAFKA_CONFIG}: {key}={raw} is refused, outboxkit needs "
                f"{expected}: {guard.reason}"
            )
        else:
            problems.append(f"invalid {KAFKA_CONFIG}: {key} cannot be set here: {guard.reason}")
    return problems


def librdkafka_problem(
    config: Mapping[str, str], role: Literal["producer", "consumer"]
) -> str | None:
    """Ask librdkafka itself whether it accepts ``config`` (unknown properties, bad
    values), without connecting: the client is built without bootstrap servers and
    closed at once. The problem, naming the property as given (librdkafka names
    an alias's canonical property and never echoes values), or None.
    """
    problem = _try_client(config, role)
    if problem is None:
        return None
    culprit = next((k for k in config if _try_client({k: config[k]}, role) is not None), None)
    named = f"{culprit}: " if culprit is not None else ""
    return f"invalid {KAFKA_CONFIG}: {named}{problem}"


_SILENT = logging.getLogger("outboxkit.kafkaconf.check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False
_SILENT.disabled = True


def _try_client(config: Mapping[str, str], role: str) -> str | None:
    from confluent_kafka import Consumer, KafkaException, Producer

    props: dict[str, Any] = {
        k: v for k, v in config.items() if k not in ("bootstrap.servers", "metadata.broker.list")
    }
    # Only errors matter here; librdkafka's warnings about this throwaway client
    # ("no bootstrap.servers", producer properties on a consumer) would mislead.
    # With debug=... it logs anyway, straight to stderr outside the log format
    # unless a logger takes its lines: a silent one (the real client's logger
    # then routes the same debug lines through the log format).
    props.setdefault("log_level", 0)
    props["logger"] = _SILENT
    try:
        if role == "producer":
            Producer(props).flush(0)
        else:
            props.setdefault("group.id", "outboxkit-settings-check")
            Consumer(props).close()
    except KafkaException as exc:
        err = exc.args[0] if exc.args else exc
        return str(err.str()) if hasattr(err, "str") else str(err)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None
