from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from outboxkit.runtime import ConfigError, RuntimeSettings, add_arguments, describe, load, setting
from outboxkit.runtime.settings import (
    parse_bool,
    parse_duration,
    positive,
    renamed_in_use,
    warn_renamed,
)
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demo(RuntimeSettings):
    lease_ttl: float = setting(60.0, help="lease length", validate=positive)
    batch_size: int = setting(100, help="rows per claim", validate=positive)
    dry_run: bool = setting(False, help="do not publish")
    topics: tuple[str, ...] = setting((), help="topics")
    table: str = setting(help="outbox table")  # required
    sasl_token: str | None = setting(None, help="token", secret=True)
    idle_ms: float = setting(0.5, help="idle wait", env="IDLE_WAIT")

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.lease_ttl <= self.shutdown_timeout:
            problems.append("--lease-ttl must be greater than --shutdown-timeout")
        return problems


def parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return parser.parse_args(argv)


def test_precedence_flag_over_env_over_default() -> None:
    env = {"OUTBOXKIT_TABLE": "t", "OUTBOXKIT_LEASE_TTL": "45", "OUTBOXKIT_BATCH_SIZE": "7"}
    s = load(Demo, args=parse(Demo, ["--lease-ttl", "60"]), environ=env)
    assert s.lease_ttl == 60.0  # flag
    assert s.batch_size == 7  # env
    assert s.shutdown_timeout == 30.0  # default
    assert s.table == "t"


def test_no_args_uses_environment_only() -> None:
    s = load(Demo, environ={"OUTBOXKIT_TABLE": "outbox", "OUTBOXKIT_DRY_RUN": "yes"})
    assert s.dry_run is True
    assert s.node_id  # computed default
    assert s.health_host == "127.0.0.1"


def test_custom_env_name() -> None:
    s = load(Demo, environ={"OUTBOXKIT_TABLE": "t", "IDLE_WAIT": "250ms"})
    assert s.idle_ms == 0.25


def test_error_names_flag_and_env() -> None:
    with pytest.raises(ConfigError) as info:
        load(Demo, environ={"OUTBOXKIT_TABLE": "t", "OUTBOXKIT_LEASE_TTL": "-1"})
    assert str(info.value) == "invalid --lease-ttl / OUTBOXKIT_LEASE_TTL: must be > 0 (got '-1')"


def test_all_errors_are_reported_together() -> None:
    env = {"OUTBOXKIT_BATCH_SIZE": "ten", "OUTBOXKIT_DRY_RUN": "maybe", "OUTBOXKIT_LOG_LEVEL": "x"}
    with pytest.raises(ConfigError) as info:
        load(Demo, environ=env)
    errors = info.value.errors
    assert "invalid --batch-size / OUTBOXKIT_BATCH_SIZE: must be an integer (got 'ten')" in errors
    assert any(e.startswith("invalid --dry-run / OUTBOXKIT_DRY_RUN:") for e in errors)
    assert any(
        e.startswith("invalid --log-level / OUTBOXKIT_LOG_LEVEL: must be one of") for e in errors
    )
    assert any(e.startswith("missing --table / OUTBOXKIT_TABLE") for e in errors)
    assert isinstance(info.value, ValueError)


def test_cross_field_validate() -> None:
    with pytest.raises(ConfigError, match="--lease-ttl must be greater than --shutdown-timeout"):
        load(Demo, environ={"OUTBOXKIT_TABLE": "t", "OUTBOXKIT_LEASE_TTL": "10"})


def test_secret_values_are_not_echoed_in_errors() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithSecret:
        api_pin: int = setting(1, help="pin", secret=True)

    with pytest.raises(ConfigError) as info:
        load(WithSecret, environ={"OUTBOXKIT_API_PIN": "not-a-number-s3cret"})
    assert "s3cret" not in str(info.value)
    assert "(got '***')" in str(info.value)


