"""Which shard ownership, wake-ups and pipeline the relay picks, per database and Redis.

``--shard-ownership auto`` keeps MySQL/MariaDB as it was (Redis leases with
``--redis-url``, else every shard) and picks advisory locks on PostgreSQL
without Redis. Wake-ups on PostgreSQL are ``NOTIFY``, with or without Redis.
The pipeline is on by default on PostgreSQL and off on MySQL/MariaDB; a given
``--pipeline`` / ``--no-pipeline`` wins on either.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outboxkit.relay.settings import SHARD_OWNERSHIPS, RelaySettings
from outboxkit.runtime import ConfigError, load
from outboxkit.runtime.settings import add_arguments

pytestmark = pytest.mark.unit

URLS = {
    "mysql": "mysql+pymysql://u:secret-pw@127.0.0.1:1/db",
    "postgresql": "postgresql+psycopg://u:secret-pw@127.0.0.1:1/db",
    "sqlite": "sqlite:///x.db",
}
REDIS = "redis://127.0.0.1:1/0"


def _settings(db: str, redis: bool, ownership: str, wakeups: bool = True) -> RelaySettings:
    return RelaySettings(
        db_url=URLS[db],
        redis_url=REDIS if redis else None,
        kafka_bootstrap="127.0.0.1:1",
        shard_ownership=ownership,
        wakeups=wakeups,
    )


def _expected(db: str, redis: bool, ownership: str) -> str | None:
    """The ownership the relay must use, or None when the settings must be refused."""
    if ownership == "auto":
        return "redis" if redis else "advisory" if db == "postgresql" else "all"
    if ownership == "advisory" and db != "postgresql":
        return None
    if ownership == "redis" and not redis:
        return None
    return ownership


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    db=st.sampled_from(sorted(URLS)),
    redis=st.booleans(),
    ownership=st.sampled_from(SHARD_OWNERSHIPS),
)
def test_the_ownership_follows_the_database_and_redis(db: str, redis: bool, ownership: str) -> None:
    s = _settings(db, redis, ownership)
    expected = _expected(db, redis, ownership)
    problems = [p for p in s.validate() if "shard-ownership" in p]
    if expected is None:
        assert len(problems) == 1, problems
        assert "OUTBOXKIT_SHARD_OWNERSHIP" in problems[0]
        assert "secret-pw" not in problems[0]
    else:
        assert problems == []
        assert s.effective_shard_ownership() == expected


@settings(max_examples=24, derandomize=True, deadline=None)
@given(db=st.sampled_from(sorted(URLS)), redis=st.booleans(), wakeups=st.booleans())
def test_wakeups_are_notify_on_postgresql(db: str, redis: bool, wakeups: bool) -> None:
    s = _settings(db, redis, "auto", wakeups)
    if not wakeups:
        expected = "poll"
    elif db == "postgresql":
        expected = "notify"  # preferred over Redis hints: sent at commit, never for a rollback
    else:
        expected = "redis" if redis else "poll"
    assert s.wakeup_source() == expected


def test_the_setting_is_read_from_flag_and_environment() -> None:
    env = {"OUTBOXKIT_DB_URL": URLS["mysql"], "OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    assert load(RelaySettings, environ=env).shard_ownership == "auto"
    got = load(RelaySettings, environ={**env, "OUTBOXKIT_SHARD_OWNERSHIP": "all"})
    assert got.shard_ownership == "all"
    with pytest.raises(ConfigError, match="shard-ownership"):
        load(RelaySettings, environ={**env, "OUTBOXKIT_SHARD_OWNERSHIP": "zookeeper"})


def test_advisory_on_mysql_exits_2_naming_the_setting() -> None:
    args = ["relay", "--db-url", URLS["mysql"], "--kafka-bootstrap", "127.0.0.1:1"]
    proc = subprocess.run(
        [sys.executable, "-m", "outboxkit", *args, "--shard-ownership", "advisory"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--shard-ownership" in proc.stderr and "PostgreSQL" in proc.stderr
    assert "secret-pw" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("given", "dialect", "expected"),
    [
        (None, "postgresql", True),
        (None, "mysql", False),
        (True, "mysql", True),
        (False, "postgresql", False),
        (True, "postgresql", True),
        (False, "mysql", False),
    ],
)
def test_the_pipeline_defaults_to_on_with_postgresql_only(
    given: bool | None, dialect: str, expected: bool
) -> None:
    s = RelaySettings(db_url=URLS[dialect], kafka_bootstrap="127.0.0.1:1", pipeline=given)
    assert s.validate() == []
    assert s.effective_pipeline(dialect) is expected


@pytest.mark.parametrize(
    ("value", "expected"), [(None, None), ("", None), ("true", True), ("0", False)]
)
def test_the_pipeline_is_unset_unless_given(value: str | None, expected: bool | None) -> None:
    env = {"OUTBOXKIT_DB_URL": URLS["postgresql"], "OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    if value is not None:
        env["OUTBOXKIT_PIPELINE"] = value
    assert load(RelaySettings, environ=env).pipeline is expected
    parser = argparse.ArgumentParser()
    add_arguments(parser, RelaySettings)
    flagged = load(RelaySettings, args=parser.parse_args(["--no-pipeline"]), environ=env)
    assert flagged.pipeline is False
