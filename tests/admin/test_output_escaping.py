"""Human output never hands a foreign string's control characters to the terminal.

Rows come from writers outboxkit does not control (a manual fix, a migration,
another service): inserted here by plain SQL, with escape sequences in every
text column an operator's listing shows.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.databases import on_both_databases
from support.dbsql import db_time

from outboxkit.schema import record_recovery

pytestmark = [pytest.mark.integration, on_both_databases]

#: What a terminal interprets: C0 (ESC, BEL, CR, backspace...), DEL, C1 (CSI is
#: U+009B, NEL U+0085), the line and paragraph separators U+2028/U+2029 that
#: viewers split lines on, and the bidirectional marks, overrides and isolates
#: that reorder what is shown. (Newlines are checked apart: the output's own
#: lines end in one.)
UNSAFE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)

HOSTILE = (
    "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\r\x08\x9b31m\u202eevil\nfake: line"
    "\u2028forged\u2029\x85\u200fx\u2067"
)


def _insert(engine: sa.Engine, table: str, n: int, *, text: str, status: str) -> str:
    if engine.dialect.name == "postgresql":
        # PostgreSQL text cannot hold NUL, so no writer can put one there.
        text = text.replace("\x00", "")
    event_id = f"ev{n}-{text}"[:64]
    now = db_time(engine)
    expires = db_time(engine, 60) if status == "delivering" else "NULL"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {table} (event_id, topic, message_key, payload, headers, shard,"
                " status, attempts, next_attempt_at, created_at, updated_at, last_error,"
                " lease_owner, lease_token, lease_expires_at) VALUES (:e, :t, :k, :p, :h, 0,"
                f" :s, 3, {now}, {now}, {now}, :err, :o,"
                f" :tok, {expires})"
            ),
            {
                "e": event_id,
                "t": f"t{n}{text}"[:249],
                "k": text.encode("utf-8", "surrogatepass"),
                "p": text.encode("utf-8", "surrogatepass"),
                "h": json.dumps({text or "h": text}),
                "s": status,
                "err": f"KafkaError: {text}"[:1000],
                "o": f"relay-{text}"[:255] if status == "delivering" else None,
                "tok": "tok" if status == "delivering" else None,
            },
        )
    return event_id


def _all_output(admin: Any, event_ids: list[str]) -> str:
    # An id with a NUL cannot be typed as an argument (argv is C strings, and the
    # CLI refuses it): such rows are still shown by status, failed and recovery.
    typed = [e for e in event_ids if "\x00" not in e]
    runs = [
        ["status"],
        ["failed", "--show-payload"],
        ["recovery", "--all-tables"],
        *(["requeue", "--event-id", e, "--dry-run"] for e in typed[-1:]),
        *(["show", e, "--show-payload"] for e in typed),
    ]
    out = []
    for args in runs:
        res = admin(*args)
        assert res.code == 0, (args, res.err)
        out.append(res.out + res.err)
    return "\n".join(out)


def test_escape_sequences_in_rows_are_shown_escaped(
    engine: sa.Engine, outbox: str, admin: Any
) -> None:
    ids = [
        _insert(engine, outbox, 1, text=HOSTILE, status="failed"),
        _insert(engine, outbox, 2, text=HOSTILE, status="delivering"),
    ]
    with engine.begin() as conn:
        record_recovery(
            conn,
            kind=f"purge{HOSTILE}",
            node_id=f"admin@{HOSTILE}",
            table=outbox,
            detail={"note": HOSTILE},
        )
    shown = _all_output(admin, ids)
    assert not UNSAFE.findall(shown), sorted(set(UNSAFE.findall(shown)))
    # escaped, not dropped: the operator still sees what is there
    assert "\nfake: line" not in shown, "a foreign newline must not start a line of its own"
    assert "\\x1b[31mred" in shown and "\\u202eevil\\nfake: line" in shown
    # JSON output was already safe (escaped by the JSON encoder) and stays exact
    [row] = json.loads(admin("failed", "--json").out)["rows"]
    assert row["last_error"] == f"KafkaError: {HOSTILE}" and row["event_id"] == ids[0]


texts = st.text(
    alphabet=st.characters(codec="utf-8")
    | st.sampled_from("\x1b\x9b\x07\r\n\t\u202e\x00\x7f[\u2028\u2029\x85\u200e\u061c"),
    max_size=30,
)


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=texts)
def test_no_generated_string_reaches_the_terminal_raw(
    engine: sa.Engine, outbox: str, admin: Any, text: str
) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {outbox}"))
    ids = [
        _insert(engine, outbox, 1, text=text, status="failed"),
        _insert(engine, outbox, 2, text=text, status="delivering"),
    ]
    shown = _all_output(admin, ids)
    assert not UNSAFE.findall(shown)
