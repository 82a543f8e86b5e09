"""Structured logging (JSON lines, or readable console lines) with redaction of secrets.

Every line written by the handler that :func:`configure_logging` installs is
one JSON object::

    {"ts": "2024-05-01T12:00:00.123Z", "level": "INFO", "logger": "outboxkit.relay",
     "service": "relay", "node_id": "pod-1-4242-a1b2", "event": "state-changed",
     "from": "running", "to": "draining", "reason": "SIGTERM"}

or, with ``log_format="console"`` (``auto``: when the stream is a terminal),
the same fields as one readable line, the level coloured on a terminal::

    2024-05-01T12:00:00.123Z INFO    state-changed from=running to=draining reason=SIGTERM
      logger=outboxkit.relay service=relay node_id=pod-1-4242-a1b2

(one line; wrapped here). Both formatters read the same redacted fields.

Records made with :func:`log_event` carry an event name and fields; plain
``logger.info("text")`` records get ``"event": "log"`` and ``"msg"``.

Secrets never reach the output: every string (message, field values, field
names, formatted tracebacks) passes through :func:`redact`, which hides secrets
where they occur *as secrets*: the password of a URL (``scheme://user:***@host``),
the value of a ``password=...``-style pair or of a field or mapping key that
names a secret (:func:`is_secret_key`, including every librdkafka property that
holds key material or credentials), bearer tokens, and PEM private keys.
Redaction is applied to values before JSON encoding, so the output always stays
valid JSON.

Secrets registered with :func:`register_secret` (DSN passwords, SASL secrets)
are also hidden wherever they appear verbatim, but only when they are at least
:data:`MIN_SECRET_LENGTH` characters long: a short secret such as ``outboxkit``
or ``x`` also occurs in ordinary words, and masking it there garbles every line
(``"***-relay"``, ``"stopp***d"``) while the masked spots reveal it by context.
A shorter secret is hidden in the contexts above only, and
:func:`configure_logging` logs a ``secret-too-short`` warning naming the setting.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import math
import os
import re
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from typing import TextIO
from urllib.parse import quote, unquote, urlsplit

from outboxkit.runtime.kafkaconf import SENSITIVE_KAFKA_PROPERTIES

__all__ = [
    "LOG_FORMATS",
    "MAX_IDS_LOGGED",
    "MIN_SECRET_LENGTH",
    "UNSAFE_TEXT",
    "ConsoleFormatter",
    "Episode",
    "JsonFormatter",
    "configure_logging",
    "flush_logging",
    "log_event",
    "logging_configured",
    "redact",
    "redact_url",
    "register_secret",
    "safe_text",
]

#: Row ids named in one log line or recovery record; the line carries the whole
#: count beside them.
MAX_IDS_LOGGED = 200

MASK = "***"
#: Registered secrets shorter than this are masked in context only (see the module doc).
MIN_SECRET_LENGTH = 12

# Field or key names whose values are secrets as a whole, wherever they appear:
# password, passwd, sasl.password, ssl.key.password, sasl.oauthbearer.client.secret,
# api_key, token, authorization, credentials, private_key ...
_SENSITIVE_NAME = (
    r"[A-Za-z0-9_.\-]*?"
    r"(?:pass(?:word|wd|phrase)|secret|token|api[_.\-]?key|authorization|credentials?"
    r"|private[_.\-]?key|key[_.\-]pem|ssl[_.\-]key|sasl[_.\-]username"
    r"|oauthbearer[_.\-](?:config|extensions)|ssl[_.\-]ca[_.\-]pem|client[_.\-]key)"
    r"[A-Za-z0-9_.\-]*"
)
_SENSITIVE_NAME_RE = re.compile(_SENSITIVE_NAME, re.IGNORECASE)

# scheme://user:password@host  (the password may itself contain '@'; the host part
# after the last '@' must end at '/', '?', '#', whitespace, a quote or the end).
_URL_CRED_RE = re.compile(
    r"(?P<pre>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@'\"]*):(?P<pw>[^\s'\"]*?)@"
    r"(?=[^\s@/?#'\"]*(?:[/?#\s'\",;)\]}]|$))"
)

# key=value, key: value, "key": "value", 'key': 'value'
_PAIR_RE = re.compile(
    rf"(?P<key>\b{_SENSITIVE_NAME})(?P<kq>[\"']?)(?P<sep>\s*[:=]\s*)"
    r"(?:(?P<q>[\"'])(?P<qv>(?:\\.|(?!(?P=q)).)*)(?P=q)|(?P<v>[^\s,;&)}\]'\"]+))",
    re.IGNORECASE,
)

# Authorization: Bearer <token> / Basic <b64>
_AUTH_SCHEME_RE = re.compile(r"\b(?P<scheme>Bearer|Basic)\s+(?!\*\*\*)[A-Za-z0-9._~+/=\-]+")

# A PEM private key (ssl.key.pem, a key in an error text), to its END line or the
# end of the text when it was cut.
_PEM_KEY_RE = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY)-----.*?(?:-----END (?P=kind)-----|\Z)",
    re.DOTALL,
)

_secrets_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()
_secret_re: re.Pattern[str] | None = None
# Where short secrets came from (a setting's names), for the start-up warning.
_short_sources: dict[str, None] = {}
_short_warned: set[str] = set()


def register_secret(value: str, *, source: str | None = None, warn_short: bool = True) -> None:
    """Hide ``value`` (and its URL-encoded forms) verbatim in every log line from now on.

    Settings call this at load time for DSN passwords and SASL secrets, with
    ``source`` naming the setting. Empty values are ignored. A value shorter than
    :data:`MIN_SECRET_LENGTH` is not masked verbatim (it would garble ordinary
    words); it is remembered for the ``secret-too-short`` warning instead,
    unless ``warn_short`` is False (a value that is no secret: see
    ``settingsecrets._register_url_password``).
    """
    global _secrets, _secret_re
    if not value or value == MASK:
        return
    if len(value) < MIN_SECRET_LENGTH:
        if not warn_short:
            return
        with _secrets_lock:
            _short_sources[source or "a secret"] = None
        return
    forms = {value, quote(value, safe=""), quote(value, safe="~!$&'()*+,;=:"), unquote(value)}
    forms.discard("")
    forms.discard(MASK)
    with _secrets_lock:
        new = _secrets | forms
        if new == _secrets:
            return
        _secrets = frozenset(new)
        # Longest first so a secret that contains another is replaced whole.
        ordered = sorted(_secrets, key=len, reverse=True)
        _secret_re = re.compile("|".join(re.escape(s) for s in ordered))


def _clear_secrets_for_tests() -> None:
    global _secrets, _secret_re
    with _secrets_lock:
        _secrets = frozenset()
        _secret_re = None
        _short_sources.clear()
        _short_warned.clear()


def _pair_sub(m: re.Match[str]) -> str:
    key, kq, sep = m.group("key"), m.group("kq"), m.group("sep")
    if m.group("q") is not None:
        q = m.group("q")
        return f"{key}{kq}{sep}{q}{MASK}{q}"
    return f"{key}{kq}{sep}{MASK}"


def redact(text: str) -> str:
    """Hide passwords, tokens and registered secrets in ``text``. Idempotent."""
    if not text:
        return text
    pattern = _secret_re
    if pattern is not None:
        text = pattern.sub(MASK, text)
    text = _PEM_KEY_RE.sub(MASK, text)
    text = _URL_CRED_RE.sub(lambda m: f"{m.group('pre')}:{MASK}@", text)
    # Before key=value pairs: "Authorization: Bearer abc" must lose "abc", not "Bearer".
    text = _AUTH_SCHEME_RE.sub(lambda m: f"{m.group('scheme')} {MASK}", text)
    text = _PAIR_RE.sub(_pair_sub, text)
    return text


def redact_url(url: str) -> str:
    """``mysql+pymysql://u:pw@h:3306/db`` -> ``mysql+pymysql://u:***@h:3306/db``.

    A URL without a password is returned unchanged (apart from registered
    secrets, which are always hidden).
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if parts.password is None:
        return redact(url)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    netloc = f"{user}:{MASK}@{host}"
    return redact(parts._replace(netloc=netloc).geturl())


