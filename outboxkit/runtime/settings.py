"""Settings: frozen dataclasses filled from CLI flags and ``OUTBOXKIT_*`` variables.

One rule for every component: a field ``lease_ttl`` is set by the flag
``--lease-ttl`` or the environment variable ``OUTBOXKIT_LEASE_TTL``;
precedence is flag > environment > default. Values are parsed from the field's
annotation and validated once, at start, and every problem is reported with
both names::

    invalid --lease-ttl / OUTBOXKIT_LEASE_TTL: must be > 0 (got '-1')

Parsers by annotation:

* ``int``; ``float`` (seconds; fractions and ``500ms``, ``2s``, ``1m``, ``1h``);
* ``bool`` (``1/0 true/false yes/no on/off``; flags ``--x`` / ``--no-x``);
* ``str``; ``X | None`` (an empty value means unset);
* ``dict[str, str]`` (librdkafka properties: repeated ``--kafka-config k=v``, or
  ``OUTBOXKIT_KAFKA_CONFIG="k=v,k2=v2"``; flag entries override environment
  entries key by key);
* ``tuple[str, ...]`` (comma-separated).

An empty environment variable counts as unset. Secrets (fields marked
``secret=True``, the password of any URL value, ``kafka_config`` values of
properties that hold key material or credentials) are registered with
:func:`outboxkit.runtime.logs.register_secret` when loaded, so they never appear
in a log line, and :func:`describe` masks them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import os
import re
import secrets
import socket
import types
from collections.abc import Callable, Mapping, Sequence
from typing import (
    Any,
    Generic,
    TypedDict,
    TypeVar,
    Union,
    Unpack,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)
from urllib.parse import unquote, urlsplit

from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.logs import (
    LOG_FORMATS,
    MASK,
    is_secret_key,
    log_event,
    redact,
    redact_url,
    register_secret,
    sanitize,
)

__all__ = [
    "ENV_PREFIX",
    "MAX_DURATION_S",
    "MAX_INT",
    "MIN_CONNECT_TIMEOUT_S",
    "MISSING",
    "RuntimeSettings",
    "SettingSpec",
    "add_arguments",
    "at_least_one",
    "at_most",
    "connect_timeout_problem",
    "default_node_id",
    "describe",
    "env_name",
    "flag_name",
    "load",
    "log_format_setting",
    "non_negative",
    "optional_url",
    "parse_bool",
    "parse_duration",
    "port_number",
    "positive",
    "renamed_in_use",
    "retry_backoff_problem",
    "setting",
    "valid_database_url",
    "valid_http_url",
    "valid_redis_url",
    "warn_renamed",
]

T = TypeVar("T")
S = TypeVar("S")

MISSING: Any = dataclasses.MISSING
ENV_PREFIX = "OUTBOXKIT_"
_META = "outboxkit.setting"


@dataclasses.dataclass(frozen=True)
class SettingSpec:
    """What :func:`setting` stores in the dataclass field's metadata."""

    help: str
    env: str | None = None
    secret: bool = False
    parse: Callable[[str], Any] | None = None
    validate: Callable[[Any], str | None] | None = None
    choices: tuple[str, ...] | None = None
    default_help: str | None = None
    #: Former field names whose flag and variable are still read (see :func:`load`).
    aliases: tuple[str, ...] = ()


class _Options(TypedDict, Generic[T], total=False):
    """The keyword options every form of :func:`setting` takes."""

    env: str | None
    secret: bool
    parse: Callable[[str], T] | None
    validate: Callable[[T], str | None] | None
    choices: Sequence[str] | None
    default_help: str | None
    aliases: Sequence[str]


