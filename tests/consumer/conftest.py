"""Fixtures for consumer tests: settings factory, an embedded consumer runner."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from outboxkit.consumer import Consumer, ConsumerSettings
from outboxkit.runtime.testing import reset_logging

# Helper modules (kafkahelp, consumer_apps) live beside the tests; the subprocess
# tests put this folder on the children's PYTHONPATH too.
HERE = str(__import__("pathlib").Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from kafkahelp import FAST_GROUP  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_logging() -> Iterator[None]:
    # Secrets and the JSON handler are process-wide; the CLI tests install them.
    reset_logging()
    yield
    reset_logging()


@pytest.fixture
def settings(kafka_bootstrap: str) -> Callable[..., ConsumerSettings]:
    """``settings(group_id=..., topics=(...), **overrides)``: fast timeouts, any free port."""

    def make(**overrides: Any) -> ConsumerSettings:
        kafka_config = {**FAST_GROUP, **overrides.pop("kafka_config", {})}
        values: dict[str, Any] = {
            "kafka_bootstrap": kafka_bootstrap,
            "health_port": 0,
            "worker_drain_timeout": 5.0,
            "close_timeout": 5.0,
            "shutdown_timeout": 15.0,
            "commit_interval": 0.5,
            "retry_backoff_base": 0.05,
            "retry_backoff_cap": 0.2,
            "dlq_timeout": 3.0,
            "stats_interval": 1.0,
            "revoke_timeout": 5.0,
            "kafka_config": kafka_config,
        }
        values.update(overrides)
        return ConsumerSettings(**values)

    return make


class Running:
    """A consumer running embedded in a thread (no signal handlers)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name="test-consumer", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.consumer.run(handle_signals=False)

    def stop(self, timeout: float = 30.0) -> int | None:
        self.consumer.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "consumer did not stop"
        return self.exit_code


@pytest.fixture
def run_consumer() -> Iterator[Callable[[Consumer], Any]]:
    """``with run_consumer(c) as r:`` runs ``c`` in a thread and drains it on exit."""
    started: list[Running] = []

    @contextmanager
    def run(consumer: Consumer) -> Iterator[Running]:
        r = Running(consumer)
        started.append(r)
        r.thread.start()
        try:
            yield r
        finally:
            if r.thread.is_alive():
                r.stop()

    yield run
    for r in started:
        if r.thread.is_alive():
            r.stop()
