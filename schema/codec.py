"""How event fields are stored: headers as JSON text, shards from a stable hash."""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Mapping

HeaderValue = str | bytes

_B64 = "b64"


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


def decode_headers(text: str | None) -> dict[str, HeaderValue]:
    """Inverse of ``encode_headers``."""
    if not text:
        return {}
    raw = json.loads(text)
    out: dict[str, HeaderValue] = {}
    for name, value in raw.items():
        if isinstance(value, dict):
            try:
                out[name] = base64.b64decode(value[_B64], validate=True)
            except (KeyError, binascii.Error) as exc:
                raise ValueError(f"stored header {name!r} is not valid base64") from exc
        else:
            out[name] = str(value)
    return out


def kafka_headers(text: str | None, event_id: str) -> list[tuple[str, bytes]]:
    """Headers as confluent-kafka takes them, with ``event_id`` added."""
    pairs = [
        (name, value.encode("utf-8") if isinstance(value, str) else value)
        for name, value in decode_headers(text).items()
    ]
    pairs.append(("event_id", event_id.encode("ascii")))
    return pairs


def shard_for(key: bytes | None, event_id: str, shard_count: int) -> int:
    """Shard of a row: CRC-32 of the key (of the event id for keyless rows) mod shards.

    CRC-32 is stable across processes, versions and languages, so any writer
    computes the same shard.  All rows of one key land in one shard, which is what
    lets one shard owner keep their order.
    """
    data = key if key is not None else event_id.encode("ascii")
    return zlib.crc32(data) % shard_count
