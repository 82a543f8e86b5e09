from __future__ import annotations

import io
import json
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outboxkit.runtime import configure_logging, log_event, redact, redact_url, register_secret
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.unit

log = logging.getLogger("outboxkit.test")


def test_json_line_shape() -> None:
    with capture_json_logs(service="relay", node_id="pod-1") as cap:
        log_event(log, "batch-done", delivered=3, topics=("a", "b"), ratio=0.5, none=None)
        log.warning("plain %s", "text")
    first, second = cap.records
    assert list(first)[:6] == ["ts", "level", "logger", "service", "node_id", "event"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(first["ts"]))
    assert first["level"] == "INFO"
    assert first["logger"] == "outboxkit.test"
    assert (first["service"], first["node_id"], first["event"]) == ("relay", "pod-1", "batch-done")
    assert first["delivered"] == 3
    assert first["topics"] == ["a", "b"]
    assert first["ratio"] == 0.5
    assert first["none"] is None
    assert "msg" not in first
    assert second["event"] == "log"
    assert second["msg"] == "plain text"
    assert second["level"] == "WARNING"


def test_non_serialisable_values_and_reserved_names() -> None:
    class Thing:
        def __str__(self) -> str:
            return "thing!"

    with capture_json_logs() as cap:
        log_event(log, "odd", obj=Thing(), b=b"\x00", nan=float("nan"), ts="t", service="other")
    (rec,) = cap.records
    assert rec["obj"] == "thing!"
    assert rec["nan"] == "nan"
    assert rec["event"] == "odd"
    assert rec["ts_"] == "t"
    assert rec["service_"] == "other"
    assert rec["service"] == "test"


def test_configure_logging_is_idempotent() -> None:
    a, b = io.StringIO(), io.StringIO()
    configure_logging(service="s", node_id="n", stream=a)
    configure_logging(service="s", node_id="n2", stream=b, level="warning")
    log.warning("once")
    log.info("filtered")
    assert a.getvalue() == ""
    lines = b.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["node_id"] == "n2"