@overload
def setting(default: T, *, help: str, **options: Unpack[_Options[T]]) -> T: ...
@overload
def setting(
    *, default_factory: Callable[[], T], help: str, **options: Unpack[_Options[T]]
) -> T: ...
@overload
def setting(*, help: str, **options: Unpack[_Options[Any]]) -> Any: ...
def setting(
    default: Any = MISSING,
    *,
    help: str,
    env: str | None = None,
    secret: bool = False,
    parse: Callable[[str], Any] | None = None,
    validate: Callable[[Any], str | None] | None = None,
    choices: Sequence[str] | None = None,
    default_factory: Any = MISSING,
    default_help: str | None = None,
    aliases: Sequence[str] = (),
) -> Any:
    """A dataclass field that is also a CLI flag and an environment variable.

    Without ``default`` or ``default_factory`` the setting is required.
    ``env`` overrides the derived variable name. ``validate`` returns an error
    message (e.g. ``"must be > 0"``) or None. ``choices`` are checked after
    ``parse``. ``default_help`` is what ``--help`` shows for a computed default.
    ``aliases`` are former names of the setting: their flags and variables are
    still read (:func:`load` says how they rank) and reported by
    :func:`renamed_in_use`.
    """
    spec = SettingSpec(
        help=help,
        env=env,
        secret=secret,
        parse=parse,
        validate=validate,
        choices=tuple(choices) if choices is not None else None,
        default_help=default_help,
        aliases=tuple(aliases),
    )
    metadata = {_META: spec}
    if default is not MISSING and default_factory is not MISSING:
        raise TypeError("give either default or default_factory, not both")
    if isinstance(default, dict | list | set):
        template = default
        default_factory = lambda: copy.copy(template)  # noqa: E731
        default = MISSING
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# -- names -----------------------------------------------------------------


def flag_name(field_name: str) -> str:
    """``lease_ttl`` -> ``--lease-ttl``."""
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """``lease_ttl`` -> ``OUTBOXKIT_LEASE_TTL``."""
    return ENV_PREFIX + field_name.upper()


def where(field_name: str) -> str:
    """How an operator sets a setting: ``--lease-ttl / OUTBOXKIT_LEASE_TTL``."""
    return f"{flag_name(field_name)} / {env_name(field_name)}"


def invalid(field_name: str, reason: str) -> str:
    """A problem with a setting's value, naming its flag and its variable:
    ``invalid --lease-ttl / OUTBOXKIT_LEASE_TTL: <reason>``. For the checks a
    ``validate()`` makes across settings (one setting's ``validate=`` cannot)."""
    return f"invalid {where(field_name)}: {reason}"


def missing(field_name: str, detail: str = "") -> str:
    """A required setting left unset: ``missing --db-url / OUTBOXKIT_DB_URL<detail>``."""
    return f"missing {where(field_name)}{detail}"


# -- parsers ---------------------------------------------------------------

_DURATION_RE = re.compile(
    r"\s*(?P<num>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(?P<unit>ms|s|m|h)?\s*",
    re.ASCII,
)
_UNIT_SECONDS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}
_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})


#: Longest duration any setting accepts (7 days): every wait, sleep and lease the
#: settings drive stays well inside what threads, timers and SQL intervals take.
MAX_DURATION_S = 7 * 86400.0
#: Largest integer setting: MySQL's signed INT, which bounds row counts and LIMITs.
MAX_INT = 2**31 - 1
_INT_RE = re.compile(r"\s*[-+]?[0-9]+\s*", re.ASCII)


def parse_duration(text: str) -> float:
    """Seconds as float: ``"1.5"``, ``"500ms"``, ``"2s"``, ``"1m"``, ``"1h"``.

    Refuses what no timer can honour: ``inf``/``1e999``, and anything above
    :data:`MAX_DURATION_S`.
    """
    m = _DURATION_RE.fullmatch(text)
    if not m:
        raise ValueError("must be a number of seconds or a duration like 500ms, 2s, 1m")
    seconds = float(m.group("num")) * _UNIT_SECONDS[m.group("unit")]
    if not math.isfinite(seconds) or abs(seconds) > MAX_DURATION_S:
        raise ValueError(f"must be at most {MAX_DURATION_S:g} s (7 days)")
    return seconds


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _parse_int(text: str) -> int:
    # ASCII digits only: int() also takes '١٢' and '1_000'.
    if not _INT_RE.fullmatch(text):
        raise ValueError("must be an integer")
    value = int(text)
    if abs(value) > MAX_INT:
        raise ValueError(f"must be at most {MAX_INT}")
    return value


def _parse_str(text: str) -> str:
    return text


