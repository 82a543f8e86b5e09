"""Fuzz every command's flags and environment variables.

The only acceptable outcomes of ``outboxkit <command> ...`` with hostile input are
success or a clear refusal: exit 2 (3 where a database URL points nowhere) with
``outboxkit ...: <message>`` on stderr, never a traceback and never an exception
out of ``main``. The flags are read from the real parser, so a new flag is fuzzed
without touching this file. Parsing and validation run in-process (fast); the
services themselves are replaced by stubs that only record their settings, and
the admin commands run against the real database. ``test_extreme_accepted_values_
run_without_a_crash_loop`` then runs a real relay with the largest values that
are accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outboxkit import cli
from outboxkit.runtime.testing import reset_logging

REPO = Path(__file__).resolve().parent.parent

HOSTILE = [
    "",
    " ",
    "0",
    "-1",
    "1e999",
    "-1e999",
    "nan",
    "inf",
    "1e-300",
    "18446744073709551616",
    "9" * 40,
    "\u00b2",
    "\u0661\u0662",
    "1_000",
    "0x10",
    "abc",
    "orders\n",
    "outbox_events\n",
    "a" * 300,
    "\udcff",
    "x\x00y",
    "999999d",
    "3650d",
    "1e308s",
    "7d",
    "2147483647",
    "9223372036854775807",
    "10000-01-01",
    "0001-01-01T00:00:00+01:00",
    "9999-12-31T23:59:59-05:00",
    "2024-02-30",
    "mysql+pymysql://u:p@ss@127.0.0.1:3306/db",
    "mysql+pymysql://u:p:ss@127.0.0.1:1/db",
    "nosuch://u:p@h/db",
    "mysql+pymysql://u:p@h:abc/db",
    "mysql+pymysql://u:p@[::1/db",
    "redis://h:99999/0",
    "redis://:e@127.0.0.1:1/0",
    "ftp://h/x",
    "http://[::1",
    "message.timeout.ms=\u00b2",
    "delivery.timeout.ms=0",
    "message.timeout.ms=0",
    "enable.auto.commit=false",
    "enable.idempotence=false",
    "acks=1",
    "no.such.property=1",
    "partitioner=random",
    "=v",
    "k",
    "ssl.key.pem=-----BEGIN PRIVATE KEY-----\nabc",
    "--help",
    "-",
]
_value = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=30))


def _leaf_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every runnable command (``relay``, ``admin show``...) and its parser."""
    out: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[path] = parser
            return
        for name, child in subs[0].choices.items():
            walk((*path, name), child)

    walk((), cli.build_parser())
    return out


LEAVES = _leaf_parsers()


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, bool]]:
    """(flag, takes a value) for every option but --help."""
    out = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len)
        out.append((flag, action.nargs != 0))
    return out


def _env_names(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(
        "OUTBOXKIT_" + a.dest.upper()
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "json")
    )


def _positionals(path: tuple[str, ...]) -> list[str]:
    if path == ("consume",):
        return ["stub:Consumer"]
    if path == ("admin", "show"):
        return ["evt-1"]
    return []


@st.composite
def _invocation(draw: st.DrawFn) -> tuple[tuple[str, ...], list[str], dict[str, str]]:
    path = draw(st.sampled_from(sorted(LEAVES)))
    parser = LEAVES[path]
    argv = [*path, *_positionals(path)]
    for flag, takes_value in draw(
        st.lists(st.sampled_from(_options(parser)), max_size=4, unique=True)
    ):
        argv.append(flag)
        if takes_value:
            argv.append(draw(_value))
    env = {
        name: draw(_value).replace("\x00", "")  # the OS cannot carry NUL in a variable
        for name in draw(st.lists(st.sampled_from(_env_names(parser)), max_size=3, unique=True))
    }
    return path, argv, env


#: ``(service, handle_signals)`` of every stubbed ``run`` call.
_RUNS: list[tuple[str, bool | None]] = []


class _StubRelay:
    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def run(self, *, handle_signals: bool | None = None) -> int:
        _RUNS.append(("relay", handle_signals))
        return 0


class _StubConsumer:
    closed_cleanly = True

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def run(self, *, handle_signals: bool | None = None) -> int:
        _RUNS.append(("consumer", handle_signals))
        return 0


@contextlib.contextmanager
def _stubbed_services() -> Iterator[None]:
    """Everything but parsing, validation and the admin queries is replaced."""
    report = mock.Mock(actions=[], table="outbox_events", shard_count=8)
    with (
        mock.patch("outboxkit.relay.relay.Relay", _StubRelay),  # imported by run()
        mock.patch("outboxkit.consumer.cli.load_consumer_class", lambda target: _StubConsumer),
        mock.patch("outboxkit.consumer.cli.configure_logging"),
        mock.patch("outboxkit.relay.cli.configure_logging"),
        mock.patch("outboxkit.schema.cli.apply_schema", return_value=report),
        mock.patch("outboxkit.demo.runner.run_demo", return_value=mock.Mock(ok=True)),
    ):
        yield


