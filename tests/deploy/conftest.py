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
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from support.services import free_port
from support.waiting import wait_for

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules"


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


@pytest.fixture
def pushgateway_url() -> str:
    url = os.environ.get("OUTBOXKIT_TEST_PUSHGATEWAY_URL")
    if not url:
        _missing('OUTBOXKIT_TEST_PUSHGATEWAY_URL is not set (run: eval "$(deploy/local/up.sh)")')
    return str(url)


def http_get(url: str) -> bytes | None:
    """The body of a 2xx answer, or None (refused, error status, timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback test URL
            return bytes(resp.read())
    except (urllib.error.URLError, OSError):
        return None


@pytest.fixture
def prometheus(tmp_path: Path, pushgateway_url: str) -> Iterator[str]:
    """A real Prometheus with every rule file, scraping the test Pushgateway every
    second with ``honor_labels`` (as deploy/prometheus/prometheus.yml does)."""
    binary = shutil.which("prometheus")
    if binary is None:
        _missing("prometheus not found; install Debian's `prometheus` package")
    target = urllib.parse.urlsplit(pushgateway_url).netloc
    config = tmp_path / "prometheus.yml"
    rule_files = ", ".join(f"'{p}'" for p in sorted(RULES.glob("*.rules.yml")))
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{rule_files}]\n"
        "scrape_configs:\n"
        "  - job_name: pushgateway\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: http_get(url + "/-/ready") is not None, timeout=30, what="prometheus ready"
        )
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
