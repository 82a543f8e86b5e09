"""Settings: frozen dataclasses filled from CLI flags and ``OUTBOXKIT_*`` variables.

One rule for every component: a field ``lease_ttl`` is set by the flag
``--lease-ttl`` or the environment variable ``OUTBOXKIT_LEASE_TTL``;
precedence is flag > environment > default. Values are parsed from the field's
annotation and validated once, at start, and every problem is reported with
both names::

    invalid --lease-ttl / OUTBOXKIT_LEASE_TTL: must be > 0 (got '-1')

Parsers by annotation:

* ``int``; ``float`` (seconds; fractions and ``500ms``, ``2s``, ``1m``, ``1h``);
* ``bool`` (``1/0 true/false yes/no on/off``; flags ``--x`` / ``--no-x``);
* ``str``; ``X | None`` (an empty value means unset);
* ``dict[str, str]`` (librdkafka properties: repeated ``--kafka-config k=v``, or
  ``OUTBOXKIT_KAFKA_CONFIG="k=v,k2=v2"``; flag entries override environment
  entries key by key);
* ``tuple[str, ...]`` (comma-separated).

An empty environment variable counts as unset. Secrets (fields marked
``secret=True``, the password of any URL value, ``kafka_config`` values of
properties that hold key material or credentials) are registered with
:func:`outboxkit.runtime.logs.register_secret` when loaded, so they never appear
in a log line, and :func:`describe` masks them.

This module is the one to import from; the machinery lives in modules of its
own, each re-exported here:

* :mod:`~outboxkit.runtime.settingfields`: :func:`setting` and the reading of
  a settings class's fields and annotations;
* :mod:`~outboxkit.runtime.settingvalues`: flag and variable names, the parsers
  and the value checks (``positive``, ``at_most``...);
* :mod:`~outboxkit.runtime.settingurls`: the checks of database, Redis and HTTP
  URLs;
* :mod:`~outboxkit.runtime.settingload`: :func:`add_arguments` and :func:`load`;
* :mod:`~outboxkit.runtime.settingsecrets`: what is registered as a secret, and
  :func:`describe`.

What stays here is what every process shares: :class:`RuntimeSettings`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from typing import Any

from outboxkit.runtime.logs import LOG_FORMATS
from outboxkit.runtime.settingfields import MISSING, SettingSpec, setting
from outboxkit.runtime.settingload import (
    add_arguments,
    load,
    renamed_in_use,
    warn_renamed,
)
from outboxkit.runtime.settingsecrets import describe
from outboxkit.runtime.settingurls import SERVER_DATABASES as SERVER_DATABASES
from outboxkit.runtime.settingurls import database_backend as database_backend
from outboxkit.runtime.settingurls import is_postgresql_url as is_postgresql_url
from outboxkit.runtime.settingurls import (
    optional_url,
    valid_database_url,
    valid_http_url,
    valid_redis_url,
)
from outboxkit.runtime.settingurls import unsupported_database as unsupported_database
from outboxkit.runtime.settingurls import valid_relay_database_url as valid_relay_database_url
from outboxkit.runtime.settingurls import (
    valid_server_database_url as valid_server_database_url,
)
from outboxkit.runtime.settingvalues import (
    ENV_PREFIX,
    MAX_DURATION_S,
    MAX_INT,
    MIN_CONNECT_TIMEOUT_S,
    at_least_one,
    at_most,
    connect_timeout_problem,
    env_name,
    flag_name,
    non_negative,
    parse_bool,
    parse_duration,
    port_number,
    positive,
    retry_backoff_problem,
)
from outboxkit.runtime.settingvalues import invalid as invalid
from outboxkit.runtime.settingvalues import missing as missing
from outboxkit.runtime.settingvalues import where as where

# The names imported ``as`` themselves above are public too (the relay, the consumer
# and the CLIs import them from here) but stay out of ``from ... import *``.
__all__ = [
    "CONSUMER_HEALTH_PORT",
    "ENV_PREFIX",
    "MAX_DURATION_S",
    "MAX_INT",
    "MIN_CONNECT_TIMEOUT_S",
    "MISSING",
    "RELAY_HEALTH_PORT",
    "RuntimeSettings",
    "SettingSpec",
    "add_arguments",
    "at_least_one",
    "at_most",
    "connect_timeout_problem",
    "default_node_id",
    "describe",
    "env_name",
    "flag_name",
    "load",
    "log_format_setting",
    "non_negative",
    "optional_url",
    "parse_bool",
    "parse_duration",
    "port_number",
    "positive",
    "renamed_in_use",
    "retry_backoff_problem",
    "setting",
    "valid_database_url",
    "valid_http_url",
    "valid_redis_url",
    "warn_renamed",
]


# -- common settings ---------------------------------------------------------

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def default_node_id() -> str:
    """``<hostname>-<pid>-<4 hex>``: unique per process, readable in logs and leases."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def _non_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


