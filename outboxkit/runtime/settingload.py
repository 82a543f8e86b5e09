"""Filling a settings class: its argparse options, and :func:`load`, which reads
flags, then ``OUTBOXKIT_*`` variables, then defaults.

Both halves agree on one convention (an absent flag is ``argparse.SUPPRESS``, a
former name has its own ``dest``), which is why they share a module. Re-exported
from :mod:`outboxkit.runtime.settings`.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.logs import MASK, is_secret_key, log_event, redact, register_secret
from outboxkit.runtime.settingfields import SettingField, setting_fields
from outboxkit.runtime.settingsecrets import register_secrets, shown_value
from outboxkit.runtime.settingvalues import (
    env_name,
    flag_name,
    parse_pair,
    parse_pairs_env,
    several_pairs_problem,
)

S = TypeVar("S")


# -- argparse ----------------------------------------------------------------


def _show_default(f: SettingField) -> str:
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


def _help_text(f: SettingField) -> str:
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
    for f in setting_fields(cls):
        _add_option(parser, f, f.flag, f.name, _help_text(f))
        for alias in f.spec.aliases:
            _add_option(parser, f, flag_name(alias), _alias_dest(alias), f"old name of {f.flag}")


def _add_option(
    parser: argparse.ArgumentParser | Any, f: SettingField, flag: str, dest: str, help_: str
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


def _is_utf8(text: str) -> bool:
    """False for text decoded from invalid bytes (``surrogateescape``) or with NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def _check(f: SettingField, value: Any) -> None:
    if f.spec.choices is not None and value is not None and value not in f.spec.choices:
        raise ValueError("must be one of " + ", ".join(f.spec.choices))
    if f.spec.validate is not None and value is not None:
        message = f.spec.validate(value)
        if message:
            raise ValueError(message)


def _load_field(
    f: SettingField,
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
        flag_items = texts[1:] if env_raw is not None else texts
        several = [several_pairs_problem(f.flag, f.env, item) for item in flag_items]
        if any(several):
            errors.extend(p for p in several if p)
            return
        merged: dict[str, str] = dict(f.default() or {})
        raw: object = env_raw
        try:
            if env_raw is not None:
                merged.update(parse_pairs_env(env_raw))
            if flag_raw is not None:
                items = [flag_raw] if isinstance(flag_raw, str) else list(flag_raw)  # type: ignore[call-overload]
                for item in items:
                    raw = item
                    k, v = parse_pair(str(item))
                    merged[k] = v
            _check(f, merged)
        except ValueError as exc:
            errors.append(f"invalid {where}: {exc} (got '{shown_value(f, raw)}')")
            return
        register_secrets(f, merged)
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
        errors.append(f"invalid {where}: {exc} (got '{shown_value(f, raw)}')")
        return
    register_secrets(f, value)
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
    for f in setting_fields(cls):
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
    for f in setting_fields(cls):
        register_secrets(f, getattr(instance, f.name))
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
