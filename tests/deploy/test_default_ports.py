"""A relay and a consumer started with their defaults run side by side on one machine.

The README runs both on one machine, and a relay sidecar shares its pod's
network with whatever else runs there: their default health ports differ
(relay 8080, consumer 8081), so neither needs ``--health-port``. Both processes
here get no health-port setting at all, on the real services.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from support.waiting import wait_for

from outboxkit.consumer.settings import ConsumerSettings
from outboxkit.relay import RelaySettings

pytestmark = pytest.mark.integration

APPS = Path(__file__).resolve().parent


def _default_port(cls: type) -> int:
    import dataclasses

    return int(next(f.default for f in dataclasses.fields(cls) if f.name == "health_port"))


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_relay_and_consumer_with_default_health_ports_both_answer(
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
) -> None:
    relay_port = _default_port(RelaySettings)
    consumer_port = _default_port(ConsumerSettings)
    assert relay_port != consumer_port
    # The defaults are fixed ports, which another process on a shared test machine
    # may hold for a while; wait for them rather than fail on someone else's run.
    wait_for(
        lambda: _free(relay_port) and _free(consumer_port),
        timeout=120,
        interval=0.5,
        what=f"ports {relay_port} and {consumer_port} free",
    )
    topic = kafka_topics(partitions=1)
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    common = {**base, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap, "OUTBOXKIT_LOG_FORMAT": "json"}
    relay = subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "relay"],
        env={**common, "OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_TABLE": outbox},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    consumer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outboxkit",
            "consume",
            "push_apps:Idle",
            "--topics",
            topic,
            "--group-id",
            f"ports-{topic}",
        ],
        env={**common, "PYTHONPATH": str(APPS)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs = {"relay": relay, "consumer": consumer}
    try:
        wait_for(
            lambda: (
                any(p.poll() is not None for p in procs.values())
                or (_answers(relay_port) and _answers(consumer_port))
            ),
            timeout=60,
            interval=0.25,
            what="both health endpoints ready",
        )
        for name, proc in procs.items():
            if proc.poll() is not None:
                _, err = proc.communicate(timeout=10)
                pytest.fail(f"{name} exited {proc.returncode} at start:\n{err[-3000:]}")
        assert _answers(relay_port) and _answers(consumer_port)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=10)
                pytest.fail(f"{name} did not exit after SIGTERM")
    assert (relay.returncode, consumer.returncode) == (0, 0)
