"""What the relay's producer and the consumer's clients share: the base
configuration, the forced properties, and the ``kafka-error`` line.

Each service adds its own properties on top of :func:`client_config` (the
relay: idempotence, compression, timeouts; the consumer: group, commits,
callbacks). Properties a service sets itself are refused from
``--kafka-config`` by one check, :func:`check_forced` (the lists are in
:mod:`outboxkit.runtime.kafkaconf`), which runs when the settings are
validated and again when a client is built from settings that were not.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.kafkaconf import Guard, guarded_problems
from outboxkit.runtime.logs import log_event
from outboxkit.runtime.settings import RuntimeSettings

__all__ = ["check_forced", "client_config", "log_kafka_error"]


def client_config(settings: RuntimeSettings, *, logger: logging.Logger) -> dict[str, Any]:
    """``client.id`` (the node id), librdkafka's log routed to ``logger``, the
    bootstrap servers, then the operator's ``--kafka-config`` properties."""
    config: dict[str, Any] = {"client.id": settings.node_id, "logger": logger}
    if settings.kafka_bootstrap:
        config["bootstrap.servers"] = settings.kafka_bootstrap
    config.update(settings.kafka_config)
    return config


def check_forced(config: Mapping[str, str], guards: Mapping[str, Guard]) -> None:
    """ConfigError naming each property of ``config`` that ``guards`` refuse."""
    problems = guarded_problems(config, guards)
    if problems:
        raise ConfigError(errors=problems)


def log_kafka_error(logger: logging.Logger, err: Any) -> None:
    """The ``kafka-error`` line for a librdkafka ``KafkaError`` (ERROR when fatal,
    else WARNING). How often a repeated error is logged is the caller's choice."""
    log_event(
        logger,
        "kafka-error",
        level=logging.ERROR if err.fatal() else logging.WARNING,
        code=err.name(),
        error=err.str(),
        fatal=err.fatal(),
    )