#: The node id is stored as a row's lease owner (VARCHAR(255)).
MAX_NODE_ID_LENGTH = 255


def _node_id(value: str) -> str | None:
    if len(value) > MAX_NODE_ID_LENGTH:
        return f"must be at most {MAX_NODE_ID_LENGTH} characters (it is stored as lease owner)"
    return _non_empty(value)


def log_format_setting() -> Any:
    """The ``--log-format`` / ``OUTBOXKIT_LOG_FORMAT`` setting, for every command that logs.

    ``auto`` by default: readable lines for a person at a terminal, JSON lines
    for whatever collects a pod's or a service's stderr (not a terminal).
    """
    return setting(
        "auto",
        help="log lines: json, console (readable, coloured on a terminal) or auto "
        "(console when stderr is a terminal, else json)",
        parse=str.lower,
        choices=LOG_FORMATS,
    )


#: Default health/metrics ports: the relay's and the consumer's differ, so the two
#: run side by side on one machine (a laptop, one pod) without a setting.
RELAY_HEALTH_PORT = 8080
CONSUMER_HEALTH_PORT = 8081


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """Settings every outboxkit process has; components inherit and add their own.

    ``health_host`` defaults to 127.0.0.1 (safe on a laptop and in tests);
    container deployments set ``OUTBOXKIT_HEALTH_HOST=0.0.0.0`` so the kubelet
    and Prometheus can reach the port.
    """

    service: str = setting(
        "outboxkit", help="service name in logs, metrics and the exit record", validate=_non_empty
    )
    node_id: str = setting(
        default_factory=default_node_id,
        help="identity of this process in logs, leases and metrics",
        default_help="<hostname>-<pid>-<4 hex>",
        validate=_node_id,
    )
    health_host: str = setting("127.0.0.1", help="address of the health/metrics HTTP server")
    health_port: int = setting(
        RELAY_HEALTH_PORT,
        help="port of the health/metrics HTTP server (0 = any free port)",
        validate=port_number,
    )
    log_level: str = setting("INFO", help="log level", parse=str.upper, choices=LOG_LEVELS)
    log_format: str = log_format_setting()
    shutdown_timeout: float = setting(
        30.0,
        help="seconds from the first signal to a forced exit (exit code 4)",
        validate=positive,
    )
    pushgateway_url: str | None = setting(
        None,
        help="Prometheus Pushgateway that receives the final metrics at exit",
        validate=valid_http_url,
    )
    pushgateway_prune_after: float = setting(
        3600.0,
        help="once running, delete this job's Pushgateway groups pushed longer ago than "
        "this that alert on nothing (processes gone: one group per pod would pile up); "
        "0 = never",
        validate=non_negative,
    )
    kafka_bootstrap: str | None = setting(None, help="Kafka bootstrap servers, host:port,...")
    # RUF009 cannot know that setting() returns a dataclasses.field.
    kafka_config: dict[str, str] = setting(
        default_factory=dict,
        help="extra librdkafka property, one per flag, repeat it: --kafka-config "
        "security.protocol=SASL_SSL --kafka-config sasl.mechanism=PLAIN (the variable "
        "takes a comma list: security.protocol=SASL_SSL,sasl.mechanism=PLAIN)",
    )
    db_url: str | None = setting(
        None,
        help="SQLAlchemy database URL, e.g. mysql+pymysql://user:password@host:3306/db "
        "or postgresql+psycopg://user:password@host:5432/db",
        validate=valid_database_url,
    )
    redis_url: str | None = setting(
        None,
        help="Redis URL for shard leases and wake-ups, e.g. redis://host:6379/0",
        validate=valid_redis_url,
    )

    def validate(self) -> list[str]:
        """Cross-field checks; subclasses extend with ``[*super().validate(), ...]``."""
        return []
