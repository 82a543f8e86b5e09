"""Unit tests: the dead-letter copy always fits the producer's size budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outboxkit.consumer import Message
from outboxkit.consumer.dlq import Headers, _size, fit_copy

pytestmark = pytest.mark.unit

_ADDED: Headers = [("dlq.original.topic", b"orders"), ("dlq.error.message", b"e" * 1000)]
_FIXED = _size(None, None, [*_ADDED, ("dlq.headers.dropped", b"x" * 40)]) + 60


def _blob(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    key=st.one_of(st.none(), st.integers(0, 5000).map(_blob)),
    value=st.one_of(st.none(), st.integers(0, 50_000).map(_blob)),
    headers=st.lists(
        st.tuples(
            st.sampled_from(["event_id", "traceparent", "x"]), st.integers(0, 3000).map(_blob)
        ),
        max_size=5,
    ),
    budget=st.integers(_FIXED + 60, 60_000),
    reference=st.booleans(),
)
def test_the_copy_fits_keeps_what_it_can_and_marks_what_it_cut(
    key: bytes | None,
    value: bytes | None,
    headers: Headers,
    budget: int,
    reference: bool,
) -> None:
    message = Message(topic="orders", partition=0, offset=7, key=key, value=value, headers=headers)
    copy = fit_copy(message, _ADDED, budget=budget, reference=reference)
    assert _size(copy.key, copy.value, copy.headers) <= budget
    names = [n for n, _ in copy.headers]
    marks = dict(copy.headers)
    assert all(h in copy.headers for h in _ADDED)
    whole = _size(key, value, [*headers, *_ADDED]) <= budget
    if whole and not reference:
        assert (copy.key, copy.value, copy.headers) == (key, value, [*headers, *_ADDED])
        assert copy.trimmed == ()
        return
    if value is not None:
        assert value.startswith(copy.value or b"")
        if len(copy.value or b"") < len(value):
            assert marks["dlq.value.truncated"] == str(len(value)).encode()
    if reference:
        assert not copy.value
        assert copy.key is None or len(copy.key) <= 1024
    if copy.key != key:
        assert copy.key is None and marks["dlq.key.dropped"] == str(len(key or b"")).encode()
    if [h for h in copy.headers if h[0] not in dict(_ADDED) and not h[0].startswith("dlq.")] != (
        headers
    ):
        assert "dlq.headers.dropped" in names
