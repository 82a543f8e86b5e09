"""How event fields are stored: headers as JSON text, shards from a stable hash.

The decoders here also read rows that ``enqueue`` did not write (another
writer, a manual fix, a migration): whatever a column holds, they either return
what Kafka will carry intact or raise :class:`StoredRowError` saying why not.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
import zlib
from collections.abc import Mapping
from typing import Any

HeaderValue = str | bytes

_B64 = "b64"
#: Kafka's legal topic names (``Topic.validate`` in Kafka): 1-249 of these
#: characters, not ``.`` or ``..``.  ``fullmatch``: no trailing newline slips through.
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
#: Event ids travel as the ``event_id`` header and are the consumers' idempotency
#: key: 1-64 printable ASCII characters, no whitespace or control characters.
_EVENT_ID = re.compile(r"[\x21-\x7e]{1,64}")
RESERVED_HEADERS = frozenset({"event_id"})


class StoredRowError(ValueError):
    """A stored row cannot be sent to Kafka intact; the message says which column and why."""


def shown(value: object, limit: int = 80) -> str:
    """``value`` for an error text: ASCII-only (control characters, lone surrogates
    and non-ASCII escaped), bounded."""
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def topic_problem(topic: object) -> str | None:
    """Why Kafka can never accept ``topic`` as a topic name, or None."""
    if isinstance(topic, str) and _TOPIC.fullmatch(topic) and topic not in (".", ".."):
        return None
    return (
        f"topic {shown(topic)} is not a name Kafka accepts "
        "(1-249 characters of [a-zA-Z0-9._-], not '.' or '..')"
    )


def event_id_problem(event_id: object) -> str | None:
    """Why ``event_id`` cannot travel as the ``event_id`` header, or None."""
    if isinstance(event_id, str) and _EVENT_ID.fullmatch(event_id):
        return None
    return (
        f"event_id {shown(event_id)} cannot be sent: use 1-64 printable ASCII "
        "characters without whitespace"
    )


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from a JSON escape like "\ud800"
        return False
    return True


def encode_headers(headers: Mapping[str, HeaderValue] | None) -> str | None:
    """JSON object: str values stay strings, bytes become ``{"b64": "..."}``.

    The caller has validated names and value types; ``decode_headers`` returns an
    equal mapping (str stays str, bytes stays bytes).
    """
    if not headers:
        return None
    out: dict[str, object] = {}
    for name, value in headers.items():
        if isinstance(value, str):
            out[name] = value
        else:
            out[name] = {_B64: base64.b64encode(bytes(value)).decode("ascii")}
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


class _RepeatedName(Exception):
    """A JSON object in stored headers gives one name twice (args: the name)."""


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object as a dict, or
    :class:`_RepeatedName` when a name repeats (``json.loads`` alone keeps the
    last value and drops the others without a word)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _RepeatedName(name)
            seen.add(name)
    return out


def decode_headers(text: str | None) -> dict[str, HeaderValue]:
    """Inverse of ``encode_headers``; :class:`StoredRowError` for anything else.

    Stored headers must be a JSON object whose values are strings or
    ``{"b64": "<base64>"}``: a null, number, boolean, list or other object would
    reach Kafka as something other than what was stored, so it is refused
    instead of being turned into text. A name given twice in one object
    (``{"type":"A","type":"B"}``, which ``encode_headers`` never writes) is
    refused too: JSON leaves its meaning open (RFC 8259, section 4) and readers
    of the row disagree on it (PostgreSQL's ``jsonb`` and Python keep the last
    value, MariaDB's ``JSON_VALUE`` the first), so no reading of it is the
    headers intact.
    """
    if not text:
        return {}
    try:
        raw = json.loads(text, object_pairs_hook=_unique_names)
    except _RepeatedName as repeated:
        raise StoredRowError(
            f"stored headers give the name {shown(repeated.args[0])} more than once: "
            "a JSON object's names must be unique (readers disagree on which value "
            "counts, and Kafka would get only one of them)"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise StoredRowError(f"stored headers are not valid JSON: {shown(str(exc))}") from None
    if not isinstance(raw, dict):
        raise StoredRowError(
            f"stored headers must be a JSON object of name -> value, not {_json_type(raw)}"
        )
    out: dict[str, HeaderValue] = {}
    for name, value in raw.items():
        if isinstance(value, str):
            out[name] = value
            continue
        if isinstance(value, dict) and set(value) == {_B64} and isinstance(value[_B64], str):
            try:
                out[name] = base64.b64decode(value[_B64], validate=True)
            except (binascii.Error, ValueError):
                raise StoredRowError(
                    f'stored header {shown(name)}: {{"b64": ...}} is not valid base64'
                ) from None
            continue
        raise StoredRowError(
            f"stored header {shown(name)}: a value must be a string or "
            f'{{"b64": "<base64>"}}, not {_json_type(value)}'
        )
    return out


def header_name_problem(name: str) -> str | None:
    """Why ``name`` cannot travel as a Kafka header name, or None.

    librdkafka takes header names as C strings: a NUL would cut the name short,
    and a lone surrogate cannot be encoded (confluent-kafka crashed on one).
    """
    if not name:
        return "stored header name is empty"
    if not _utf8(name):
        return f"stored header name {shown(name)} is not valid UTF-8 (a lone surrogate)"
    if "\x00" in name:
        return f"stored header name {shown(name)} contains NUL"
    if name in RESERVED_HEADERS:
        return f"stored header {shown(name)} is reserved: outboxkit sets it from the row"
    return None


def kafka_headers(text: str | None, event_id: str) -> list[tuple[str, bytes]]:
    """Headers as confluent-kafka takes them, with ``event_id`` added.

    Raises :class:`StoredRowError` unless every name and value travels intact:
    names non-empty UTF-8 without NUL and not reserved, string values UTF-8
    (their bytes, NUL included, are sent as they are), and a sendable event id.
    """
    problem = event_id_problem(event_id)
    if problem:
        raise StoredRowError(problem)
    if not text:
        pairs = []
    elif len(text) <= _CACHED_HEADERS_MAX_CHARS:
        pairs = list(_stored_pairs_cached(text))
    else:
        pairs = list(_stored_pairs(text))
    pairs.append(("event_id", event_id.encode("ascii")))
    return pairs


#: Stored headers up to this long are decoded once per distinct text: rows of one
#: service mostly carry the same few header sets, and decoding them (JSON, then
#: every name and value checked) took 1.5 ms of a 500-row batch. The bounds keep
#: the cache small: 256 entries of at most this many characters, a few MB at worst.
_CACHED_HEADERS_MAX_CHARS = 1024


@functools.lru_cache(maxsize=256)
def _stored_pairs_cached(text: str) -> tuple[tuple[str, bytes], ...]:
    # A tuple of tuples of str and bytes: nothing a caller could change in place.
    # A text that raises is not cached (lru_cache keeps results only).
    return _stored_pairs(text)


def _stored_pairs(text: str) -> tuple[tuple[str, bytes], ...]:
    """The stored headers ``text`` as (name, bytes) pairs, checked (see kafka_headers)."""
    pairs: list[tuple[str, bytes]] = []
    for name, value in decode_headers(text).items():
        problem = header_name_problem(name)
        if problem:
            raise StoredRowError(problem)
        if isinstance(value, str):
            if not _utf8(value):
                raise StoredRowError(
                    f"stored header {shown(name)}: value is not valid UTF-8 (a lone surrogate)"
                )
            pairs.append((name, value.encode("utf-8")))
        else:
            pairs.append((name, value))
    return tuple(pairs)


def shard_for(key: bytes | None, event_id: str, shard_count: int) -> int:
    """Shard of a row: CRC-32 of the key (of the event id for keyless rows) mod shards.

    CRC-32 is stable across processes, versions and languages, so any writer
    computes the same shard.  All rows of one key land in one shard, which is what
    lets one shard owner keep their order.
    """
    data = key if key is not None else event_id.encode("ascii")
    return zlib.crc32(data) % shard_count