def _parse_csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_pair(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError("must be key=value")
    return key, value.strip()


def _parse_pairs_env(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"``. A piece without ``=`` continues the previous value, so
    ``bootstrap.servers=a:9092,b:9092,acks=all`` keeps both brokers.
    """
    out: dict[str, str] = {}
    last: str | None = None
    for piece in text.split(","):
        if not piece.strip():
            continue
        if "=" not in piece and last is not None:
            out[last] = f"{out[last]},{piece.strip()}"
            continue
        key, value = _parse_pair(piece)
        out[key] = value
        last = key
    return out


# -- validators --------------------------------------------------------------


def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number between 0 and 65535"


def at_least_one(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


def retry_backoff_problem(base: float, cap: float) -> str | None:
    """The one check of ``--retry-backoff-base`` against ``--retry-backoff-cap``,
    for every service that backs off (the relay's rows, the consumer's handlers)."""
    if cap >= base:
        return None
    return invalid("retry_backoff_cap", f"must be >= --retry-backoff-base ({cap:g} < {base:g})")


#: Shortest start-up wait for a dependency: below it no real connection (DNS, TCP,
#: TLS, a first request) can be expected to finish, and the database drivers count
#: their connect timeouts in whole seconds anyway.
MIN_CONNECT_TIMEOUT_S = 1.0


def connect_timeout_problem(value: float) -> str | None:
    """``--connect-timeout``: at least :data:`MIN_CONNECT_TIMEOUT_S`. A smaller one
    (``0.001``, ``1e-320``) was accepted and then read as "unreachable" against a
    dependency that was up."""
    if value >= MIN_CONNECT_TIMEOUT_S:
        return None
    return (
        f"must be at least {MIN_CONNECT_TIMEOUT_S:g} s: no connection to Kafka or a "
        "database completes sooner, and the start would report it unreachable"
    )


def at_most(limit: float) -> Callable[[float], str | None]:
    """Validator: ``value <= limit``."""

    def check(value: float) -> str | None:
        return None if value <= limit else f"must be at most {limit:g}"

    return check


_HOST_RE = re.compile(r"[A-Za-z0-9_.\-]*|\[[0-9A-Fa-f:.]+\]", re.ASCII)
_ENCODE_HINT = "percent-encode @ : / ? # in the user name and password (%40 %3A %2F %3F %23)"


def _url_parts_problem(value: str, schemes: tuple[str, ...] | None) -> str | None:
    """Scheme, host and port of a URL; the messages never repeat the URL (a password)."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return f"the port must be a number between 0 and 65535, or {_ENCODE_HINT}"
    if not parts.scheme or not parts.netloc:
        return "must be a URL like scheme://user:password@host:port/path"
    if schemes is not None and parts.scheme.lower() not in schemes:
        return f"unknown scheme {parts.scheme!r}: use {', '.join(schemes)}"
    host = parts.netloc.rpartition("@")[2]
    if port is not None:
        host = host[: host.rfind(":")]
    if not _HOST_RE.fullmatch(host):
        return f"the host part is not a host name: {_ENCODE_HINT}"
    return None


def optional_url(value: str | None) -> str | None:
    if value is None:
        return None
    return _url_parts_problem(value, None)


#: The extra that brings a URL scheme's driver.
_DRIVER_EXTRAS = {
    "postgresql+psycopg": "postgres",
    "mysql+asyncmy": "async",
    "mariadb+asyncmy": "async",
}


def valid_database_url(value: str | None) -> str | None:
    """A SQLAlchemy URL whose dialect and driver are installed, with a plain host.

    An unencoded ``@`` in the password makes SQLAlchemy take the rest of the
    password for the host (and print it in errors); that is refused here with
    a message that never repeats the URL.
    """
    if value is None:
        return None
    import sqlalchemy as sa
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = sa.make_url(value)
    except ValueError:  # a port that is not a number
        return f"the port must be a number between 0 and 65535, or {_ENCODE_HINT}"
    except ArgumentError:
        return f"not a SQLAlchemy URL like mysql+pymysql://user:pw@host:3306/db; {_ENCODE_HINT}"
    if url.host is not None and not _HOST_RE.fullmatch(url.host):
        return f"the host part is not a host name: {_ENCODE_HINT}"
    if url.port is not None and not 0 <= url.port <= 65535:
        return "the port must be a number between 0 and 65535"
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        return (
            f"unknown database scheme {url.drivername!r} "
            "(e.g. mysql+pymysql, postgresql+psycopg, sqlite)"
        )
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        extra = _DRIVER_EXTRAS.get(url.drivername)
        hint = f"; pip install 'outboxkit[{extra}]'" if extra else ""
        return f"the driver of {url.drivername!r} is not installed ({exc.name or exc}){hint}"
    return None


#: The databases the relay, the consumer inbox and ``outboxkit admin`` run on
#: (SQLAlchemy backend names). SQLite serves ``schema apply`` and the writer only:
#: the claim needs ``FOR UPDATE SKIP LOCKED`` and server-clock arithmetic.
SERVER_DATABASES = ("mysql", "mariadb", "postgresql")


def is_postgresql_url(value: str) -> bool:
    """Does this SQLAlchemy URL name PostgreSQL (any driver)? False if it is not a URL."""
    return database_backend(value) == "postgresql"


def database_backend(value: str) -> str | None:
    """The backend a SQLAlchemy URL names (``mysql``, ``postgresql``...); None if no URL."""
    import sqlalchemy as sa
    from sqlalchemy.exc import ArgumentError

    try:
        return sa.make_url(value).get_backend_name()
    except (ArgumentError, ValueError):
        return None


def unsupported_database(backend: str, component: str) -> str | None:
    """Why ``component`` cannot use a ``backend`` database, or None when it can."""
    if backend in SERVER_DATABASES:
        return None
    return (
        f"{component} runs on MySQL/MariaDB or PostgreSQL, not {backend} "
        "(e.g. mysql+pymysql://user:pw@host:3306/db, postgresql+psycopg://user:pw@host:5432/db)"
    )


def _valid_server_database_url(value: str | None, component: str) -> str | None:
    """:func:`valid_database_url` for a server component: another database (SQLite)
    is refused by name, before its driver is even looked for."""
    if value is not None and _known_dialect(value):
        backend = database_backend(value)
        if backend is not None:
            problem = unsupported_database(backend, component)
            if problem is not None:
                return problem
    return valid_database_url(value)


def _known_dialect(value: str) -> bool:
    """SQLAlchemy knows the URL's database (its driver may still be missing); an
    unknown scheme is left to :func:`valid_database_url`'s message."""
    import sqlalchemy as sa
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        sa.make_url(value).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError):
        return False
    return True


def valid_relay_database_url(value: str | None) -> str | None:
    return _valid_server_database_url(value, "the relay")


def valid_server_database_url(value: str | None) -> str | None:
    """For ``outboxkit admin``."""
    return _valid_server_database_url(value, "outboxkit admin")


def valid_redis_url(value: str | None) -> str | None:
    if value is None:
        return None
    return _url_parts_problem(value, ("redis", "rediss", "unix"))


def valid_http_url(value: str | None) -> str | None:
    if value is None:
        return None
    return _url_parts_problem(value, ("http", "https"))


# -- field analysis ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    flag: str
    env: str
    spec: SettingSpec
    kind: str  # "scalar" | "bool" | "dict" | "tuple"
    parse: Callable[[str], Any]
    optional: bool
    field: dataclasses.Field[Any]

    def has_default(self) -> bool:
        return (
            self.field.default is not dataclasses.MISSING
            or self.field.default_factory is not dataclasses.MISSING
        )

    def default(self) -> Any:
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return MISSING


def _analyse(name: str, tp: Any, spec: SettingSpec) -> tuple[str, Callable[[str], Any], bool]:
    optional = False
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) != len(args)
        if len(rest) != 1:
            if spec.parse is None:
                raise TypeError(f"setting {name}: cannot infer a parser for {tp!r}; pass parse=")
            return "scalar", spec.parse, optional
        tp = rest[0]
        origin = get_origin(tp)
    if spec.parse is not None:
        return "scalar", spec.parse, optional
    if tp is bool:
        return "bool", parse_bool, optional
    if tp is int:
        return "scalar", _parse_int, optional
    if tp is float:
        return "scalar", parse_duration, optional
    if tp is str:
        return "scalar", _parse_str, optional
    if origin is dict and get_args(tp) == (str, str):
        return "dict", _parse_pairs_env, optional
    if origin is tuple and get_args(tp) == (str, ...):
        return "tuple", _parse_csv, optional
    raise TypeError(f"setting {name}: cannot infer a parser for {tp!r}; pass parse=")