def test_bad_url_value_is_redacted_in_error() -> None:
    with pytest.raises(ConfigError) as info:
        load(RuntimeSettings, environ={"OUTBOXKIT_DB_URL": "mysql//u:pw@h"})
    assert "invalid --db-url / OUTBOXKIT_DB_URL" in str(info.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1", 1.0),
        ("0.25", 0.25),
        (".5", 0.5),
        ("500ms", 0.5),
        ("2s", 2.0),
        ("1m", 60.0),
        ("1.5m", 90.0),
        ("1h", 3600.0),
        (" 3 s ", 3.0),
        ("-1", -1.0),
        ("1e3ms", 1.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "1d", "ms", "1 2", "inf", "nan", "1,5"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration like 500ms"):
        parse_duration(text)


def test_duration_error_message() -> None:
    with pytest.raises(
        ConfigError,
        match=r"invalid --shutdown-timeout / OUTBOXKIT_SHUTDOWN_TIMEOUT: "
        r"must be a number of seconds or a duration like 500ms, 2s, 1m \(got '10x'\)",
    ):
        load(RuntimeSettings, environ={"OUTBOXKIT_SHUTDOWN_TIMEOUT": "10x"})


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("TRUE", True),
        ("on", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("Off", False),
        ("no", False),
    ],
)
def test_parse_bool(text: str, value: bool) -> None:
    assert parse_bool(text) is value


def test_bool_flags() -> None:
    env = {"OUTBOXKIT_TABLE": "t", "OUTBOXKIT_DRY_RUN": "true"}
    assert load(Demo, args=parse(Demo, ["--no-dry-run"]), environ=env).dry_run is False
    assert load(Demo, args=parse(Demo, ["--dry-run"]), environ={"OUTBOXKIT_TABLE": "t"}).dry_run


def test_kafka_config_from_env_keeps_commas_inside_values() -> None:
    env = {"OUTBOXKIT_KAFKA_CONFIG": "bootstrap.servers=a:9092,b:9092, acks = all,linger.ms=5"}
    s = load(RuntimeSettings, environ=env)
    assert s.kafka_config == {"bootstrap.servers": "a:9092,b:9092", "acks": "all", "linger.ms": "5"}


def test_kafka_config_flags_override_env_per_key() -> None:
    env = {"OUTBOXKIT_KAFKA_CONFIG": "acks=1,security.protocol=SASL_SSL"}
    args = parse(RuntimeSettings, ["--kafka-config", "acks=all", "--kafka-config", "x=a=b"])
    s = load(RuntimeSettings, args=args, environ=env)
    assert s.kafka_config == {"acks": "all", "security.protocol": "SASL_SSL", "x": "a=b"}


@pytest.mark.parametrize("bad", ["noequals", "=value"])
def test_kafka_config_bad_entry(bad: str) -> None:
    with pytest.raises(
        ConfigError,
        match=r"invalid --kafka-config / OUTBOXKIT_KAFKA_CONFIG: "
        r"must be key=value",
    ):
        load(RuntimeSettings, args=parse(RuntimeSettings, ["--kafka-config", bad]), environ={})


def test_tuple_and_optional_and_empty_env() -> None:
    env = {
        "OUTBOXKIT_TABLE": "t",
        "OUTBOXKIT_TOPICS": "a, b,,c",
        "OUTBOXKIT_REDIS_URL": "",
        "OUTBOXKIT_BATCH_SIZE": "",
    }
    s = load(Demo, environ=env)
    assert s.topics == ("a", "b", "c")
    assert s.redis_url is None
    assert s.batch_size == 100


def test_settings_are_frozen_and_keyword_only() -> None:
    s = load(Demo, environ={"OUTBOXKIT_TABLE": "t"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.table = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Demo("t")  # type: ignore[misc]


def test_help_shows_env_default_and_secret_marker(capsys: pytest.CaptureFixture[str]) -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Help:
        lease_ttl: float = setting(30.0, help="lease 100% of the time")
        password: str = setting("default-pw-value", help="the password", secret=True)
        name: str = setting(help="a name")

    parser = argparse.ArgumentParser(prog="x")
    add_arguments(parser, Help)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--lease-ttl LEASE_TTL lease 100% of the time (env OUTBOXKIT_LEASE_TTL; default: 30.0)"
        in out
    )
    assert "(secret; env OUTBOXKIT_PASSWORD)" in out
    assert "default-pw-value" not in out
    assert "(env OUTBOXKIT_NAME; required)" in out


def test_secrets_are_registered_and_described_redacted() -> None:
    env = {
        "OUTBOXKIT_TABLE": "t",
        "OUTBOXKIT_DB_URL": "mysql+pymysql://app:db%2Fpw9-long-enough@db:3306/x",
        "OUTBOXKIT_REDIS_URL": "redis://:redispw7-long-enough@r:6379/0",
        "OUTBOXKIT_KAFKA_CONFIG": "sasl.password=kafkapw5-long-enough,sasl.username=app",
        "OUTBOXKIT_SASL_TOKEN": "tok3n-value-long-enough",
    }
    secrets = (
        "db/pw9-long-enough",
        "db%2Fpw9-long-enough",
        "kafkapw5-long-enough",
        "redispw7-long-enough",
        "tok3n-value-long-enough",
    )
    s = load(Demo, environ=env)
    view = describe(s)
    assert view["db_url"] == "mysql+pymysql://app:***@db:3306/x"
    assert view["redis_url"] == "redis://:***@r:6379/0"
    # librdkafka flags sasl.username as sensitive too.
    assert view["kafka_config"] == {"sasl.password": "***", "sasl.username": "***"}
    assert view["sasl_token"] == "***"
    assert view["topics"] == []
    with capture_json_logs() as cap:
        log = logging.getLogger("outboxkit.test")
        log.info("raw secrets %s", " / ".join(secrets))
        try:
            raise RuntimeError(f"settings were {s!r}")
        except RuntimeError:
            log.exception("crash")
    for secret in secrets:
        assert secret not in cap.text
    assert "sasl.username" in cap.text


def test_unsupported_annotation_needs_a_parser() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Odd:
        ratio: complex = setting(1j, help="?")

    with pytest.raises(TypeError, match="pass parse="):
        load(Odd, environ={})

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Custom:
        ratio: complex = setting(1j, help="?", parse=complex)

    assert load(Custom, environ={"OUTBOXKIT_RATIO": "2+1j"}).ratio == 2 + 1j


def test_node_id_must_fit_the_lease_owner_column() -> None:
    """The node id is written as every claimed row's lease_owner (VARCHAR(255)); a
    longer one must be refused at start, not by the database at the first claim."""
    from outboxkit.schema.table import MAX_OWNER_LENGTH

    ok = load(RuntimeSettings, environ={"OUTBOXKIT_NODE_ID": "n" * MAX_OWNER_LENGTH})
    assert len(ok.node_id) == MAX_OWNER_LENGTH
    with pytest.raises(ConfigError, match="--node-id / OUTBOXKIT_NODE_ID"):
        load(RuntimeSettings, environ={"OUTBOXKIT_NODE_ID": "n" * (MAX_OWNER_LENGTH + 1)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Renamed(RuntimeSettings):
    retry_backoff_base: float = setting(
        0.5, help="first window", validate=positive, aliases=("backoff_base",)
    )


@pytest.mark.parametrize("new_flag", [None, "1"])
@pytest.mark.parametrize("old_flag", [None, "2"])
@pytest.mark.parametrize("new_env", [None, "3"])
@pytest.mark.parametrize("old_env", [None, "4"])
def test_a_former_name_still_works_and_how_it_ranks(
    new_flag: str | None, old_flag: str | None, new_env: str | None, old_env: str | None
) -> None:
    """Every mix of the new and the old flag and variable: flags rank over variables,
    both flags are an error, and the old variable wins over the new one (a shared
    ConfigMap may set the new name for another service)."""
    argv = [*(["--retry-backoff-base", new_flag] if new_flag else [])]
    argv += ["--backoff-base", old_flag] if old_flag else []
    env = {"OUTBOXKIT_RETRY_BACKOFF_BASE": new_env, "OUTBOXKIT_BACKOFF_BASE": old_env}
    environ = {k: v for k, v in env.items() if v is not None}
    if new_flag and old_flag:
        with pytest.raises(ConfigError) as info:
            load(Renamed, args=parse(Renamed, argv), environ=environ)
        assert "--retry-backoff-base and its old name --backoff-base are both given" in str(
            info.value
        )
        return
    s = load(Renamed, args=parse(Renamed, argv), environ=environ)
    expected, renamed = next(
        (value, pair)
        for value, pair in [
            (new_flag, ()),
            (old_flag, (("--backoff-base", "--retry-backoff-base"),)),
            (old_env, (("OUTBOXKIT_BACKOFF_BASE", "OUTBOXKIT_RETRY_BACKOFF_BASE"),)),
            (new_env, ()),
            ("0.5", ()),
        ]
        if value is not None
    )
    assert s.retry_backoff_base == float(expected)
    assert renamed_in_use(s) == renamed


def test_a_bad_value_under_a_former_name_names_the_old_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load(Renamed, environ={"OUTBOXKIT_BACKOFF_BASE": "-1"})
    assert (
        "invalid OUTBOXKIT_BACKOFF_BASE (old name of OUTBOXKIT_RETRY_BACKOFF_BASE): must be > 0"
        in str(info.value)
    )


def test_the_old_flag_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(Renamed, ["--help"])
    assert "--backoff-base" in capsys.readouterr().out


def test_renamed_settings_are_logged_once_each_at_warning() -> None:
    s = load(Renamed, environ={"OUTBOXKIT_BACKOFF_BASE": "2"})
    with capture_json_logs() as cap:
        warn_renamed(logging.getLogger("outboxkit.test"), s)
    records = cap.events("setting-renamed")
    assert [(r["event"], r["level"], r["old"], r["new"]) for r in records] == [
        ("setting-renamed", "WARNING", "OUTBOXKIT_BACKOFF_BASE", "OUTBOXKIT_RETRY_BACKOFF_BASE")
    ]


def test_relay_settings_take_the_former_keywords() -> None:
    from outboxkit.relay import RelaySettings

    s = RelaySettings(backoff_base=0.25, backoff_cap=9.0)
    assert (s.retry_backoff_base, s.retry_backoff_cap) == (0.25, 9.0)
    assert dataclasses.replace(s, batch_size=7).retry_backoff_cap == 9.0
    assert RelaySettings().retry_backoff_cap == 300.0


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ("acks=all,linger.ms=5", "2 (acks, linger.ms)"),
        (
            "security.protocol=SASL_SSL, sasl.password=hunter2,x",
            "2 (security.protocol, sasl.password)",
        ),
    ],
)
def test_a_comma_list_given_to_the_kafka_config_flag_is_refused(given: str, named: str) -> None:
    """The variable takes ``k=v,k2=v2``, the flag one ``k=v`` per use: a comma list
    given to the flag once reached librdkafka as one property's value."""
    with pytest.raises(ConfigError) as raised:
        load(RuntimeSettings, args=parse(RuntimeSettings, ["--kafka-config", given]), environ={})
    text = str(raised.value)
    assert f"--kafka-config takes one property per use, this one holds {named}" in text
    assert "the variable OUTBOXKIT_KAFKA_CONFIG is the one that takes a comma list" in text
    assert "hunter2" not in text


@pytest.mark.parametrize(
    "one",
    [
        "bootstrap.servers=a:9092,b:9092",
        "sasl.oauthbearer.extensions=logicalCluster=lkc-1,identityPoolId=pool-2",
        "client.id=a,b",
    ],
)
def test_one_property_with_commas_in_its_value_is_accepted_from_the_flag(one: str) -> None:
    s = load(RuntimeSettings, args=parse(RuntimeSettings, ["--kafka-config", one]), environ={})
    key, _, value = one.partition("=")
    assert s.kafka_config == {key: value}
