"""Produce records through librdkafka's C API directly (ctypes), bypassing the Python client.

confluent-kafka's ``Producer.produce`` only takes ``str`` header names, so it
cannot send what any other producer can: header names that are not UTF-8.
This calls ``rd_kafka_produceva`` in the librdkafka that confluent-kafka ships
(its ``confluent_kafka.libs`` folder, else the system's), so the records reach
a real broker byte for byte, exactly as a foreign producer would write them.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import confluent_kafka

__all__ = ["RawRecord", "produce_raw"]


@dataclass(frozen=True)
class RawRecord:
    """One record as bytes: ``None`` is a null key/value/header value."""

    key: bytes | None = None
    value: bytes | None = None
    headers: Sequence[tuple[bytes, bytes | None]] = field(default_factory=tuple)
    partition: int = 0


# rd_kafka_vtype_t
_END, _TOPIC, _PARTITION, _VALUE, _KEY, _MSGFLAGS, _HEADER = 0, 1, 3, 4, 5, 7, 9
_MSG_F_COPY = 0x2
_PRODUCER = 0


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Header(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("val", ctypes.c_void_p), ("size", ctypes.c_ssize_t)]


class _U(ctypes.Union):
    _fields_ = [
        ("cstr", ctypes.c_char_p),
        ("i32", ctypes.c_int32),
        ("i", ctypes.c_int),
        ("mem", _Mem),
        ("header", _Header),
        ("_pad", ctypes.c_char * 64),
    ]


class _VU(ctypes.Structure):
    _fields_ = [("vtype", ctypes.c_int), ("u", _U)]


class _Message(ctypes.Structure):
    _fields_ = [
        ("err", ctypes.c_int),
        ("rkt", ctypes.c_void_p),
        ("partition", ctypes.c_int32),
        ("payload", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("key", ctypes.c_void_p),
        ("key_len", ctypes.c_size_t),
        ("offset", ctypes.c_int64),
        ("_private", ctypes.c_void_p),
    ]


_DR_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(_Message), ctypes.c_void_p)


def _library() -> ctypes.CDLL:
    base = os.path.dirname(os.path.dirname(confluent_kafka.__file__))
    bundled = sorted(glob.glob(os.path.join(base, "confluent_kafka.libs", "librdkafka*.so*")))
    lib = ctypes.CDLL(bundled[0] if bundled else "librdkafka.so.1")
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.rd_kafka_conf_set_dr_msg_cb.argtypes = [ctypes.c_void_p, _DR_CB]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_VU), ctypes.c_size_t]
    lib.rd_kafka_error_string.restype = ctypes.c_char_p
    lib.rd_kafka_error_string.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_error_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_err2str.restype = ctypes.c_char_p
    return lib


def _buffer(data: bytes | None, keep: list[object]) -> tuple[int | None, int]:
    if data is None:
        return None, 0
    buf = ctypes.create_string_buffer(data, len(data))
    keep.append(buf)
    return ctypes.addressof(buf), len(data)


def produce_raw(
    bootstrap: str, topic: str, records: Iterable[RawRecord], *, timeout: float = 30.0
) -> list[int]:
    """Produce ``records`` in order (``acks=all``); their offsets. AssertionError on any failure."""
    lib = _library()
    conf = lib.rd_kafka_conf_new()
    err = ctypes.create_string_buffer(512)
    for name, value in (
        ("bootstrap.servers", bootstrap),
        ("acks", "all"),
        ("enable.idempotence", "true"),
        ("message.max.bytes", "20000000"),
    ):
        rc = lib.rd_kafka_conf_set(conf, name.encode(), value.encode(), err, len(err))
        assert rc == 0, err.value
    reports: list[tuple[int, int]] = []

    def on_delivery(_rk: int, msg: ctypes._Pointer[_Message], _opaque: int) -> None:
        reports.append((msg.contents.err, msg.contents.offset))

    callback = _DR_CB(on_delivery)
    lib.rd_kafka_conf_set_dr_msg_cb(conf, callback)
    rk = lib.rd_kafka_new(_PRODUCER, conf, err, len(err))
    assert rk, err.value
    keep: list[object] = []
    try:
        for record in records:
            vus: list[tuple[int, str, object]] = [
                (_TOPIC, "cstr", topic.encode()),
                (_PARTITION, "i32", record.partition),
                (_MSGFLAGS, "i", _MSG_F_COPY),
            ]
            array = (_VU * (5 + len(record.headers)))()
            n = 0
            for vtype, member, value in vus:
                array[n].vtype = vtype
                setattr(array[n].u, member, value)
                n += 1
            for vtype, data in ((_KEY, record.key), (_VALUE, record.value)):
                array[n].vtype = vtype
                array[n].u.mem.ptr, array[n].u.mem.size = _buffer(data, keep)
                n += 1
            for name, hvalue in record.headers:
                assert b"\0" not in name, "a C string cannot hold a NUL"
                array[n].vtype = _HEADER
                cname = ctypes.create_string_buffer(name)
                keep.append(cname)
                array[n].u.header.name = ctypes.cast(cname, ctypes.c_char_p)
                ptr, size = _buffer(hvalue, keep)
                array[n].u.header.val = ptr
                array[n].u.header.size = size if hvalue is not None else -1
                n += 1
            failure = lib.rd_kafka_produceva(rk, array, n)
            if failure:
                text = lib.rd_kafka_error_string(failure)
                lib.rd_kafka_error_destroy(failure)
                raise AssertionError(f"produceva refused a record: {text!r}")
        left = lib.rd_kafka_flush(rk, int(timeout * 1000))
        assert left == 0, f"librdkafka flush did not finish (error {left})"
    finally:
        lib.rd_kafka_destroy(rk)
    failed = [lib.rd_kafka_err2str(code) for code, _ in reports if code != 0]
    assert not failed, failed[:3]
    return [offset for _, offset in reports]
