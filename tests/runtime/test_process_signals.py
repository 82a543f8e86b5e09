"""One lifecycle surface: ``run(handle_signals=...)`` installs the signal handlers
only when asked, and removes them again when ``run`` returns, for both services."""

from __future__ import annotations

import inspect
import signal
import threading
from collections.abc import Iterator

import pytest

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.relay import Relay, RelaySettings
from outboxkit.runtime import EXIT_DEPENDENCY, Lifecycle
from outboxkit.runtime.service import Service

pytestmark = pytest.mark.unit

# Nothing listens on port 1: every connection is refused at once.
_NOWHERE_DB = "mysql+pymysql://u:p@127.0.0.1:1/db"
_NOWHERE_KAFKA = "127.0.0.1:1"


@pytest.fixture(autouse=True)
def _restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _handlers() -> tuple[object, object]:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_process_signals_installs_only_when_asked_and_restores() -> None:
    before = _handlers()
    lc = Lifecycle(service="t", node_id="n", shutdown_timeout=10)
    with lc.process_signals(False, cut=list):
        assert _handlers() == before
    with lc.process_signals(True, cut=list):
        assert _handlers() != before
    assert _handlers() == before
    lc.drain("test")
    lc.set_stopped()


def _relay() -> Relay:
    return Relay(
        RelaySettings(
            db_url=_NOWHERE_DB,
            kafka_bootstrap=_NOWHERE_KAFKA,
            connect_timeout=1.0,
            health_port=0,
        )
    )


def test_relay_run_removes_the_handlers_the_deprecated_call_installed() -> None:
    before = _handlers()
    relay = _relay()
    with pytest.warns(DeprecationWarning, match=r"run\(handle_signals=True\)"):
        relay.install_process_handlers()  # what `outboxkit relay` did before
    assert _handlers() != before
    assert relay.run(handle_signals=False) == EXIT_DEPENDENCY
    assert _handlers() == before, "the relay left its signal handlers installed"


def test_relay_drain_still_stops_it_with_a_warning() -> None:
    relay = _relay()
    with pytest.warns(DeprecationWarning, match=r"Relay\.stop\(\)"):
        relay.drain()
    assert relay.lifecycle.draining.is_set()


@pytest.mark.parametrize("handle_signals", [False, True])
def test_relay_run_installs_handlers_only_when_asked(handle_signals: bool) -> None:
    before = _handlers()
    relay = _relay()
    seen: list[tuple[object, object]] = []
    relay.lifecycle.on_drain(lambda: seen.append(_handlers()))
    assert relay.run(handle_signals=handle_signals) == EXIT_DEPENDENCY
    assert (seen[0] != before) is handle_signals
    assert _handlers() == before


class _Nothing(Consumer):
    topics = ("t",)
    group_id = "g"

    def handle(self, message: Message) -> None:
        pass


@pytest.mark.parametrize("handle_signals", [False, True])
def test_consumer_run_installs_handlers_only_when_asked(handle_signals: bool) -> None:
    before = _handlers()
    consumer = _Nothing(
        ConsumerSettings(kafka_bootstrap=_NOWHERE_KAFKA, connect_timeout=1.0, health_port=0)
    )
    seen: list[tuple[object, object]] = []
    consumer.lifecycle.on_drain(lambda: seen.append(_handlers()))
    assert consumer.run(handle_signals=handle_signals) == EXIT_DEPENDENCY
    assert (seen[0] != before) is handle_signals
    assert _handlers() == before


def _service(kind: str) -> Relay | Consumer:
    if kind == "relay":
        return _relay()
    return _Nothing(
        ConsumerSettings(kafka_bootstrap=_NOWHERE_KAFKA, connect_timeout=1.0, health_port=0)
    )


@pytest.mark.parametrize("kind", ["relay", "consumer"])
def test_both_services_offer_one_lifecycle(kind: str) -> None:
    service = _service(kind)
    assert isinstance(service, Service)
    # the same parameter, with the same default, on both
    assert inspect.signature(service.run).parameters["handle_signals"].default is None


@pytest.mark.parametrize("kind", ["relay", "consumer"])
@pytest.mark.parametrize("where", ["main thread", "other thread"])
def test_by_default_signals_are_handled_on_the_main_thread_only(kind: str, where: str) -> None:
    service = _service(kind)
    before = _handlers()
    seen: list[tuple[object, object]] = []
    service.lifecycle.on_drain(lambda: seen.append(_handlers()))
    codes: list[int] = []
    if where == "main thread":
        codes.append(service.run())
    else:  # embedded: no handlers, and no error for not being on the main thread
        thread = threading.Thread(target=lambda: codes.append(service.run()))
        thread.start()
        thread.join(60)
    assert codes == [EXIT_DEPENDENCY]
    assert (seen[0] != before) is (where == "main thread")
    assert _handlers() == before