def test_bad_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging(service="s", node_id="n", level="loud", stream=io.StringIO())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mysql+pymysql://app:pw@db:3306/x", "mysql+pymysql://app:***@db:3306/x"),
        ("redis://:pw@r:6379/0", "redis://:***@r:6379/0"),
        ("mysql://u:p@ss@h/db and more", "mysql://u:***@h/db and more"),
        ("see http://host:9091/metrics", "see http://host:9091/metrics"),
        ("password=hunter2 user=app", "password=*** user=app"),
        ("sasl.password=abc,acks=all", "sasl.password=***,acks=all"),
        ("ssl.key.password: 'k3y'", "ssl.key.password: '***'"),
        ('{"sasl.oauthbearer.client.secret": "s"}', '{"sasl.oauthbearer.client.secret": "***"}'),
        ("{'password': 'p w'}", "{'password': '***'}"),
        ("Authorization: Bearer abc.def-ghi", "Authorization: *** ***"),
        ("header Basic dXNlcjpwdw==", "header Basic ***"),
        ("api_key=123 token=xyz", "api_key=*** token=***"),
        ("nothing secret here", "nothing secret here"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(redact(text)) == expected  # idempotent


def test_redact_url() -> None:
    assert redact_url("mysql+pymysql://u:pw@h:3306/db") == "mysql+pymysql://u:***@h:3306/db"
    assert redact_url("mysql+pymysql://u@h:3306/db") == "mysql+pymysql://u@h:3306/db"
    assert redact_url("http://127.0.0.1:9091") == "http://127.0.0.1:9091"
    assert redact_url(redact_url("redis://:x@r/0")) == "redis://:***@r/0"


def test_registered_secret_never_reaches_the_output() -> None:
    secret = "Zq9-s3cr3t/val"
    register_secret(secret)
    with capture_json_logs() as cap:
        log_event(log, "connect", url=f"mysql://app:{secret}@db/x", cfg={"k": secret}, note=secret)
        log.info("dsn is %s", f"user {secret} end")
        try:
            raise ConnectionError(f"cannot connect with {secret!r}")
        except ConnectionError:
            log.exception("failed")
        try:
            raise ValueError("wrapped")  # traceback context carries the secret
        except ValueError as exc:
            log_event(log, "crash", level=logging.ERROR, error=exc, exc_info=True, extra=[secret])
    text = cap.text
    assert secret not in text
    # URL-encoded form (how it appears inside a DSN) is hidden too.
    assert "Zq9-s3cr3t%2Fval" not in text
    assert "***" in text
    records = cap.records
    assert records[0]["note"] == "***"
    assert records[0]["cfg"] == {"k": "***"}
    assert "Traceback" in str(records[2]["exc"])
    assert "ConnectionError: cannot connect with '***'" in str(records[2]["exc"])


def test_secret_in_traceback_frames_of_chained_exception() -> None:
    register_secret("pa55word!-long-enough")
    with capture_json_logs() as cap:
        try:
            try:
                raise OSError("auth failed for pa55word!-long-enough")
            except OSError as inner:
                raise RuntimeError("outer") from inner
        except RuntimeError:
            log.exception("boom")
    assert "pa55word!-long-enough" not in cap.text
    assert "auth failed for ***" in cap.text


def test_secret_field_names_are_masked_whatever_the_value() -> None:
    with capture_json_logs() as cap:
        log_event(log, "cfg", password=12345, sasl_password="x", client_secret=None)
    (rec,) = cap.records
    assert rec["password"] == "***"
    assert rec["sasl_password"] == "***"
    assert rec["client_secret"] is None


def test_log_event_redacts_even_without_our_handler(caplog: pytest.LogCaptureFixture) -> None:
    register_secret("topsecret-long-enough")
    with caplog.at_level(logging.INFO, logger="outboxkit.test"):
        log_event(log, "x", value="topsecret-long-enough", url="redis://:pw@r/0")
    assert "topsecret-long-enough" not in caplog.text
    assert ":pw@" not in caplog.text


def test_log_event_respects_level() -> None:
    with capture_json_logs(level="WARNING") as cap:
        log_event(log, "debug-only", level=logging.DEBUG)
        log_event(log, "warn", level=logging.WARNING)
    assert [r["event"] for r in cap.records] == ["warn"]


def test_short_secrets_are_masked_where_they_are_secrets_not_inside_words() -> None:
    """DB password ``outboxkit`` and a one-letter Redis password: every line stays readable."""
    from outboxkit.runtime import RuntimeSettings, describe, load

    db_url = "mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3306/outboxkit_test"
    redis_url = "redis://:e@127.0.0.1:6379/0"
    s = load(
        RuntimeSettings, environ={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_REDIS_URL": redis_url}
    )
    with capture_json_logs(service="outboxkit-relay") as cap:
        log_event(log, "relay-started", settings=describe(s))
        log_event(log, "state-changed", to="stopped", path="/var/lib/outboxkit/state")
        log.info("connected to %s; the service keeps stepping", db_url)
        log_event(log, "cfg", note="password=outboxkit sasl.password=e", url=redis_url)
    records = cap.records
    warned = [r for r in records if r["event"] == "secret-too-short"]
    # No warning for the DB password equal to its user name (the local stack's
    # default, not a secret); the one-letter Redis password is one.
    assert {w["setting"] for w in warned} == {
        "--redis-url / OUTBOXKIT_REDIS_URL (URL password)",
    }
    lines = [r for r in records if r["event"] != "secret-too-short"]
    assert all(r["service"] == "outboxkit-relay" for r in records)
    started, state, text, cfg = lines
    assert started["settings"]["db_url"] == (
        "mysql+pymysql://outboxkit:***@127.0.0.1:3306/outboxkit_test"
    )
    assert started["settings"]["redis_url"] == "redis://:***@127.0.0.1:6379/0"
    assert started["settings"]["service"] == "outboxkit"
    assert state["to"] == "stopped" and state["path"] == "/var/lib/outboxkit/state"
    assert text["msg"] == (
        "connected to mysql+pymysql://outboxkit:***@127.0.0.1:3306/outboxkit_test; "
        "the service keeps stepping"
    )
    assert cfg["note"] == "password=*** sasl.password=***"
    assert cfg["url"] == "redis://:***@127.0.0.1:6379/0"
    # The secrets appear nowhere as secrets: only the three masked spots carry ***.
    assert ":outboxkit@" not in cap.text and ":e@" not in cap.text


def test_long_secrets_are_still_masked_verbatim_and_warned_about_once() -> None:
    register_secret("x" * 11, source="--short")
    register_secret("long-random-secret-7f3a", source="--long")
    with capture_json_logs() as cap:
        log.info("free text with long-random-secret-7f3a and xxxxxxxxxxx")
    with capture_json_logs() as again:
        log.info("nothing")
    assert "long-random-secret-7f3a" not in cap.text
    assert "xxxxxxxxxxx" in cap.text  # too short to hunt in free text
    assert [r["setting"] for r in cap.records if r["event"] == "secret-too-short"] == ["--short"]
    assert not [r for r in again.records if r["event"] == "secret-too-short"]


def test_pem_private_keys_are_masked_in_free_text() -> None:
    pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIBOgIBAAJBAK\nbody==\n-----END RSA PRIVATE KEY-----"
    assert redact(f"cfg ssl.key.pem={pem} acks=all") == "cfg ssl.key.pem=*** acks=all"
    assert redact(f"cut off: {pem[:45]}") == "cut off: ***"  # before its END line
    cert = "-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----"
    assert redact(cert) == cert  # public material stays readable


# -- console lines ----------------------------------------------------------------------


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


_CONSOLE_LINE = re.compile(
    r"(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<level>[A-Z]+) +(?P<event>\S+)(?P<rest>.*)"
)


def _console(stream: io.StringIO, **kwargs: str) -> None:
    configure_logging(service="relay", node_id="pod-1", stream=stream, **kwargs)


def test_console_lines_show_time_level_event_and_fields() -> None:
    out = io.StringIO()
    _console(out, log_format="console")
    log_event(
        log, "relay-exit", delivered=3, topics=["a", "b"], reason="two words", none=None, ok=True
    )
    log.warning("plain %s", "text")
    first, second = out.getvalue().splitlines()
    m = _CONSOLE_LINE.fullmatch(first)
    assert m, first
    assert (m["level"], m["event"]) == ("INFO", "relay-exit")
    assert m["rest"] == (
        ' delivered=3 topics=["a","b"] reason="two words" none=null ok=true'
        " logger=outboxkit.test service=relay node_id=pod-1"
    )
    m = _CONSOLE_LINE.fullmatch(second)
    assert m and (m["level"], m["event"]) == ("WARNING", "log"), second
    assert m["rest"].startswith(' msg="plain text" ')
    assert "\x1b[" not in out.getvalue()  # not a terminal: no colour


def test_console_escapes_what_would_drive_the_terminal() -> None:
    out = io.StringIO()
    _console(out, log_format="console")
    log_event(log, "row", topic="evil\x1b[2J\u202etopic", text="a\nb")
    (line,) = out.getvalue().splitlines()
    assert "\x1b" not in line and "\u202e" not in line
    assert r'topic="evil\u001b[2J\u202etopic"' in line and r'text="a\nb"' in line


#: Characters no log line may carry raw: they split it (U+2028, U+2029, NEL and the
#: other separators), reorder it (bidirectional marks), or cannot be encoded (lone
#: surrogates). Newlines are checked apart: each line ends in one.
_FORGING = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
    "\u2066-\u2069\ud800-\udfff]"
)
_FORGED_ID = "e-1\u2028fake: line\u2029\x85\x0b\x0c\x1c\u202eevil\u2066x\u2069\u200f\u061c\ud800"


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_an_event_id_cannot_forge_lines_or_reorder_them(log_format: str) -> None:
    """An event id from a record, with every character a viewer splits lines on or
    that reorders text, stays on its one line, escaped; JSON reads back the same."""
    out = io.StringIO()
    _console(out, log_format=log_format)
    log_event(log, "handler-gave-up", event_id=_FORGED_ID, error=f"KeyError: {_FORGED_ID}")
    log.warning("plain %s", _FORGED_ID)
    text = out.getvalue()
    assert not _FORGING.findall(text), sorted(set(_FORGING.findall(text)))
    lines = text.split("\n")
    assert len(lines) == 3 and lines[-1] == "", lines
    if log_format == "json":
        first, second = (json.loads(line) for line in lines[:2])
        assert first["event_id"] == _FORGED_ID and second["msg"] == f"plain {_FORGED_ID}"
    else:
        assert r"\u2028fake: line\u2029\u0085" in lines[0] and r"\u202eevil" in lines[1]
    text.encode("utf-8")  # a lone surrogate would not encode


@settings(max_examples=200, deadline=None)
@given(value=st.text(alphabet=st.characters(codec=None, exclude_categories=())))
def test_no_text_reaches_a_log_line_raw(value: str) -> None:
    for log_format in ("json", "console"):
        out = io.StringIO()
        _console(out, log_format=log_format)
        log_event(log, "row", event_id=value, **{f"k{value}": value})
        text = out.getvalue()
        assert not _FORGING.findall(text) and text.count("\n") == 1
        if log_format == "json":
            assert json.loads(text)["event_id"] == value


def test_auto_is_console_on_a_terminal_and_json_elsewhere() -> None:
    pipe, tty = io.StringIO(), _Terminal()
    _console(pipe, log_format="auto")
    log_event(log, "hello", n=1)
    _console(tty, log_format="auto")
    log_event(log, "hello", n=1)
    assert json.loads(pipe.getvalue())["event"] == "hello"
    line = tty.getvalue()
    assert "hello" in line and not line.startswith("{")
    assert "\x1b[" in line  # coloured on a terminal


def test_json_is_the_default_and_stays_byte_for_byte_the_same() -> None:
    a, b = io.StringIO(), io.StringIO()
    _console(a)
    log_event(log, "batch-done", delivered=3, db_url="mysql://u:pw-long-long-1@h/db")
    _console(b, log_format="json")
    log_event(log, "batch-done", delivered=3, db_url="mysql://u:pw-long-long-1@h/db")
    for text in (a.getvalue(), b.getvalue()):
        rec = json.loads(text)
        ts = rec["ts"]
        assert text == (
            f'{{"ts": "{ts}", "level": "INFO", "logger": "outboxkit.test", "service": "relay", '
            '"node_id": "pod-1", "event": "batch-done", "delivered": 3, '
            '"db_url": "mysql://u:***@h/db"}\n'
        )


def test_a_bad_log_format_is_rejected() -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging(service="s", node_id="n", log_format="xml", stream=io.StringIO())


@given(
    password=st.text(
        alphabet=st.characters(codec="ascii", categories=("L", "N"), include_characters="-_.~!$"),
        min_size=12,
        max_size=40,
    )
)
@settings(max_examples=60, deadline=None, derandomize=True)
def test_a_dsn_password_never_reaches_console_output(password: str) -> None:
    from outboxkit.runtime.logs import _clear_secrets_for_tests

    _clear_secrets_for_tests()
    register_secret(password, source="--db-url")
    dsn = f"mysql+pymysql://outboxkit:{password}@db.internal:3306/orders"
    out = _Terminal()
    _console(out, log_format="console")
    log_event(log, "relay-started", settings={"db_url": dsn, "sasl.password": password})
    log_event(log, "db-error", error=f"cannot connect to {dsn}: password={password} refused")
    log.error("connect %s failed", dsn)
    try:
        raise RuntimeError(f"boom {dsn}")
    except RuntimeError:
        log.exception("failed with %s", password)
    text = out.getvalue()
    assert password not in text
    assert "mysql+pymysql://outboxkit:***@db.internal:3306/orders" in text


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(["a", "b"]), st.none()), max_size=30))
def test_an_episode_logs_once_when_it_starts_and_once_when_it_ends(
    steps: list[str | None],
) -> None:
    """A key begins an episode (None ends it): a line only when the state changes."""
    from outboxkit.runtime.logs import Episode

    with capture_json_logs() as cap:
        episode = Episode(logging.getLogger("outboxkit.test"), "thing-down", "thing-up")
        for step in steps:
            if step is None:
                episode.end(n=1)
            else:
                episode.begin(step, key=step)
    lines = [(r["event"], r.get("key"), r["level"]) for r in cap.records]
    expected: list[tuple[str, str | None, str]] = []
    state: str | None = None
    for step in steps:
        if step is None and state is not None:
            expected.append(("thing-up", None, "INFO"))
        elif step is not None and step != state:
            expected.append(("thing-down", step, "WARNING"))
        state = step
    assert lines == expected