def _fields(cls: type[Any]) -> list[_Field]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = get_type_hints(cls)
    out: list[_Field] = []
    names = {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        spec = f.metadata.get(_META) or SettingSpec(help="")
        kind, parse, optional = _analyse(f.name, hints[f.name], spec)
        if names.intersection(spec.aliases):
            raise TypeError(f"setting {f.name}: an alias names another setting")
        out.append(
            _Field(
                name=f.name,
                flag=flag_name(f.name),
                env=spec.env or env_name(f.name),
                spec=spec,
                kind=kind,
                parse=parse,
                optional=optional,
                field=f,
            )
        )
    return out


# -- argparse ----------------------------------------------------------------


def _show_default(f: _Field) -> str:
    if f.spec.default_help is not None:
        return f.spec.default_help
    value = f.default()
    if value is None or value == {} or value == ():
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}={MASK if is_secret_key(k) else v}" for k, v in value.items())
    return redact(str(value))


def _help_text(f: _Field) -> str:
    parts = [f"env {f.env}"]
    if f.spec.choices:
        parts.append("one of " + ", ".join(f.spec.choices))
    if f.spec.secret:
        parts.insert(0, "secret")
    if not f.has_default():
        parts.append("required")
    elif not f.spec.secret:
        parts.append(f"default: {_show_default(f)}")
    text = f"{f.spec.help} ({'; '.join(parts)})" if f.spec.help else f"({'; '.join(parts)})"
    return text.replace("%", "%%")