def is_secret_key(name: str) -> bool:
    """True when a field or property name denotes a secret: ``sasl.password``,
    ``token``, ``ssl.key.pem``, any name in
    :data:`~outboxkit.runtime.kafkaconf.SENSITIVE_KAFKA_PROPERTIES` (also spelt with
    ``_``)..."""
    lowered = name.strip().lower()
    if lowered in SENSITIVE_KAFKA_PROPERTIES or lowered.replace("_", ".") in (
        SENSITIVE_KAFKA_PROPERTIES
    ):
        return True
    return bool(_SENSITIVE_NAME_RE.fullmatch(name))


def sanitize(value: object, *, _depth: int = 0) -> object:
    """Return a JSON-serialisable, redacted copy of ``value``.

    Mapping entries whose key names a secret are replaced by ``***`` whatever
    their type; anything that is not a JSON type is ``str()``-ed.
    """
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return redact(value)
    if _depth > 8:
        return redact(str(value))
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for k, v in value.items():
            key = redact(str(k))
            out[key] = (
                MASK if is_secret_key(str(k)) and v is not None else sanitize(v, _depth=_depth + 1)
            )
        return out
    if isinstance(value, list | tuple | set | frozenset):
        return [sanitize(v, _depth=_depth + 1) for v in value]
    if isinstance(value, BaseException):
        return redact(f"{type(value).__name__}: {value}")
    return redact(str(value))