def _run(argv: list[str], env: dict[str, str], db_url: str) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    clean["OUTBOXKIT_DB_URL"] = db_url
    clean.update(env)
    err = io.StringIO()
    with (
        mock.patch.dict(os.environ, clean, clear=True),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            code: Any = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    reset_logging()
    return (0 if code is None else int(code)), err.getvalue()


def _assert_clear_outcome(argv: list[str], env: dict[str, str], code: int, err: str) -> None:
    context = f"argv={argv!r} env={env!r}\nstderr:\n{err}"
    assert code in (0, 2, 3), context
    assert "Traceback" not in err, context
    if code != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines, context
        first = lines[0]
        assert first.startswith("outboxkit") or first.startswith("{"), context
        # usage errors and settings errors: the first line says what is wrong
        if not first.startswith("{"):
            assert ": " in first, context


def test_both_clis_run_their_service_the_same_way(db_url: str) -> None:
    """Both entry points own the process: ``run(handle_signals=True)``, nothing else."""
    _RUNS.clear()
    with _stubbed_services():
        assert _run(["relay"], {"OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1"}, db_url)[0] == 0
        consume = ["consume", "pkg.module:Handler", "--topics", "t", "--group-id", "g"]
        assert _run(consume, {"OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1"}, db_url)[0] == 0
    assert _RUNS == [("relay", True), ("consumer", True)]


@pytest.mark.integration
@settings(
    max_examples=250,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=_invocation())
def test_every_command_answers_hostile_flags_and_variables_clearly(
    call: tuple[tuple[str, ...], list[str], dict[str, str]], db_url: str, outbox: str
) -> None:
    _, argv, env = call
    with _stubbed_services():
        code, err = _run(argv, env, db_url)
    _assert_clear_outcome(argv, env, code, err)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["relay", "--db-url", "mysql+pymysql://u:p@ss@127.0.0.1:3306/db"], {}, "--db-url"),
        (["relay", "--db-url", "nosuch://u:p@h/db"], {}, "unknown database scheme"),
        (["relay", "--db-url", "mysql+pymysql://u:p@h:abc/db"], {}, "port"),
        (["relay", "--poll-interval", "1e999"], {}, "--poll-interval"),
        (["relay", "--batch-size", "18446744073709551616"], {}, "--batch-size"),
        (["relay", "--retention", "999999d"], {}, "--retention"),
        (["relay"], {"OUTBOXKIT_KAFKA_CONFIG": "message.timeout.ms=\u00b2"}, "message.timeout"),
        (["relay", "--table", "outbox_events\n"], {}, "--table"),
        (["relay", "--table", "t\udcff"], {}, "not valid UTF-8"),
        (["schema", "apply", "--help"], {"OUTBOXKIT_SHARDS": "abc"}, ""),
        (["schema", "apply"], {"OUTBOXKIT_SHARDS": "abc"}, "OUTBOXKIT_SHARDS"),
        (["consume", "stub:C"], {"OUTBOXKIT_KAFKA_CONFIG": "no.such=1"}, "no.such"),
        (["admin", "purge", "--older-than", "1d", "--pause", "1e999"], {}, "--pause"),
        (["admin", "purge", "--older-than", "1d", "--pause", "1h"], {}, "--pause"),
        (["admin", "purge", "--older-than", "99999999999d", "--dry-run"], {}, "--older-than"),
        (["admin", "requeue", "--since", "9999-12-31T23:59:59-05:00"], {}, "--since"),
        (["admin", "failed", "--limit", "99999999999999999999999"], {}, "--limit"),
        (["admin", "show", "x\udcff"], {}, "not valid UTF-8"),
        (["demo", "--rate", "nan"], {}, "--rate"),
    ],
)
def test_examples_from_the_report_exit_2_with_one_clear_line(
    argv: list[str], env: dict[str, str], needle: str, db_url: str, outbox: str
) -> None:
    with _stubbed_services():
        code, err = _run(
            [*argv, "--kafka-bootstrap", "x:1"] if argv[0] == "relay" else argv, env, db_url
        )
    if "--help" in argv:
        assert code == 0, err
        return
    assert code == 2, err
    assert "Traceback" not in err
    assert needle in err.splitlines()[0] or needle in err, err
    assert "p@ss" not in err and ":p@" not in err  # no password, not even a part of it


