"""``/healthz/live`` answers while the relay is still connecting (docs/runtime.md#states).

A relay whose Kafka does not answer spends up to ``--connect-timeout`` in its
start. Kubernetes probes liveness meanwhile; a refused connection there looks
like a dead process. The relay must answer live 200 and ready 503 ("starting")
for the whole start, then exit 3 when the dependency stays away.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from relay_support import RelayProcess, cli_args, fast_settings, http_get, wait_for
from support.services import free_ports

from outboxkit.runtime import EXIT_DEPENDENCY

pytestmark = pytest.mark.integration


def test_liveness_answers_while_the_relay_connects(
    db_url: str,
    outbox: str,
    relay_process: Callable[..., RelayProcess],
    request: pytest.FixtureRequest,
) -> None:
    (health_port,) = free_ports(1)
    # A "broker" that accepts connections and never answers: the start waits
    # connect_timeout for it, as it would for a broker behind a dead network path.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    request.addfinalizer(silent.close)
    settings = fast_settings(
        db_url,
        f"127.0.0.1:{silent.getsockname()[1]}",
        table=outbox,
        health_port=health_port,
        connect_timeout=20.0,
    )
    relay = relay_process(cli_args(settings))
    base = f"http://127.0.0.1:{health_port}"

    def probe(path: str) -> tuple[int, object] | None:
        try:
            return http_get(base + path)
        except OSError:  # refused: not listening (yet)
            return None

    # Until the relay gives up on Kafka (connect_timeout) or a generous bound.
    answers: list[tuple[int, object]] = []

    def answered_or_exited() -> bool:
        got = probe("/healthz/live")
        if got is not None:
            answers.append(got)
        return bool(answers) or relay.proc.poll() is not None

    wait_for(answered_or_exited, timeout=60, what="/healthz/live answering or an exit")
    assert answers, f"no answer on /healthz/live while starting; log: {relay.lines[-5:]}"
    live = answers[0]
    assert live[0] == 200 and live[1] == {"state": "starting"}, live
    ready = probe("/healthz/ready")
    assert ready is not None and ready[0] == 503, ready
    assert relay.proc.poll() is None, "still starting: the answers came during the start"
    assert relay.wait(timeout=60) == EXIT_DEPENDENCY
    assert relay.events("start-failed"), relay.lines[-10:]
    assert probe("/healthz/live") is None, "the health server is closed after a failed start"