def _alias_dest(alias: str) -> str:
    return f"_alias_{alias}"


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type[Any]) -> None:
    """Add one option per settings field to ``parser`` (or an argument group),
    and one per former name of a field (``aliases``).

    Options default to "absent" (``argparse.SUPPRESS``) so that :func:`load`
    can tell a given flag from a default and apply flag > env > default.
    """
    for f in _fields(cls):
        _add_option(parser, f, f.flag, f.name, _help_text(f))
        for alias in f.spec.aliases:
            _add_option(parser, f, flag_name(alias), _alias_dest(alias), f"old name of {f.flag}")


def _add_option(
    parser: argparse.ArgumentParser | Any, f: _Field, flag: str, dest: str, help_: str
) -> None:
    common: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_}
    if f.kind == "bool":
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif f.kind == "dict":
        parser.add_argument(flag, action="append", metavar="KEY=VALUE", **common)
    elif f.kind == "tuple":
        parser.add_argument(flag, metavar="A,B,...", **common)
    else:
        metavar = "{" + ",".join(f.spec.choices) + "}" if f.spec.choices else f.name.upper()
        parser.add_argument(flag, metavar=metavar, **common)


# -- load --------------------------------------------------------------------


def _shown(f: _Field, raw: object) -> str:
    if f.spec.secret:
        return MASK
    if f.name.endswith("url"):
        # A URL that failed to parse may carry a password where no pattern finds it.
        text = str(raw)
        return redact_url(text) if "://" in text else MASK
    return redact(str(raw))


def _register_url_password(value: str, source: str) -> None:
    if "://" not in value:
        return
    try:
        password = urlsplit(value).password
    except ValueError:
        return
    if password:
        register_secret(password, source=f"{source} (URL password)")
        register_secret(unquote(password), source=f"{source} (URL password)")


# Sensitive but not secret as a literal: masked in fields, never hunted in free text.
_NOT_LITERAL = frozenset({"sasl.username"})


def _register_secrets(f: _Field, value: object) -> None:
    if value is None:
        return
    source = f"{f.flag} / {f.env}"
    if f.spec.secret:
        if isinstance(value, Mapping):
            for v in value.values():
                register_secret(str(v), source=source)
        elif isinstance(value, tuple | list):
            for v in value:
                register_secret(str(v), source=source)
        else:
            register_secret(str(value), source=source)
        return
    if isinstance(value, str):
        _register_url_password(value, source)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if is_secret_key(str(k)):
                if str(k).lower() not in _NOT_LITERAL:
                    register_secret(str(v), source=f"{source} {k}")
            elif isinstance(v, str):
                _register_url_password(v, f"{source} {k}")
    elif isinstance(value, tuple | list):
        for v in value:
            if isinstance(v, str):
                _register_url_password(v, source)


