"""Check a confluent-kafka record's header names *before* the client decodes them.

confluent-kafka's ``Message.headers()`` decodes each header name as UTF-8
without checking the result (``c_headers_to_py``): with a name that is not
UTF-8 it may raise ``SystemError``, return a list holding NULL entries, or
crash the interpreter, on the first call already. So a record's names are
read here first, straight from librdkafka (``rd_kafka_header_get_all`` on the
record's not-yet-converted ``rd_kafka_headers_t``), and ``headers()`` is only
called when every name is valid UTF-8.

That reads a field of the client's C ``Message`` struct (``topic, value, key,
headers, c_headers`` after the object header, unchanged since headers
support was added). Each record is checked against that layout first (the
first three pointers must be the objects ``topic()``, ``value()`` and
``key()`` return); if it does not match, or librdkafka cannot be loaded, the
answer is "cannot tell" and the caller falls back to calling ``headers()``.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import confluent_kafka

__all__ = ["header_names_decodable"]

_PTR = ctypes.sizeof(ctypes.c_void_p)
_BASE = object.__basicsize__  # PyObject_HEAD
_TOPIC, _VALUE, _KEY, _HEADERS, _C_HEADERS = (_BASE + i * _PTR for i in range(5))


def _load() -> Any:
    here = os.path.dirname(os.path.dirname(confluent_kafka.__file__))
    bundled = sorted(glob.glob(os.path.join(here, "confluent_kafka.libs", "librdkafka*.so*")))
    try:
        # PyDLL: the call keeps the interpreter lock. It is a short read of the
        # record's header list that never blocks, and CDLL's release and re-take
        # of the lock around each call (one per header, plus one, per message)
        # handed the lock to the poll thread every time: the worker then waited
        # for it back, which halved the consumer's rate.
        lib = ctypes.PyDLL(bundled[0] if bundled else "librdkafka.so.1")
        get_all = lib.rd_kafka_header_get_all
    except (OSError, AttributeError):
        return None
    # rd_kafka_resp_err_t rd_kafka_header_get_all(const rd_kafka_headers_t *hdrs,
    #     size_t idx, const char **namep, const void **valuep, size_t *sizep).
    # No argtypes on purpose: every argument is passed as a ctypes object of the
    # parameter's exact type (c_void_p, c_size_t, byref()), which ctypes hands
    # over as it is; converting Python ints through argtypes cost about twice as
    # much per call, and this runs for every header of every message.
    get_all.restype = ctypes.c_int
    return get_all


_get_all = _load()
_MESSAGE_TYPE: Any = getattr(confluent_kafka, "Message", None)
_USABLE = (
    _get_all is not None
    and isinstance(_MESSAGE_TYPE, type)
    and _MESSAGE_TYPE.__basicsize__ >= _C_HEADERS + _PTR
)


_TWO_POINTERS = ctypes.c_void_p * 2


def _pointer(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def _holds(address: int, obj: object) -> bool:
    """Does the struct field at ``address`` hold ``obj`` (None: NULL or None)?"""
    ptr = _pointer(address)
    return ptr == id(obj) or (obj is None and ptr == 0)


def _layout_matches(record: Any) -> bool:
    base = id(record)
    return (
        _holds(base + _TOPIC, record.topic())
        and _holds(base + _VALUE, record.value())
        and _holds(base + _KEY, record.key())
    )


# The struct layout belongs to the compiled type, not to a record: it is checked
# on the first records seen (one with a key and a value settles it).
_layout: bool | None = None
# Arguments and out-parameters, reused: callers hold the message module's decode lock.
_headers_arg = ctypes.c_void_p()
_indexes = tuple(ctypes.c_size_t(i) for i in range(32))
_name, _value, _size = ctypes.c_char_p(), ctypes.c_void_p(), ctypes.c_size_t()
_refs = (ctypes.byref(_name), ctypes.byref(_value), ctypes.byref(_size))


def header_names_decodable(record: Any) -> bool | None:
    """True if every header name of ``record`` is UTF-8 (or it has none), False if
    one is not, None if that cannot be told safely (then ``headers()`` decides).

    Not thread-safe: the caller serialises calls (``message._HEADERS_ONCE``).
    """
    global _layout
    if not _USABLE or type(record) is not _MESSAGE_TYPE:
        return None
    if _layout is not True:
        if _layout is False or not _layout_matches(record):
            _layout = False
            return None
        if record.key() is not None and record.value() is not None:
            _layout = True
    # Both fields in one read: the converted list (a Python object) and the C copy.
    converted, headers = _TWO_POINTERS.from_address(id(record) + _HEADERS)
    if converted:
        return None  # already converted by someone: headers() returns that list
    if not headers:
        return True
    get_all, name, indexes, (name_ref, value_ref, size_ref) = _get_all, _name, _indexes, _refs
    hdrs = _headers_arg
    hdrs.value = headers
    index = 0
    while True:
        arg = indexes[index] if index < len(indexes) else ctypes.c_size_t(index)
        if get_all(hdrs, arg, name_ref, value_ref, size_ref) != 0:
            return True
        raw = name.value
        if raw is not None and not raw.isascii():
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return False
        index += 1