_RESERVED = frozenset({"ts", "level", "logger", "service", "node_id", "event", "exc"})
_EVENT_ATTR = "outboxkit_event"
_FIELDS_ATTR = "outboxkit_fields"


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: object
) -> None:
    """Log a structured record: an event name plus fields, all redacted.

    Pass ``exc_info=True`` (or an exception) to attach a traceback, which is
    redacted too. Field names that collide with the envelope (``ts``, ``level``,
    ``logger``, ``service``, ``node_id``, ``event``, ``exc``) get a trailing ``_``.
    """
    exc_info = fields.pop("exc_info", None)
    if not logger.isEnabledFor(level):
        return
    clean: dict[str, object] = {}
    for name, value in fields.items():
        key = f"{name}_" if name in _RESERVED else name
        clean[key] = MASK if is_secret_key(name) and value is not None else sanitize(value)
    # The plain message keeps the record readable under handlers that are not ours
    # (pytest's caplog, an embedding application's own formatter).
    rendered = " ".join([event, *(f"{k}={v}" for k, v in clean.items())])
    logger.log(
        level,
        "%s",
        rendered,
        exc_info=exc_info,  # type: ignore[arg-type]
        extra={_EVENT_ATTR: event, _FIELDS_ATTR: clean},
        stacklevel=2,
    )


class Episode:
    """A condition worth a line when it starts and one when it ends, not one per check.

    :meth:`begin` logs ``started`` at ``level`` unless an episode with the same
    key is already open (a new key, e.g. another Redis run id, opens a new one);
    :meth:`end` logs ``ended`` (INFO) if an episode is open. One thread drives
    an episode.
    """

    def __init__(
        self,
        logger: logging.Logger,
        started: str,
        ended: str | None = None,
        *,
        level: int = logging.WARNING,
    ) -> None:
        self.logger = logger
        self.started = started
        self.ended = ended
        self.level = level
        self.key: object = None

    @property
    def open(self) -> bool:
        return self.key is not None

    def begin(self, key: object = True, /, **fields: object) -> None:
        if key is None or key == self.key:
            return
        self.key = key
        log_event(self.logger, self.started, level=self.level, **fields)

    def end(self, **fields: object) -> None:
        if self.key is None:
            return
        self.key = None
        if self.ended is not None:
            log_event(self.logger, self.ended, level=logging.INFO, **fields)


