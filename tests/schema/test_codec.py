"""The relay's view of stored headers: cached decoding must not change any outcome."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from outboxkit.schema import encode_headers
from outboxkit.schema.codec import StoredRowError, kafka_headers

_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
# Stored texts a writer (ours or another) may leave: ours, any JSON, any text,
# and texts on both sides of the cache's length bound.
_STORED = st.one_of(
    st.dictionaries(st.text(max_size=12), st.text(max_size=12) | st.binary(max_size=12)).map(
        encode_headers
    ),
    _JSONISH.map(lambda v: json.dumps(v, ensure_ascii=False)),
    st.text(max_size=40),
    st.integers(1000, 1100).map(lambda n: json.dumps({"h": "v" * n})),
    st.none(),
)


def _outcome(text: str | None, event_id: str) -> object:
    try:
        return kafka_headers(text, event_id)
    except StoredRowError as exc:
        return ("error", str(exc))


@settings(max_examples=300, deadline=None)
@given(text=_STORED, event_ids=st.lists(st.sampled_from(["e-1", "e-2", "bad id"]), min_size=2))
def test_repeated_stored_headers_give_the_same_outcome_each_time(
    text: str | None, event_ids: list[str]
) -> None:
    first = _outcome(text, event_ids[0])
    if isinstance(first, list):
        first.append(("mutated", b"by a caller"))  # must not reach later rows
    for event_id in event_ids[1:]:
        again = _outcome(text, event_id)
        if event_id == "bad id":
            assert isinstance(again, tuple) and again[0] == "error"
            assert "event_id" in again[1]
            continue
        if isinstance(again, list):
            assert again[-1] == ("event_id", event_id.encode())
            assert ("mutated", b"by a caller") not in again
            if isinstance(first, list):
                assert again[:-1] == first[:-2]  # the same stored pairs each time
        elif event_ids[0] != "bad id":
            assert again == first  # a refused text is refused every time, same words


def test_a_refused_text_is_refused_again_after_a_good_one_was_cached() -> None:
    good = encode_headers({"type": "A"})
    assert kafka_headers(good, "e-1") == [("type", b"A"), ("event_id", b"e-1")]
    bad = '{"type": 1}'
    for _ in range(3):
        try:
            kafka_headers(bad, "e-1")
        except StoredRowError as exc:
            assert "must be a string" in str(exc)
        else:
            raise AssertionError("a number header value was accepted")
    assert kafka_headers(good, "e-2") == [("type", b"A"), ("event_id", b"e-2")]


def _object_text(pairs: list[tuple[str, object]]) -> str:
    """A JSON object with ``pairs`` in order, names repeated as given (``json.dumps``
    of a dict cannot repeat one)."""
    return "{" + ",".join(f"{json.dumps(n)}:{json.dumps(v)}" for n, v in pairs) + "}"


_NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


def _refusal(text: str) -> str:
    try:
        kafka_headers(text, "e-1")
    except StoredRowError as exc:
        return str(exc)
    raise AssertionError(f"{text!r} was accepted")


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.dictionaries(_NAMES, st.text(max_size=6), min_size=1, max_size=4).map(
        lambda d: list(d.items())
    ),
    data=st.data(),
)
def test_a_name_stored_twice_is_refused_whichever_value_comes_last(
    pairs: list[tuple[str, object]], data: st.DataObject
) -> None:
    """``{"type":"A","type":"B"}``: ``json.loads`` keeps B, MariaDB's ``JSON_VALUE``
    A; no choice is the stored headers intact, so the row is refused, naming it.
    Also with the name spelled with escapes once, and inside a ``{"b64": ...}``."""
    name, value = data.draw(st.sampled_from(pairs))
    other = data.draw(st.text(max_size=6).filter(lambda v: v != value))
    at = data.draw(st.integers(0, len(pairs)))
    repeated = _object_text([*pairs[:at], (name, other), *pairs[at:]])
    assert f"{name!a} more than once" in _refusal(repeated)
    escaped = json.dumps({name: value}, ensure_ascii=True)[1:-1]  # "\u00e9"-style
    plain = json.dumps(name, ensure_ascii=False) + ":" + json.dumps(other)
    assert "more than once" in _refusal("{" + escaped + "," + plain + "}")
    assert "'b64' more than once" in _refusal('{"blob":{"b64":"QQ==","b64":"Qg=="}}')
