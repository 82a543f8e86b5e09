"""Identifier, topic and event-id checks match the whole string (no ``$`` before a newline)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outboxkit.errors import InvalidIdentifierError
from outboxkit.schema.table import identifier_problem, validate_identifier
from outboxkit.writer import InvalidEventIdError, InvalidTopicError, validate_topic
from outboxkit.writer import _event_id as validate_event_id

pytestmark = pytest.mark.unit

_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,40}", fullmatch=True)
_tail = st.sampled_from(["\n", "\r\n", "\n\n", " ", "\t", "\x00"])


@settings(max_examples=60, derandomize=True)
@given(name=_ident, tail=_tail)
def test_identifier_with_a_trailing_newline_is_rejected(name: str, tail: str) -> None:
    assert validate_identifier(name) == name
    with pytest.raises(InvalidIdentifierError):
        validate_identifier(name + tail)
    assert identifier_problem(name + tail) is not None


@settings(max_examples=60, derandomize=True)
@given(name=st.from_regex(r"[a-z0-9][a-z0-9._-]{0,30}", fullmatch=True), tail=_tail)
def test_topic_and_event_id_with_a_trailing_newline_are_rejected(name: str, tail: str) -> None:
    with pytest.raises(InvalidTopicError):
        validate_topic(name + tail)
    with pytest.raises(InvalidEventIdError):
        validate_event_id(name + tail)


@pytest.mark.parametrize("name", ["outbox_events\n", "orders\n", "abc\n"])
def test_examples_from_the_report(name: str) -> None:
    assert identifier_problem(name) is not None
