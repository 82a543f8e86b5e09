"""Fixtures for the deploy/ artefact tests.

Most of these tests read files only. test_shipped_settings.py and
test_alerts_live.py run real processes against the local services. A tool they need
(promtool, PyYAML) that is missing skips the test locally but fails it under
CI (``CI=true``), so a CI machine without it cannot pass silently.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def yaml_module() -> ModuleType:
    try:
        return importlib.import_module("yaml")
    except ImportError:
        _missing("PyYAML is not installed; pip install pyyaml")
        raise


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        _missing("promtool not found; install Debian's `prometheus` package")
        raise AssertionError("unreachable")
    return path
