"""What starting outboxkit loads: a service that imports ``outboxkit`` to call
``enqueue``, and ``outboxkit --version``, load SQLAlchemy and the package, not
what only the relay, the consumer, the admin or the wake-ups need.

Each case runs a fresh interpreter with ``-X importtime``, which lists every
module the process imported, from a folder outside the repository (so the
installed package is what is imported). No time is asserted: the figures are
the benchmark's (``bench/scenarios/startup.py``, docs/performance.md).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

#: Loaded where they are used, never to call ``enqueue`` or to print the version.
HEAVY = (
    "confluent_kafka",
    "redis",
    "prometheus_client",
    "opentelemetry",
    "tenacity",
    "sqlalchemy.orm",
    "outboxkit.relay",
    "outboxkit.consumer",
    "outboxkit.admin",
    "outboxkit.demo",
    "outboxkit.runtime.health",
    "outboxkit.runtime.settings",
)


def imported_modules(args: list[str], cwd: Path) -> tuple[set[str], str]:
    """The modules a fresh ``python -X importtime <args>`` imported, and its stdout."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "sqlalchemy" in modules or args[-1] == "pass", "no import list read"
    return modules, done.stdout


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_import_outboxkit_loads_no_relay_consumer_kafka_redis_or_prometheus(
    tmp_path: Path,
) -> None:
    modules, _ = imported_modules(["-c", "import outboxkit"], tmp_path)
    assert "outboxkit.writer" in modules
    assert heavy(modules) == []


def test_version_loads_no_command_module(tmp_path: Path) -> None:
    modules, out = imported_modules(["-m", "outboxkit", "--version"], tmp_path)
    import outboxkit
    from outboxkit.schema.table import SCHEMA_VERSION

    assert out.strip() == f"outboxkit {outboxkit.__version__} (outbox schema {SCHEMA_VERSION})"
    assert heavy(modules) == []


def test_other_commands_build_their_parser_without_the_relay_or_the_consumer(
    tmp_path: Path,
) -> None:
    """``outboxkit schema ...`` builds the whole parser: the relay's and the
    consumer's commands declare their settings, and import the relay (Kafka,
    Redis) and the consumer only when they run."""
    modules, out = imported_modules(["-m", "outboxkit", "schema", "--help"], tmp_path)
    assert "outboxkit schema" in out
    assert "outboxkit.relay.settings" in modules and "outboxkit.consumer.settings" in modules
    loaded = {"outboxkit.relay.relay", "outboxkit.consumer.base", "redis"} & modules
    assert loaded == set()


@pytest.mark.parametrize(
    "package", ["outboxkit", "outboxkit.runtime", "outboxkit.relay", "outboxkit.consumer"]
)
def test_every_public_name_of_a_lazy_package_resolves(package: str) -> None:
    """The lazy re-exports: each name of ``__all__`` is there, and listed by dir()."""
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018
