"""Relay settings: every combination of timeouts that passes validation keeps the lease rule.

The rule (docs/relay.md): a batch is finalized or released while its row leases
and its shard leases still hold, and no row still queued in the producer is
released. Each check is recomputed here from the producer configuration the
relay really hands to librdkafka (``producer_config``), not from the settings
object's own helpers, so a timeout the helpers do not see (``delivery.timeout.ms``,
librdkafka's alias of ``message.timeout.ms``) cannot slip through.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outboxkit.relay.publish import producer_config
from outboxkit.relay.settings import RelaySettings
from outboxkit.runtime import ConfigError, load

pytestmark = pytest.mark.unit

_BASE = {
    "OUTBOXKIT_DB_URL": "mysql+pymysql://u:p@127.0.0.1:1/db",
    "OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1",
}
_TIMEOUT_NAMES = ("message.timeout.ms", "delivery.timeout.ms")


def _librdkafka_timeout_ms(config: dict[str, Any]) -> int:
    """What librdkafka uses: the two names are one property, the last one set wins
    (confluent-kafka sets the properties in the dict's order); 300000 when unset."""
    value = 300_000
    for key, raw in config.items():
        if key in _TIMEOUT_NAMES:
            value = int(raw)
    return value


def _try_load(env: dict[str, str]) -> RelaySettings | None:
    try:
        return load(RelaySettings, environ={**_BASE, **env})
    except ConfigError:
        return None


_seconds = st.one_of(
    st.integers(min_value=1, max_value=900).map(str),
    st.floats(min_value=0.001, max_value=900, allow_nan=False).map(lambda f: f"{f:.3f}"),
)
_ms = st.one_of(
    st.sampled_from(["0", "1", "1000", "30000", "45000", "60000", "120000", "300000"]),
    st.integers(min_value=0, max_value=2_000_000).map(str),
)


@st.composite
def _timeouts(draw: st.DrawFn) -> dict[str, str]:
    env: dict[str, str] = {}
    for name in ("LEASE_TTL", "FLUSH_TIMEOUT", "SHUTDOWN_TIMEOUT", "BATCH_DEADLINE"):
        if draw(st.booleans()):
            env[f"OUTBOXKIT_{name}"] = draw(_seconds)
    if draw(st.booleans()):
        env["OUTBOXKIT_REDIS_URL"] = "redis://127.0.0.1:1/0"
        for name in ("SHARD_LEASE_TTL", "SHARD_RENEW_INTERVAL"):
            if draw(st.booleans()):
                env[f"OUTBOXKIT_{name}"] = draw(_seconds)
    props = []
    for name in draw(st.permutations(_TIMEOUT_NAMES)):
        if draw(st.booleans()):
            props.append(f"{name}={draw(_ms)}")
    if props:
        env["OUTBOXKIT_KAFKA_CONFIG"] = ",".join(props)
    return env


@settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(env=_timeouts())
def test_every_accepted_combination_of_timeouts_keeps_the_lease_rule(env: dict[str, str]) -> None:
    s = _try_load(env)
    if s is None:
        return
    timeout_ms = _librdkafka_timeout_ms(producer_config(s, error_cb=lambda err: None))
    # 0 is "no timeout" in librdkafka: a queued row could outlive every lease.
    assert timeout_ms > 0, env
    deadline = s.effective_batch_deadline()
    # Rows without a report are released at the deadline; the producer must have
    # given up on them by then, or they are sent after the release (twice).
    assert deadline * 1000 >= timeout_ms, env
    # The batch is settled (deadline + drain flush) before its row leases expire.
    assert s.lease_ttl > deadline + s.flush_timeout, env
    if s.redis_url:
        # A relay that cannot renew stops claiming a batch budget before its shard
        # lease expires, with a renewal in between.
        assert s.shard_lease_ttl > 2 * s.shard_renew_interval + deadline + 1.0, env


@pytest.mark.parametrize(
    ("props", "fragment"),
    [
        # The alias alone, far above what the default lease allows.
        ("delivery.timeout.ms=600000", "--lease-ttl"),
        # Both names with different values: which one wins is librdkafka's business.
        ("message.timeout.ms=20000,delivery.timeout.ms=600000", "delivery.timeout.ms"),
        # 0 means "no timeout" in librdkafka.
        ("message.timeout.ms=0", "message.timeout.ms"),
        ("delivery.timeout.ms=0", "delivery.timeout.ms"),
        # isdigit() accepts it, int() does not.
        ("message.timeout.ms=\u00b2", "message.timeout.ms"),
        ("message.timeout.ms=99999999999999999999", "message.timeout.ms"),
    ],
)
def test_bad_message_timeouts_are_rejected(props: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(RelaySettings, environ={**_BASE, "OUTBOXKIT_KAFKA_CONFIG": props})
    assert fragment in str(info.value)


def test_the_alias_alone_drives_every_derived_budget() -> None:
    s = load(
        RelaySettings,
        environ={**_BASE, "OUTBOXKIT_KAFKA_CONFIG": "delivery.timeout.ms=5000"},
    )
    assert s.message_timeout_ms() == 5000
    assert s.effective_batch_deadline() == 7.0
    assert s.shard_batch_budget() == 8.0
    same = load(
        RelaySettings,
        environ={
            **_BASE,
            "OUTBOXKIT_KAFKA_CONFIG": "delivery.timeout.ms=5000,message.timeout.ms=5000",
        },
    )
    assert same.message_timeout_ms() == 5000


@pytest.mark.parametrize(
    ("props", "name"),
    [
        ("enable.idempotence=false", "enable.idempotence"),
        ("acks=1", "acks"),
        ("acks=0", "acks"),
        ("request.required.acks=1", "request.required.acks"),
        ("delivery.report.only.error=true", "delivery.report.only.error"),
        ("transactional.id=relay-1", "transactional.id"),
        ("partitioner=random", "partitioner"),
        ("error_cb=x", "error_cb"),
        ("no.such.property=1", "no.such.property"),
        ("linger.ms=soon", "linger.ms"),
    ],
)
def test_properties_the_guarantees_depend_on_are_refused_at_load(props: str, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(RelaySettings, environ={**_BASE, "OUTBOXKIT_KAFKA_CONFIG": props})
    message = str(info.value)
    assert "--kafka-config / OUTBOXKIT_KAFKA_CONFIG" in message and name in message


@pytest.mark.parametrize(
    "props",
    ["enable.idempotence=true", "acks=all", "acks=-1", "partitioner=murmur2", "linger.ms=5"],
)
def test_values_that_keep_the_guarantees_are_accepted(props: str) -> None:
    load(RelaySettings, environ={**_BASE, "OUTBOXKIT_KAFKA_CONFIG": props})


@pytest.mark.parametrize("value", ["0.001", "1e-320", "0.999"])
def test_a_connect_timeout_no_connection_can_meet_is_refused(value: str) -> None:
    """The relay's start wait has the consumer's floor: below a second, a start
    against a database and a broker that are up read as "unreachable" (exit 3)."""
    with pytest.raises(ConfigError) as info:
        load(RelaySettings, environ={**_BASE, "OUTBOXKIT_CONNECT_TIMEOUT": value})
    assert "--connect-timeout / OUTBOXKIT_CONNECT_TIMEOUT" in str(info.value)
    assert "at least 1 s" in str(info.value)
    assert (
        load(RelaySettings, environ={**_BASE, "OUTBOXKIT_CONNECT_TIMEOUT": "1"}).connect_timeout
        == 1
    )


def _producer(props: str) -> dict[str, Any]:
    s = load(RelaySettings, environ={**_BASE, "OUTBOXKIT_KAFKA_CONFIG": props} if props else _BASE)
    return producer_config(s, error_cb=lambda err: None)


@pytest.mark.parametrize(
    ("props", "socket_ms", "request_ms"),
    [
        # The default message timeout (30 s): a quarter of it, the broker's ack
        # wait two thirds of that.
        ("", 7500, 5000),
        ("message.timeout.ms=2000", 1000, 666),
        ("message.timeout.ms=20000", 5000, 3333),
        ("message.timeout.ms=4000", 2000, 1333),
        # Set by the operator, within the bounds: kept.
        ("socket.timeout.ms=4000,request.timeout.ms=3000", 4000, 3000),
    ],
)
def test_a_hung_leader_is_given_up_well_before_the_message_timeout(
    props: str, socket_ms: int, request_ms: int
) -> None:
    """librdkafka waits ``socket.timeout.ms`` (60 s by default, above the relay's
    message timeout) for a produce request's answer: a hung leader held the
    whole batch until its messages timed out. The relay derives both waits
    from the message timeout unless they are set."""
    config = _producer(props)
    waits = (int(config["socket.timeout.ms"]), int(config["request.timeout.ms"]))
    assert waits == (socket_ms, request_ms)


@pytest.mark.parametrize(
    ("props", "fragment"),
    [
        ("socket.timeout.ms=20000", "socket.timeout.ms must be at most half"),
        ("message.timeout.ms=10000,socket.timeout.ms=6000", "socket.timeout.ms must be at most"),
        ("request.timeout.ms=30000", "request.timeout.ms must be below socket.timeout.ms"),
        ("socket.timeout.ms=3000,request.timeout.ms=3000", "request.timeout.ms must be below"),
    ],
)
def test_request_timeouts_near_the_message_timeout_are_refused(props: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(RelaySettings, environ={**_BASE, "OUTBOXKIT_KAFKA_CONFIG": props})
    assert fragment in str(info.value)
    assert "OUTBOXKIT_KAFKA_CONFIG" in str(info.value)
