"""Fixtures for relay tests; helpers live in ``relay_support`` (importable from here)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from relay_support import EmbeddedRelay, RelayProcess

from outboxkit.relay import Relay, RelaySettings


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
