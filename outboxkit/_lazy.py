"""Lazy re-exports for the packages' ``__init__`` modules.

A package lists its public names in ``__all__`` (and imports them for type
checkers under ``TYPE_CHECKING``) but imports the module that defines a name only
when the name is first used: ``import outboxkit`` to call ``enqueue`` does not
load what only the relay, the consumer or the health server need (Kafka, Redis,
Prometheus). A name, once resolved, is kept on the package like an eager import.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Iterable[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` that import
    each name of ``exports`` (``{module: names}``) from its module on first use."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