def _is_utf8(text: str) -> bool:
    """False for text decoded from invalid bytes (``surrogateescape``) or with NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def _check(f: _Field, value: Any) -> None:
    if f.spec.choices is not None and value is not None and value not in f.spec.choices:
        raise ValueError("must be one of " + ", ".join(f.spec.choices))
    if f.spec.validate is not None and value is not None:
        message = f.spec.validate(value)
        if message:
            raise ValueError(message)


def _load_field(
    f: _Field,
    flag_raw: object,
    env_raw: str | None,
    values: dict[str, Any],
    errors: list[str],
    where: str | None = None,
) -> None:
    where = where or f"{f.flag} / {f.env}"
    if f.kind == "dict":
        if flag_raw is None and env_raw is None:
            return
        texts = [env_raw] if env_raw is not None else []
        if flag_raw is not None:
            texts += [flag_raw] if isinstance(flag_raw, str) else [str(x) for x in flag_raw]  # type: ignore[attr-defined]
        if not all(_is_utf8(t) for t in texts):
            errors.append(f"invalid {where}: not valid UTF-8 text")
            return
        merged: dict[str, str] = dict(f.default() or {})
        raw: object = env_raw
        try:
            if env_raw is not None:
                merged.update(_parse_pairs_env(env_raw))
            if flag_raw is not None:
                items = [flag_raw] if isinstance(flag_raw, str) else list(flag_raw)  # type: ignore[call-overload]
                for item in items:
                    raw = item
                    k, v = _parse_pair(str(item))
                    merged[k] = v
            _check(f, merged)
        except ValueError as exc:
            errors.append(f"invalid {where}: {exc} (got '{_shown(f, raw)}')")
            return
        _register_secrets(f, merged)
        values[f.name] = merged
        return

    raw = flag_raw if flag_raw is not None else env_raw
    if isinstance(raw, str) and not _is_utf8(raw):
        errors.append(f"invalid {where}: not valid UTF-8 text")
        return
    if raw is None:
        if not f.has_default():
            help_ = f" ({f.spec.help})" if f.spec.help else ""
            errors.append(f"missing {where}: required{help_}")
        return
    if f.spec.secret and isinstance(raw, str):
        register_secret(raw, source=where)
    try:
        if isinstance(raw, bool) and f.kind == "bool":
            value: Any = raw
        elif isinstance(raw, str):
            value = None if (f.optional and raw.strip() == "") else f.parse(raw)
        else:
            value = raw  # a Namespace built in code with a typed value
        _check(f, value)
    except ValueError as exc:
        errors.append(f"invalid {where}: {exc} (got '{_shown(f, raw)}')")
        return
    _register_secrets(f, value)
    values[f.name] = value


def load(
    cls: type[S],
    *,
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> S:
    """Build ``cls`` from flags (``args``), then ``environ`` (default: ``os.environ``),
    then defaults.

    A setting's former name (``aliases``) still works: its flag ranks with the
    flag (giving both is an error), and its variable wins over the new variable,
    so a deployment that set the old one keeps its value even where a shared
    ConfigMap sets the new name for another service. What was read under an old
    name is listed by :func:`renamed_in_use`.

    Raises :class:`ConfigError` listing every bad or missing setting, and then
    every message returned by ``instance.validate()`` (cross-field checks).
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    errors: list[str] = []
    renamed: list[tuple[str, str]] = []
    for f in _fields(cls):
        flag_raw = getattr(args, f.name, None) if args is not None else None
        env_raw = _env_value(env, f.env)
        where: str | None = None
        for alias in f.spec.aliases:
            old_flag, old_env = flag_name(alias), env_name(alias)
            alias_flag = getattr(args, _alias_dest(alias), None) if args is not None else None
            alias_env = _env_value(env, old_env)
            if alias_flag is not None:
                if flag_raw is not None:
                    errors.append(
                        f"{f.flag} and its old name {old_flag} are both given: keep {f.flag}"
                    )
                    continue
                flag_raw, where = alias_flag, f"{old_flag} (old name of {f.flag})"
                renamed.append((old_flag, f.flag))
            elif alias_env is not None and flag_raw is None:
                # The old variable wins over the new one: a deployment that set it
                # keeps its value although a shared ConfigMap may set the new name
                # for another service.
                env_raw, where = alias_env, f"{old_env} (old name of {f.env})"
                renamed.append((old_env, f.env))
        _load_field(f, flag_raw, env_raw, values, errors, where)
    if errors:
        raise ConfigError(errors=errors)
    try:
        instance = cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(redact(str(exc))) from exc
    for f in _fields(cls):
        _register_secrets(f, getattr(instance, f.name))
    object.__setattr__(instance, _RENAMED_ATTR, tuple(renamed))
    check = getattr(instance, "validate", None)
    if callable(check):
        problems = check()
        if problems:
            raise ConfigError(errors=[redact(str(p)) for p in problems])
    return instance


_RENAMED_ATTR = "_outboxkit_renamed"