@pytest.mark.integration
def test_admin_show_of_a_row_with_undecodable_headers(db_url: str, outbox: str) -> None:
    import sqlalchemy as sa

    from outboxkit import Event, enqueue_many

    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            enqueue_many(conn, [Event(topic="orders", payload=b"{}", event_id="evt-bad-headers")])
            conn.execute(
                sa.text(f"UPDATE {outbox} SET headers = :h WHERE event_id = 'evt-bad-headers'"),
                {"h": '{"x": {"base64": "%%%"}}'},
            )
    finally:
        engine.dispose()
    code, err = _run(["admin", "show", "evt-bad-headers", "--json"], {}, db_url)
    assert code == 0, err
    assert "Traceback" not in err


def _subprocess(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-P", "-m", "outboxkit", *args],
        capture_output=True,
        env=full,
        cwd=REPO,
        timeout=60,
        check=False,
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["relay", "--batch-size", "18446744073709551616"], {}),
        (["relay", "--poll-interval", "1e999"], {}),
        (["relay"], {"OUTBOXKIT_RETENTION": "999999d"}),
        (["schema", "apply", "--help"], {"OUTBOXKIT_SHARDS": "abc"}),
        (["consume", "x:Y", "--kafka-config", "enable.auto.commit=false"], {}),
        (["admin", "show", b"\xff\xfe".decode("utf-8", "surrogateescape")], {}),
        (["relay"], {"OUTBOXKIT_TABLE": b"t\xff".decode("utf-8", "surrogateescape")}),
    ],
)
def test_real_console_script_refuses_with_one_line(
    args: list[str], env: dict[str, str], db_url: str, outbox: str
) -> None:
    """The installed entry point as an operator runs it, bytes and all."""
    done = _subprocess(
        [*args], {"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1", **env}
    )
    err = done.stderr.decode("utf-8", "replace")
    if "--help" in args:
        assert done.returncode == 0, err
        return
    assert done.returncode == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outboxkit"), err


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
            return int(resp.status)
    except OSError:
        return 0


@pytest.mark.integration
def test_extreme_accepted_values_run_without_a_crash_loop(
    db_url: str, outbox: str, kafka_bootstrap: str
) -> None:
    """The largest values the relay accepts keep it running: no worker crash, ready."""
    args = [
        "relay", "--kafka-bootstrap", kafka_bootstrap, "--health-port", "0",
        "--start-jitter", "0", "--log-level", "DEBUG",
        "--batch-size", "2147483647", "--max-attempts", "2147483647",
        "--poll-interval", "168h", "--metrics-interval", "168h", "--backoff-cap", "168h",
        "--paused-topic-retry", "168h", "--retention", "3650d", "--retention-interval", "1s",
        "--retention-batch-size", "2147483647", "--retention-pause", "60",
        "--lease-ttl", "168h", "--shutdown-timeout", "168h", "--flush-timeout", "1",
        "--connect-timeout", "168h",
    ]  # fmt: skip
    full = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    full["OUTBOXKIT_DB_URL"] = db_url
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "outboxkit", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=full,
        cwd=REPO,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        port = None
        purged = False
        os.set_blocking(proc.stderr.fileno(), False)
        while time.monotonic() < deadline and not (port and purged):
            chunk = proc.stderr.readline()
            if not chunk:
                assert proc.poll() is None, "\n".join(lines)
                time.sleep(0.05)
                continue
            lines.append(chunk.rstrip("\n"))
            record = json.loads(chunk)
            if record.get("event") == "health-server-started":
                port = record["port"]
            if record.get("event") == "purge-finished":
                purged = True
        assert port and purged, "\n".join(lines)
        assert _http_status(f"http://127.0.0.1:{port}/healthz/ready") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        rest = proc.stderr.read() or ""
        lines += rest.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
    events = [json.loads(line).get("event") for line in lines if line.startswith("{")]
    assert "worker-crashed" not in events, "\n".join(lines)
    assert "Traceback" not in "\n".join(lines)


def test_a_comma_list_given_to_kafka_config_exits_2_saying_to_repeat_the_flag() -> None:
    """As a user types it: ``--kafka-config`` like ``OUTBOXKIT_KAFKA_CONFIG``. Refused at
    settings validation, before anything connects, without echoing a value."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    given = "security.protocol=SASL_PLAINTEXT,sasl.mechanism=PLAIN,sasl.password=hunter2"
    result = subprocess.run(
        [sys.executable, "-P", "-m", "outboxkit", "relay", "--db-url",
         "mysql+pymysql://u:p@127.0.0.1:1/db", "--kafka-bootstrap", "127.0.0.1:1",
         "--kafka-config", given],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert (
        "invalid --kafka-config / OUTBOXKIT_KAFKA_CONFIG: --kafka-config takes one property "
        "per use, this one holds 3 (security.protocol, sasl.mechanism, sasl.password): repeat "
        "the flag (--kafka-config security.protocol=... --kafka-config sasl.mechanism=... "
        "--kafka-config sasl.password=...)"
    ) in " ".join(result.stderr.split())
    assert "hunter2" not in result.stderr
