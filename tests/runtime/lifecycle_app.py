"""A tiny process wired like a real entry point, for lifecycle tests with real signals.

Usage: python lifecycle_app.py MODE SHUTDOWN_TIMEOUT DRAIN_WORK_S

MODE: "clean" (drain work takes DRAIN_WORK_S, cut short by hurry), "hang"
(drain never finishes: the watchdog must force the exit), "fatal" (the
worker reports a dependency gone for good after start).
Prints {"port": N} on stdout once ready; logs JSON to stderr.
"""

from __future__ import annotations

import json
import logging
import sys
import threading

from prometheus_client import CollectorRegistry

from outboxkit.runtime import (
    HealthServer,
    Lifecycle,
    ServiceMetrics,
    Supervisor,
    configure_logging,
    log_event,
    register_secret,
)

log = logging.getLogger("lifecycle_app")


def main() -> int:
    mode, timeout, drain_work = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    configure_logging(service="app", node_id="node-1")
    register_secret("app-s3cret")
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, service="app")
    lc = Lifecycle(service="app", node_id="node-1", shutdown_timeout=timeout, metrics=metrics)
    lc.install_signal_handlers()
    lc.on_hurry(lambda: log_event(log, "unfinished-work", count=3))
    health = HealthServer(lc, port=0, registry=registry)
    health.start()
    lc.start_watchdog(
        cut=lambda: ["fake-producer", "fake-db"],
        on_forced=lambda: log_event(log, "exit-record", password="app-s3cret"),
    )

    def worker() -> None:
        if mode == "fatal":
            lc.wait_draining(0.3)
            lc.fatal("database gone for good", ConnectionError("db at mysql://u:app-s3cret@h"))
        while not lc.wait_draining(1.0):
            pass
        # Drain work: finish in-flight items, unless told to hurry.
        if mode == "hang":
            threading.Event().wait()
        hurried = lc.hurry.wait(drain_work)
        log_event(log, "drained", hurried=hurried, remaining_s=round(lc.remaining(), 3))

    lc.set_running()
    print(json.dumps({"port": health.port}), flush=True)
    Supervisor(lc, metrics=metrics).run("worker", worker)
    lc.set_stopped()
    health.stop()
    lc.uninstall_signal_handlers()
    return lc.exit_code()


if __name__ == "__main__":
    sys.exit(main())
