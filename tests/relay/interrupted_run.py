"""Not collected with the suite (no ``test_`` prefix): the run that
``tests/test_interrupt.py`` starts and interrupts with Ctrl-C.

Its one test starts a relay whose database never answers (a socket that
accepts and stays silent) with a long ``--connect-timeout``: the relay stays in
its start, as relays of the fault tests do, and on its own would answer a
signal only when that start gives up. Once the relay's health server is up, the
test writes its pid to ``$OUTBOXKIT_TEST_INTERRUPT_READY`` and waits for the
interrupt.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from relay_support import RelayProcess
from support.waiting import wait_for

READY_ENV = "OUTBOXKIT_TEST_INTERRUPT_READY"


def test_a_relay_still_starting_when_the_run_is_interrupted(
    relay_process: Callable[..., RelayProcess],
) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        relay = relay_process(
            [
                *("--db-url", f"mysql+pymysql://outboxkit@127.0.0.1:{port}/outboxkit_test"),
                *("--kafka-bootstrap", "127.0.0.1:9", "--connect-timeout", "600"),
                *("--health-port", "0", "--start-jitter", "0"),
            ]
        )
        relay.wait_event("health-server-started", timeout=60)
        Path(os.environ[READY_ENV]).write_text(str(relay.proc.pid))
        # Stands for any long test: it ends when the run is interrupted.
        wait_for(lambda: relay.proc.poll() is not None, timeout=600, what="the interrupt")
