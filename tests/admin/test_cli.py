"""``outboxkit admin``: help, input errors, output of the read-only commands, secrets."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

from outboxkit.schema import record_recovery

pytestmark = pytest.mark.integration

SUBCOMMANDS = ["status", "failed", "show", "requeue", "discard", "purge", "recovery"]


@pytest.mark.unit
@pytest.mark.parametrize("sub", [[], *([s] for s in SUBCOMMANDS)])
def test_every_subcommand_has_help(cli: Any, sub: list[str]) -> None:
    res = cli(["admin", *sub, "--help"])
    assert res.code == 0
    assert res.out.startswith("usage: outboxkit admin")


BAD_INPUT = [
    (["requeue"], "nothing selected: give --id, --event-id"),
    (["requeue", "--id", "1", "--topic", "orders"], "conflicting selectors"),
    (["requeue", "--event-id", "x", "--all-failed"], "conflicting selectors"),
    (
        ["requeue", "--since", "2024-05-02T00:00:00Z", "--until", "2024-05-01T00:00:00Z"],
        "bad time range: --since (2024-05-02T00:00:00Z) must be before --until",
    ),
    (["requeue", "--since", "yesterday"], "--since: cannot parse 'yesterday' as an ISO 8601 time"),
    (["requeue", "--id", "abc"], "argument --id: not an integer: 'abc'"),
    (["requeue", "--event-id", "no-such-event"], "no such row in outbox_events: no-such-event"),
    (["requeue", "--id", "99999"], "no such row in outbox_events: 99999; nothing was changed"),
    (["show", "no-such-event"], "no event with event_id 'no-such-event' in table outbox_events"),
    (["purge", "--older-than", "soon"], "invalid --older-than: must be a duration like 7d"),
    (["purge"], "the following arguments are required: --older-than"),
    (["failed", "--limit", "0"], "argument --limit: must be >= 1"),
    (["status", "--table", "bad-name"], "invalid --table / OUTBOXKIT_TABLE"),
]


@on_both_databases
@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_a_clear_message(admin: Any, args: list[str], message: str) -> None:
    res = admin(*args)
    assert res.code == 2, (res.out, res.err)
    assert message in res.err
    assert "Traceback" not in res.err


def test_missing_db_url_exits_2(admin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOXKIT_DB_URL", raising=False)
    res = admin("status", db=None)
    assert res.code == 2
    assert "missing --db-url / OUTBOXKIT_DB_URL" in res.err


@pytest.mark.parametrize("scheme", ["mysql+pymysql", "postgresql+psycopg"])
def test_unreachable_database_exits_3_without_the_password(admin: Any, scheme: str) -> None:
    res = admin("status", db=f"{scheme}://ops:Hunter2-pw@127.0.0.1:1/outbox")
    assert res.code == 3, res.err
    assert f"{scheme}://ops:***@127.0.0.1:1/outbox" in res.err
    assert "Hunter2-pw" not in res.out + res.err


@on_both_databases
def test_an_unknown_database_or_a_refused_login_exits_2_naming_the_fix(
    admin: Any, db_url: str
) -> None:
    """Configuration, not an unreachable server: exit 2 (on main, exit 3)."""
    url = sa.make_url(db_url)
    missing = url.set(database="okt_no_such_database").render_as_string(hide_password=False)
    res = admin("status", db=missing)
    assert res.code == 2, res.err
    assert "invalid --db-url / OUTBOXKIT_DB_URL: database 'okt_no_such_database' does not" in (
        res.err
    )
    assert "create it (CREATE DATABASE okt_no_such_database)" in res.err
    refused = url.set(password="Wr0ng-Hunter2-pw").render_as_string(hide_password=False)
    res = admin("status", db=refused)
    assert res.code == 2, res.err
    assert f"refused the login of user '{url.username}'" in res.err
    assert "Wr0ng-Hunter2-pw" not in res.out + res.err


def test_no_output_contains_the_database_password(
    secret_db_url: str, make_rows: Any, admin: Any, tmp_path: Path
) -> None:
    password = sa.make_url(secret_db_url).password
    assert password
    [failed] = make_rows(1, status="failed")
    runs = [
        ["status"],
        ["status", "--json"],
        ["failed"],
        ["requeue", "--all-failed", "--dry-run"],
        ["requeue", "--id", str(failed)],
        ["purge", "--older-than", "1d"],
        ["recovery"],
        ["show", "missing-id"],
        ["status", "--table", "no_such_table"],
    ]
    for args in runs:
        res = admin(*args, db=secret_db_url)
        assert password not in res.out + res.err, args
    # And through the environment, in a real process.
    env = {**os.environ, "OUTBOXKIT_DB_URL": secret_db_url}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "outboxkit", "admin", "status", "--table", "nope"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "run `outboxkit schema apply`" in proc.stderr
    assert password not in proc.stdout + proc.stderr


@pytest.fixture
def fake_relay() -> Iterator[str]:
    """A health port that answers like a relay with a paused topic (503 while paused)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(
                {
                    "state": "running",
                    "ready": False,
                    "paused_topics": {"payments": "TOPIC_AUTHORIZATION_FAILED: grant Write"},
                }
            ).encode()
            self.send_response(503 if self.path == "/healthz/ready" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@on_both_databases
def test_status_reports_counts_ages_leases_paused_topics_and_shard_owners(
    make_rows: Any,
    admin: Any,
    fake_relay: str,
    redis_url: str,
    redis_prefix: str,
    engine: sa.Engine,
    outbox: str,
) -> None:
    import redis

    from outboxkit.runtime.identity import read_identity
    from outboxkit.runtime.rediskeys import lease_key

    make_rows(3, status="pending", topic="orders", age_s=90)
    make_rows(2, status="delivered", topic="orders")
    make_rows(1, status="failed", topic="payments")
    make_rows(2, status="delivering", topic="payments", lease_s=30)
    make_rows(1, status="delivering", topic="payments", lease_s=-5)
    with engine.connect() as conn:
        key = read_identity(conn, outbox).key  # what a relay names its leases by
    client = redis.Redis.from_url(redis_url)
    for shard in range(6):
        node = "relay-1" if shard < 4 else "relay-2"
        client.set(lease_key(redis_prefix, key, shard), f"{node}:tok{shard}")
    client.close()

    res = admin(
        "status",
        "--json",
        "--relay-url",
        fake_relay,
        "--relay-url",
        "http://127.0.0.1:1",
        "--redis-url",
        redis_url,
        "--redis-prefix",
        redis_prefix,
    )
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["counts"] == {
        "pending": 3,
        "delivering": 3,
        "delivered": 2,
        "retryable": 0,
        "failed": 1,
    }
    assert data["topics"]["orders"]["pending"] == 3
    assert data["topics"]["payments"] == {
        "pending": 0,
        "delivering": 3,
        "delivered": 0,
        "retryable": 0,
        "failed": 1,
    }
    assert 85 <= data["oldest_pending_age_s"] < 150
    assert data["leases"]["live"] == 2 and data["leases"]["expired"] == 1
    assert data["leases"]["owners"] == [{"owner": "relay-a", "live": 2, "expired": 1}]
    paused, down = data["relays"]
    assert (paused["state"], paused["ready"]) == ("running", False)
    assert paused["paused_topics"] == {"payments": "TOPIC_AUTHORIZATION_FAILED: grant Write"}
    assert down["error"]
    assert data["shards"] == {
        "count": 8,
        "owners": {"relay-1": [0, 1, 2, 3], "relay-2": [4, 5]},
        "unowned": [6, 7],
    }
    assert "tok" not in res.out, "lease tokens are never shown"

    res = admin(
        "status",
        "--relay-url",
        fake_relay,
        "--redis-url",
        redis_url,
        "--redis-prefix",
        redis_prefix,
    )
    assert res.code == 0, res.err
    for line in [
        "oldest pending:     9",
        "leases: 2 live, 1 expired (a relay reclaims expired leases on its next claim)",
        f"relay {fake_relay}: running, not ready",
        "  paused payments: TOPIC_AUTHORIZATION_FAILED: grant Write",
        "  relay-1: 0-3 (4)",
        "  relay-2: 4-5 (2)",
        "  unowned: 6-7 (2)",
    ]:
        assert line in res.out, res.out


@on_both_databases
def test_failed_lists_pages_and_hides_payloads(make_rows: Any, admin: Any) -> None:
    ids = make_rows(5, status="failed", key="order-7")
    res = admin("failed", "--limit", "2")
    assert res.code == 0, res.err
    assert "MSG_SIZE_TOO_LARGE" in res.out and "order-7" in res.out
    assert f"more may follow: --after-id {ids[1]}" in res.out
    assert '"n"' not in res.out
    page = json.loads(admin("failed", "--json", "--after-id", str(ids[1]), "--limit", "2").out)
    assert [r["id"] for r in page["rows"]] == ids[2:4]
    assert "payload" not in page["rows"][0]
    shown = json.loads(admin("failed", "--json", "--show-payload", "--limit", "1").out)
    assert shown["rows"][0]["payload"] == {"text": '{"n":0}'}


@on_both_databases
def test_show_prints_every_column_and_the_payload_only_when_asked(
    engine: sa.Engine, make_rows: Any, read_rows: Any, admin: Any
) -> None:
    [row_id] = make_rows(1, status="failed")
    event_id = read_rows([row_id])[row_id].event_id
    res = admin("show", event_id)
    assert res.code == 0, res.err
    for column in [
        "id",
        "event_id",
        "topic",
        "key",
        "status",
        "attempts",
        "next_attempt_at",
        "lease_owner",
        "last_error",
        "created_at",
        "delivered_at",
        "kafka_offset",
    ]:
        assert any(line.startswith(column + " ") for line in res.out.splitlines()), column
    assert "payload" not in res.out
    data = json.loads(admin("show", event_id, "--json", "--show-payload").out)
    assert data["payload"] == {"text": '{"n":0}'}
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_events SET payload = :p WHERE id = :i"),
            {"p": b"\xff\x00", "i": row_id},
        )
    data = json.loads(admin("show", event_id, "--json", "--show-payload").out)
    assert data["payload"] == {"base64": "/wA="}


