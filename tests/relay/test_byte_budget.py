"""The claim's byte budget as a rule (``claim._within_budget``) and as a setting,
without a database; tests/relay/test_claim_bytes.py runs it against real ones."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit.relay.claim import _within_budget
from outboxkit.relay.rows import ByteBudget
from outboxkit.relay.settings import DEFAULT_BATCH_MAX_BYTES, RelaySettings
from outboxkit.runtime import ConfigError, load

pytestmark = pytest.mark.unit

_BASE = {
    "OUTBOXKIT_DB_URL": "mysql+pymysql://u:p@127.0.0.1:1/db",
    "OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1",
}

BUDGET = ByteBudget(max_bytes=100, max_message_bytes=1000)


def _row(row_id: int, key: bytes | None, payload: int, headers: int = 0) -> tuple[Any, ...]:
    """A locked row as the lock statement returns it: ``_LOCKED_COLUMNS``, then
    ``payload_bytes`` and ``headers_bytes``."""
    return (row_id, f"e{row_id}", "t", key, None, None, 0, 0, 0, "pending", None, payload, headers)


def _kept(rows: list[tuple[Any, ...]], budget: ByteBudget = BUDGET) -> list[int]:
    kept, _ = _within_budget(rows, budget)
    return [r[0] for r in kept]


def test_rows_are_kept_while_their_bytes_fit() -> None:
    rows = [_row(1, b"a", 40), _row(2, b"b", 40, headers=10), _row(3, b"c", 40)]
    assert _kept(rows) == [1, 2]


def test_a_row_left_out_holds_back_the_later_rows_of_its_key_only() -> None:
    rows = [
        _row(1, b"a", 60),
        _row(2, b"b", 60),  # over: left out, and b's later rows with it
        _row(3, b"b", 1),
        _row(4, b"c", 30),  # another key still fits
        _row(5, None, 10),  # keyless rows hold nothing back
        _row(6, None, 1),
    ]
    assert _kept(rows) == [1, 4, 5]


def test_the_first_row_goes_even_over_the_budget() -> None:
    """Else a row bigger than the budget would never be claimed."""
    assert _kept([_row(1, b"a", 500), _row(2, b"b", 1)]) == [1]


def test_a_payload_over_the_producers_limit_is_kept_unloaded_and_costs_nothing() -> None:
    rows = [_row(1, b"a", 1001), _row(2, b"a", 90), _row(3, b"b", 999, headers=5000)]
    kept, unsendable = _within_budget(rows, BUDGET)
    assert [r[0] for r in kept] == [1, 2]
    assert list(unsendable) == [1]
    assert "payload of 1001 bytes" in unsendable[1]
    assert "message.max.bytes (1000)" in unsendable[1]
    # The key counts: payload + key over the limit can never be produced either.
    assert list(_within_budget([_row(1, b"kk", 999)], BUDGET)[1]) == [1]


def test_rows_under_the_inline_size_are_a_budget_at_most() -> None:
    assert BUDGET.inline_max(10) == 10
    assert BUDGET.inline_max(1000) == 1  # never 0: every row over it is deferred


def test_the_budget_is_a_validated_setting() -> None:
    settings = load(RelaySettings, environ=_BASE)
    assert settings.batch_max_bytes == DEFAULT_BATCH_MAX_BYTES == 16 * 1024 * 1024
    assert settings.max_message_bytes() == 1_000_000
    env = {**_BASE, "OUTBOXKIT_BATCH_MAX_BYTES": "4194304"}
    assert load(RelaySettings, environ=env).batch_max_bytes == 4 * 1024 * 1024
    raised = RelaySettings(kafka_config={"message.max.bytes": "20000000"})
    assert raised.max_message_bytes() == 20_000_000
    with pytest.raises(ConfigError) as refused:
        load(RelaySettings, environ={**_BASE, "OUTBOXKIT_BATCH_MAX_BYTES": "0"})
    assert "--batch-max-bytes" in str(refused.value)
    assert "OUTBOXKIT_BATCH_MAX_BYTES" in str(refused.value)
