"""Fixtures for relay tests; helpers live in ``relay_support`` (importable from here)."""

from __future__ import annotations

import contextlib
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from relay_support import EmbeddedRelay, Pushgateway, RelayProcess, missing_service
from support.prometheus import delete_pushed_groups

from outboxkit.relay import PUSH_JOB, Relay, RelaySettings


@pytest.fixture
def embedded() -> Iterator[Callable[..., EmbeddedRelay]]:
    started: list[EmbeddedRelay] = []

    def start(settings: RelaySettings, **kwargs: Any) -> EmbeddedRelay:
        er = EmbeddedRelay(Relay(settings, **kwargs)).start()
        started.append(er)
        return er

    yield start
    for er in started:
        if er.thread.is_alive():
            er.stop()


@pytest.fixture
def relay_process() -> Iterator[Callable[..., RelayProcess]]:
    started: list[RelayProcess] = []

    def start(args: Sequence[str], *, env: dict[str, str] | None = None) -> RelayProcess:
        p = RelayProcess(args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def pushgateway() -> Iterator[Pushgateway]:
    url = os.environ.get("OUTBOXKIT_TEST_PUSHGATEWAY_URL", "")
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2):  # noqa: S310
            pass
    except (OSError, ValueError) as exc:
        missing_service(f"no Pushgateway at OUTBOXKIT_TEST_PUSHGATEWAY_URL={url!r}: {exc}")
    gateway = Pushgateway(url)
    yield gateway
    for node_id in gateway.instances:
        with contextlib.suppress(OSError):
            delete_pushed_groups(gateway.url, job=PUSH_JOB, instance=node_id)
