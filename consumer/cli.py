"""``outboxkit consume package.module:ConsumerClass [settings]``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from outboxkit.consumer.settings import ConsumerSettings
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.logs import configure_logging, flush_logging
from outboxkit.runtime.settings import add_arguments, load

if TYPE_CHECKING:
    # Imported where a consumer runs: building the parser needs the settings only.
    from outboxkit.consumer.base import Consumer


def register(sub: Any) -> None:
    p = sub.add_parser(
        "consume",
        help="run a Consumer subclass until SIGTERM",
        description="Run a Consumer subclass. Settings come from flags or OUTBOXKIT_* "
        "variables; SIGTERM/SIGINT drain, a second signal hurries.",
    )
    p.add_argument(
        "target", metavar="MODULE:CLASS", help="the consumer class, e.g. app.events:Orders"
    )
    add_arguments(p, ConsumerSettings)
    p.set_defaults(func=_consume)


def load_consumer_class(target: str) -> type[Consumer]:
    """Import ``package.module:Class``; ConfigError if it is missing or not a Consumer.

    The current directory is importable, as with uvicorn, gunicorn and celery
    (``outboxkit consume app.events:Orders`` run from the folder that holds
    ``app/``): it is put first on ``sys.path`` unless already there. The
    ``outboxkit`` console script would otherwise search only its own folder and
    the installed packages.
    """
    from outboxkit.consumer.base import Consumer

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"invalid consumer {target!r}: expected package.module:ClassName")
    module = _import_from_cwd(module_name, target)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r}") from None
    if not (isinstance(obj, type) and issubclass(obj, Consumer)) or obj is Consumer:
        raise ConfigError(f"{target!r} is not a subclass of outboxkit.consumer.Consumer")
    return obj


def _import_from_cwd(module_name: str, target: str) -> Any:
    """``module_name`` imported with the current directory first on ``sys.path``;
    a ConfigError that says where it was looked for and what to do if it is not
    found, or which import inside it failed."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name not in {".".join(parts[:n]) for n in range(1, len(parts) + 1)}:
            raise ConfigError(
                f"cannot import {module_name!r} for consumer {target!r}: it imports "
                f"{exc.name!r}, which is not installed in {sys.prefix} ({exc})"
            ) from None
        top = parts[0]
        pythonpath = os.environ.get("PYTHONPATH")
        searched = f"the current directory ({cwd})" + (
            f", PYTHONPATH ({pythonpath})" if pythonpath else ""
        )
        raise ConfigError(
            f"cannot import {module_name!r} for consumer {target!r}: {exc}. Searched "
            f"{searched} and the packages installed in {sys.prefix}. Run outboxkit from "
            f"the folder that holds {top}/ or {top}.py, add that folder to PYTHONPATH, "
            "or install the package into this environment"
        ) from None
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for consumer {target!r}: {exc}") from None


def _consume(args: argparse.Namespace) -> int:
    cls = load_consumer_class(args.target)
    settings = load(ConsumerSettings, args=args)
    consumer = cls(settings)
    configure_logging(
        level=settings.log_level,
        service=settings.service,
        node_id=settings.node_id,
        log_format=settings.log_format,
    )
    code = consumer.run(handle_signals=True)
    if not consumer.closed_cleanly:
        # A close stuck inside librdkafka would also hang interpreter exit.
        flush_logging()
        os._exit(code)
    return code
