"""Secrets in settings: what loading registers for redaction, what a problem
message shows of a bad value, and what :func:`describe` masks.

A secret is a field marked ``secret=True``, the password of any URL value, and
the ``kafka_config`` values of properties that hold key material or credentials.
Registering them (:func:`outboxkit.runtime.logs.register_secret`) keeps them out
of every later log line; the rules sit together here so that what is hidden can
be checked in one read. :func:`describe` is re-exported from
:mod:`outboxkit.runtime.settings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

from outboxkit.runtime.logs import (
    MASK,
    is_secret_key,
    redact,
    redact_url,
    register_secret,
    sanitize,
)
from outboxkit.runtime.settingfields import METADATA_KEY, SettingField


def shown_value(f: SettingField, raw: object) -> str:
    """``raw`` as a problem message may quote it: masked for a secret, without
    the password for a URL."""
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
        parts = urlsplit(value)
        password, username = parts.password, parts.username
    except ValueError:
        return
    if password:
        # A password equal to its user name (the local stack's outboxkit:outboxkit,
        # postgres:postgres) is a published default, not a secret: it stays masked
        # where it appears as a password, but warning that it is too short to be
        # hunted in free text too is noise on every command (it is the user name).
        warn = unquote(password) != unquote(username or "")
        for text in (password, unquote(password)):
            register_secret(text, source=f"{source} (URL password)", warn_short=warn)


# Sensitive but not secret as a literal: masked in fields, never hunted in free text.
_NOT_LITERAL = frozenset({"sasl.username"})


def register_secrets(f: SettingField, value: object) -> None:
    """Register the secrets in the value of ``f`` (see the module docstring)."""
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


def describe(settings: object) -> dict[str, object]:
    """A redacted, JSON-friendly view of ``settings`` for the start-up log line."""
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        raise TypeError("describe() expects a settings dataclass instance")
    out: dict[str, object] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        spec = f.metadata.get(METADATA_KEY)
        if (spec is not None and spec.secret) or is_secret_key(f.name):
            out[f.name] = None if value is None else MASK
        elif isinstance(value, str) and "://" in value:
            out[f.name] = redact_url(value)
        else:
            out[f.name] = sanitize(value)
    return out
