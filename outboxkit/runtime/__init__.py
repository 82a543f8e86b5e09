"""The runtime shared by the relay and the consumer.

Lifecycle and signals, the health/metrics HTTP server, the worker supervisor,
settings from flags and environment, structured logging with redaction, exit
codes and the exception tree. See ``docs/runtime.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Imported on first use (outboxkit._lazy): the writer needs only the errors, not
# the health server, Prometheus or the settings machinery.
if TYPE_CHECKING:
    from outboxkit.runtime.errors import (
        ConfigError,
        DependencyError,
        OutboxError,
        PermanentError,
        TransientError,
    )
    from outboxkit.runtime.exitcodes import (
        EXIT_CONFIG,
        EXIT_DEPENDENCY,
        EXIT_FAILURE,
        EXIT_FORCED,
        EXIT_OK,
    )
    from outboxkit.runtime.health import HealthServer
    from outboxkit.runtime.lifecycle import HurryEvent, Lifecycle, State
    from outboxkit.runtime.logs import (
        configure_logging,
        log_event,
        redact,
        redact_url,
        register_secret,
    )
    from outboxkit.runtime.metrics import ServiceMetrics, push_metrics
    from outboxkit.runtime.service import ServiceRuntime
    from outboxkit.runtime.settings import (
        MISSING,
        RuntimeSettings,
        add_arguments,
        describe,
        load,
        setting,
    )
    from outboxkit.runtime.supervisor import Supervisor
else:
    from outboxkit._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "outboxkit.runtime.errors": (
                "ConfigError",
                "DependencyError",
                "OutboxError",
                "PermanentError",
                "TransientError",
            ),
            "outboxkit.runtime.exitcodes": (
                "EXIT_CONFIG",
                "EXIT_DEPENDENCY",
                "EXIT_FAILURE",
                "EXIT_FORCED",
                "EXIT_OK",
            ),
            "outboxkit.runtime.health": ("HealthServer",),
            "outboxkit.runtime.lifecycle": ("HurryEvent", "Lifecycle", "State"),
            "outboxkit.runtime.logs": (
                "configure_logging",
                "log_event",
                "redact",
                "redact_url",
                "register_secret",
            ),
            "outboxkit.runtime.metrics": ("ServiceMetrics", "push_metrics"),
            "outboxkit.runtime.service": ("ServiceRuntime",),
            "outboxkit.runtime.settings": (
                "MISSING",
                "RuntimeSettings",
                "add_arguments",
                "describe",
                "load",
                "setting",
            ),
            "outboxkit.runtime.supervisor": ("Supervisor",),
        },
    )

__all__ = [
    "EXIT_CONFIG",
    "EXIT_DEPENDENCY",
    "EXIT_FAILURE",
    "EXIT_FORCED",
    "EXIT_OK",
    "MISSING",
    "ConfigError",
    "DependencyError",
    "HealthServer",
    "HurryEvent",
    "Lifecycle",
    "OutboxError",
    "PermanentError",
    "RuntimeSettings",
    "ServiceMetrics",
    "ServiceRuntime",
    "State",
    "Supervisor",
    "TransientError",
    "add_arguments",
    "configure_logging",
    "describe",
    "load",
    "log_event",
    "push_metrics",
    "redact",
    "redact_url",
    "register_secret",
    "setting",
]
