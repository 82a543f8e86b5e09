"""The ``setting(...)`` field: a dataclass field that is also a flag and a variable.

:func:`setting` stores a :class:`SettingSpec` in the field's metadata;
:func:`setting_fields` reads a settings class back into one :class:`SettingField`
per field, with the parser its annotation calls for. The loader, the help text and
the redaction all work from those, so the annotation rules live only here.
:func:`setting` and :class:`SettingSpec` are re-exported from
:mod:`outboxkit.runtime.settings`.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable, Sequence
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

from outboxkit.runtime.settingvalues import (
    env_name,
    flag_name,
    parse_bool,
    parse_csv,
    parse_duration,
    parse_int,
    parse_pairs_env,
    parse_str,
)

T = TypeVar("T")

MISSING: Any = dataclasses.MISSING
#: The metadata key under which :func:`setting` keeps its :class:`SettingSpec`.
METADATA_KEY = "outboxkit.setting"


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
    metadata = {METADATA_KEY: spec}
    if default is not MISSING and default_factory is not MISSING:
        raise TypeError("give either default or default_factory, not both")
    if isinstance(default, dict | list | set):
        template = default
        default_factory = lambda: copy.copy(template)  # noqa: E731
        default = MISSING
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class SettingField:
    """One field of a settings class, read once: its names, its spec, and the
    parser its annotation calls for (``kind`` says how flags and variables carry it)."""

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
        return "scalar", parse_int, optional
    if tp is float:
        return "scalar", parse_duration, optional
    if tp is str:
        return "scalar", parse_str, optional
    if origin is dict and get_args(tp) == (str, str):
        return "dict", parse_pairs_env, optional
    if origin is tuple and get_args(tp) == (str, ...):
        return "tuple", parse_csv, optional
    raise TypeError(f"setting {name}: cannot infer a parser for {tp!r}; pass parse=")


def setting_fields(cls: type[Any]) -> list[SettingField]:
    """Every ``init`` field of the dataclass ``cls``; a field made without
    :func:`setting` is read as one with no help text. Raises ``TypeError`` for an
    annotation no parser is inferred for, or an alias that names another field."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = get_type_hints(cls)
    out: list[SettingField] = []
    names = {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        spec = f.metadata.get(METADATA_KEY) or SettingSpec(help="")
        kind, parse, optional = _analyse(f.name, hints[f.name], spec)
        if names.intersection(spec.aliases):
            raise TypeError(f"setting {f.name}: an alias names another setting")
        out.append(
            SettingField(
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