def _utc_ts(created: float) -> str:
    dt = _dt.datetime.fromtimestamp(created, tz=_dt.UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """Formats records as one redacted JSON object per line."""

    def __init__(self, *, service: str, node_id: str) -> None:
        super().__init__()
        self.service = service
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        text = json.dumps(self.fields(record), ensure_ascii=False, default=lambda o: redact(str(o)))
        # The encoder escapes C0 controls but leaves the rest of UNSAFE_TEXT raw: a
        # U+2028 splits the line in many viewers, a lone surrogate cannot be written
        # as UTF-8. Outside strings a JSON line is ASCII, so each one is inside a
        # string, where \uXXXX is its JSON escape: a parser reads the same value.
        return UNSAFE_TEXT.sub(_escape, text)

    def fields(self, record: logging.LogRecord) -> dict[str, object]:
        """The record as the JSON object's fields, in order, every value redacted."""
        out: dict[str, object] = {
            "ts": _utc_ts(record.created),
            "level": record.levelname,
            "logger": record.name,
            "service": self.service,
            "node_id": self.node_id,
        }
        event = getattr(record, _EVENT_ATTR, None)
        fields = getattr(record, _FIELDS_ATTR, None)
        if isinstance(event, str):
            out["event"] = event
            if isinstance(fields, dict):
                for key, value in fields.items():
                    out[key] = sanitize(value)
        else:
            out["event"] = "log"
            try:
                msg = record.getMessage()
            except Exception:  # a bad %-format in someone else's log call
                msg = f"{record.msg!r} {record.args!r}"
            out["msg"] = redact(msg)
        if record.exc_info and record.exc_info[1] is not None:
            out["exc"] = redact("".join(traceback.format_exception(*record.exc_info)).rstrip())
        elif record.exc_text:
            out["exc"] = redact(record.exc_text)
        if record.stack_info:
            out["stack"] = redact(record.stack_info)
        return out


#: What must never reach a log line, a header or a terminal raw: C0 controls, DEL,
#: C1 controls (U+0085 is NEL, U+009B is CSI), the line and paragraph separators
#: U+2028/U+2029 (viewers and JavaScript split lines on them), the bidirectional
#: marks, embeddings, overrides and isolates that reorder the text shown (U+061C,
#: U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), and lone surrogates (text
#: decoded from JSON's ``"\\ud800"``: no UTF-8 encoder accepts them).
UNSAFE_TEXT = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
#: A value shown without quotes: no space, quote, '=' or backslash.
_BARE = re.compile("[^\\s\"'=\\\\]+")
_ENVELOPE = ("logger", "service", "node_id")
_MULTILINE = ("exc", "stack")
_COLOURS = {
    "DEBUG": "\x1b[2m",
    "INFO": "\x1b[32m",
    "WARNING": "\x1b[33m",
    "ERROR": "\x1b[31m",
    "CRITICAL": "\x1b[1;31m",
}
_DIM, _BOLD, _RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\u{code:04x}"


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in naming the class when that itself raises (an
    exception class with a broken ``__str__``): a handler's failure must be
    reported and dead-lettered, never turned into a crash of the worker."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: str() failed>"


def describe_exception(exc: BaseException) -> str:
    """``ClassName: text`` for log fields and results (:func:`exception_text`)."""
    return f"{type(exc).__name__}: {exception_text(exc)}"


def safe_text(text: str) -> str:
    """``text`` with every :data:`UNSAFE_TEXT` character written as ``\\uXXXX``.

    For text from records and handlers that goes where it must stay one line of
    valid UTF-8 (a dead-letter header, a terminal): the result always encodes,
    holds no control, separator or bidirectional character, and still shows
    what was there.
    """
    return UNSAFE_TEXT.sub(_escape, text)


def _shown(value: object) -> str:
    """A field value as ``key=<this>``: bare when plain, else JSON-quoted; never a
    character that would drive the terminal."""
    if isinstance(value, str):
        bare = _BARE.fullmatch(value) and not UNSAFE_TEXT.search(value)
        text = value if bare else json.dumps(value, ensure_ascii=False)
    else:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    return UNSAFE_TEXT.sub(_escape, text)


class ConsoleFormatter(JsonFormatter):
    """The JSON formatter's fields as one readable line: time, level, event, then
    ``key=value`` for every field, the envelope last; a traceback follows on its
    own lines. Same redaction (the same :meth:`JsonFormatter.fields`)."""

    def __init__(self, *, service: str, node_id: str, colour: bool = False) -> None:
        super().__init__(service=service, node_id=node_id)
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        ts, level, event = fields.pop("ts"), str(fields.pop("level")), fields.pop("event")
        tail = {name: fields.pop(name) for name in _MULTILINE if name in fields}
        envelope = {name: fields.pop(name) for name in _ENVELOPE}
        pairs = [f"{UNSAFE_TEXT.sub(_escape, k)}={_shown(v)}" for k, v in fields.items()]
        context = " ".join(f"{k}={_shown(v)}" for k, v in envelope.items())
        head = f"{ts} {level:<7} {_shown(event)}"
        if self.colour:
            colour = _COLOURS.get(level, "")
            head = f"{ts} {colour}{level:<7}{_RESET} {_BOLD}{_shown(event)}{_RESET}"
            context = f"{_DIM}{context}{_RESET}"
        line = " ".join([head, *pairs, context])
        for text in tail.values():
            lines = str(text).splitlines()
            line += "".join("\n    " + UNSAFE_TEXT.sub(_escape, part) for part in lines)
        return line


class _OutboxkitHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marker subclass so :func:`configure_logging` can find and replace its own handler."""


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``auto``: console lines when the log stream is a terminal, JSON lines otherwise.
LOG_FORMATS = ("auto", "json", "console")


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def configure_logging(
    *,
    level: str = "INFO",
    service: str,
    node_id: str,
    stream: TextIO | None = None,
    log_format: str = "json",
) -> None:
    """Install our handler on the root logger (stderr unless ``stream`` is given).

    ``log_format``: ``json`` (one JSON object per line), ``console`` (readable
    lines, coloured when the stream is a terminal and ``NO_COLOR`` is unset) or
    ``auto`` (console on a terminal, JSON otherwise). Idempotent: a previous
    handler installed by this function is replaced; handlers installed by
    others are left alone.
    """
    name = level.upper()
    if name not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)} (got {level!r})")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)} (got {log_format!r})")
    out = stream if stream is not None else sys.stderr
    terminal = _is_terminal(out)
    formatter: JsonFormatter
    if log_format == "console" or (log_format == "auto" and terminal):
        colour = terminal and not os.environ.get("NO_COLOR")
        formatter = ConsoleFormatter(service=service, node_id=node_id, colour=colour)
    else:
        formatter = JsonFormatter(service=service, node_id=node_id)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _OutboxkitHandler):
            root.removeHandler(handler)
            handler.close()
    handler = _OutboxkitHandler(out)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(name)
    _warn_short_secrets()


@contextlib.contextmanager
def logging_configured(
    *, level: str, service: str, node_id: str, log_format: str = "json"
) -> Iterator[None]:
    """:func:`configure_logging` for the block only: a short command that may also
    run inside another program (``outboxkit admin`` called in-process) leaves the
    root logger as it found it, apart from a handler of ours it replaced."""
    root = logging.getLogger()
    old_level = root.level
    configure_logging(level=level, service=service, node_id=node_id, log_format=log_format)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if isinstance(handler, _OutboxkitHandler):
                root.removeHandler(handler)
                handler.close()
        root.setLevel(old_level)


def _warn_short_secrets() -> None:
    """One warning per setting whose secret is too short to be masked verbatim."""
    with _secrets_lock:
        sources = [s for s in _short_sources if s not in _short_warned]
        _short_warned.update(sources)
    for source in sources:
        log_event(
            logging.getLogger("outboxkit.settings"),
            "secret-too-short",
            level=logging.WARNING,
            setting=source,
            min_length=MIN_SECRET_LENGTH,
            detail="masked only where it appears as a secret (URL password, key=value, "
            "named field), not in free text; use a longer, random secret",
        )


def flush_logging() -> None:
    """Flush every handler of the root logger; used right before ``os._exit``."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):  # nothing left to report a failure to
            handler.flush()