def _env_value(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw


def renamed_in_use(settings: object) -> tuple[tuple[str, str], ...]:
    """``(old, new)`` for each former flag or variable name :func:`load` read a
    value from, for the service's ``setting-renamed`` warning at start."""
    return tuple(getattr(settings, _RENAMED_ATTR, ()))


def warn_renamed(logger: logging.Logger, settings: object) -> None:
    """One ``setting-renamed`` WARNING per former name a value was read from."""
    for old, new in renamed_in_use(settings):
        log_event(
            logger,
            "setting-renamed",
            level=logging.WARNING,
            old=old,
            new=new,
            message=f"{old} is the old name of {new}; it still works, rename it when you can",
        )


def describe(settings: object) -> dict[str, object]:
    """A redacted, JSON-friendly view of ``settings`` for the start-up log line."""
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        raise TypeError("describe() expects a settings dataclass instance")
    out: dict[str, object] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        spec = f.metadata.get(_META)
        if (spec is not None and spec.secret) or is_secret_key(f.name):
            out[f.name] = None if value is None else MASK
        elif isinstance(value, str) and "://" in value:
            out[f.name] = redact_url(value)
        else:
            out[f.name] = sanitize(value)
    return out


# -- common settings ---------------------------------------------------------

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def default_node_id() -> str:
    """``<hostname>-<pid>-<4 hex>``: unique per process, readable in logs and leases."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def _non_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


#: The node id is stored as a row's lease owner (VARCHAR(255)).
MAX_NODE_ID_LENGTH = 255


def _node_id(value: str) -> str | None:
    if len(value) > MAX_NODE_ID_LENGTH:
        return f"must be at most {MAX_NODE_ID_LENGTH} characters (it is stored as lease owner)"
    return _non_empty(value)


def log_format_setting() -> Any:
    """The ``--log-format`` / ``OUTBOXKIT_LOG_FORMAT`` setting, for every command that logs.

    ``auto`` by default: readable lines for a person at a terminal, JSON lines
    for whatever collects a pod's or a service's stderr (not a terminal).
    """
    return setting(
        "auto",
        help="log lines: json, console (readable, coloured on a terminal) or auto "
        "(console when stderr is a terminal, else json)",
        parse=str.lower,
        choices=LOG_FORMATS,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """Settings every outboxkit process has; components inherit and add their own.

    ``health_host`` defaults to 127.0.0.1 (safe on a laptop and in tests);
    container deployments set ``OUTBOXKIT_HEALTH_HOST=0.0.0.0`` so the kubelet
    and Prometheus can reach the port.
    """

    service: str = setting(
        "outboxkit", help="service name in logs, metrics and the exit record", validate=_non_empty
    )
    node_id: str = setting(
        default_factory=default_node_id,
        help="identity of this process in logs, leases and metrics",
        default_help="<hostname>-<pid>-<4 hex>",
        validate=_node_id,
    )
    health_host: str = setting("127.0.0.1", help="address of the health/metrics HTTP server")
    health_port: int = setting(
        8080,
        help="port of the health/metrics HTTP server (0 = any free port)",
        validate=port_number,
    )
    log_level: str = setting("INFO", help="log level", parse=str.upper, choices=LOG_LEVELS)
    log_format: str = log_format_setting()
    shutdown_timeout: float = setting(
        30.0,
        help="seconds from the first signal to a forced exit (exit code 4)",
        validate=positive,
    )
    pushgateway_url: str | None = setting(
        None,
        help="Prometheus Pushgateway that receives the final metrics at exit",
        validate=valid_http_url,
    )
    kafka_bootstrap: str | None = setting(None, help="Kafka bootstrap servers, host:port,...")
    # RUF009 cannot know that setting() returns a dataclasses.field.
    kafka_config: dict[str, str] = setting(
        default_factory=dict,
        help="extra librdkafka property, repeatable: --kafka-config security.protocol=SASL_SSL",
    )
    db_url: str | None = setting(
        None,
        help="SQLAlchemy database URL, e.g. mysql+pymysql://user:password@host:3306/db "
        "or postgresql+psycopg://user:password@host:5432/db",
        validate=valid_database_url,
    )
    redis_url: str | None = setting(
        None,
        help="Redis URL for shard leases and wake-ups, e.g. redis://host:6379/0",
        validate=valid_redis_url,
    )

    def validate(self) -> list[str]:
        """Cross-field checks; subclasses extend with ``[*super().validate(), ...]``."""
        return []