@on_both_databases
def test_recovery_shows_reclaims_requeues_and_purges(
    engine: sa.Engine, make_rows: Any, admin: Any
) -> None:
    with engine.begin() as conn:
        record_recovery(
            conn,
            kind="lease-reclaimed",
            node_id="relay-2",
            table="outbox_events",
            detail={"ids": [1, 2], "previous_owner": "relay-1"},
        )
        record_recovery(
            conn,
            kind="lease-reclaimed",
            node_id="relay-2",
            table="other_table",
            detail={"ids": [9]},
        )
    make_rows(2, status="failed")
    make_rows(3, status="delivered", age_s=30 * 86400)
    assert admin("requeue", "--all-failed").code == 0
    assert admin("purge", "--older-than", "1d").code == 0

    res = admin("recovery")
    assert res.code == 0, res.err
    kinds = [line.split()[1] for line in res.out.splitlines()[1:]]
    assert kinds == ["purge", "requeue", "lease-reclaimed"]
    assert '"previous_owner":"relay-1"' in res.out

    only = json.loads(admin("recovery", "--kind", "requeue", "--json").out)
    assert [e["kind"] for e in only] == ["requeue"]
    assert only[0]["detail"]["count"] == 2
    every = json.loads(admin("recovery", "--all-tables", "--json", "--limit", "10").out)
    assert {e["table"] for e in every} == {"outbox_events", "other_table"}
    assert len(json.loads(admin("recovery", "--json", "--limit", "1").out)) == 1


def test_log_format_is_an_admin_setting_and_the_root_logger_is_left_as_found(
    admin: Any,
) -> None:
    import logging

    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    ok = admin("status", "--log-format", "console")
    assert ok.code == 0, ok.err
    assert (list(root.handlers), root.level) == before
    bad = admin("status", "--log-format", "xml")
    assert bad.code == 2
    assert "--log-format" in bad.err


@pytest.mark.unit
def test_a_database_admin_does_not_run_on_exits_2(cli: Any, tmp_path: Path) -> None:
    res = cli(["admin", "status", "--db-url", f"sqlite:///{tmp_path}/outbox.db"])
    assert res.code == 2, (res.out, res.err)
    assert "--db-url / OUTBOXKIT_DB_URL" in res.err
    assert "MySQL/MariaDB or PostgreSQL" in res.err and "sqlite" in res.err
    assert "Traceback" not in res.err
    assert not (tmp_path / "outbox.db").exists()  # refused before connecting
