from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client import CollectorRegistry

from outboxkit.runtime import Lifecycle, ServiceMetrics, Supervisor
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.unit


class Boom(Exception):
    pass


def make_lifecycle() -> Lifecycle:
    return Lifecycle(service="test", node_id="n", shutdown_timeout=5)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def crashing_loop(failures: int, clock: FakeClock | None = None, run_for: float = 0.0):  # type: ignore[no-untyped-def]
    calls = {"n": 0}

    def loop() -> None:
        calls["n"] += 1
        if clock is not None:
            clock.now += run_for
        if calls["n"] <= failures:
            raise Boom(f"crash {calls['n']} password=hunter2")

    return loop, calls


def test_restart_series_doubles_and_caps() -> None:
    lc = make_lifecycle()
    sleeps: list[float] = []
    registry = CollectorRegistry()
    sup = Supervisor(
        lc,
        metrics=ServiceMetrics(registry, service="t"),
        sleep=lambda d: sleeps.append(d) or False,
    )
    loop, calls = crashing_loop(8)
    with capture_json_logs() as cap:
        sup.run("claimer", loop)
    assert sleeps == [1, 2, 4, 8, 16, 30, 30, 30]
    assert calls["n"] == 9
    crashes = cap.events("worker-crashed")
    assert [c["restart_in_s"] for c in crashes] == sleeps
    assert [c["restarts"] for c in crashes] == list(range(1, 9))
    assert crashes[0]["worker"] == "claimer"
    assert crashes[0]["level"] == "ERROR"
    assert crashes[0]["error"] == "Boom: crash 1 password=***"
    assert "Traceback" in str(crashes[0]["exc"]) and "hunter2" not in cap.text
    assert registry.get_sample_value("service_worker_restarts_total", {"worker": "claimer"}) == 8


def test_series_resets_after_a_long_healthy_run() -> None:
    lc = make_lifecycle()
    clock = FakeClock()
    sleeps: list[float] = []
    durations = iter([1, 1, 1, 61, 1, 1, 1])  # the 4th run lasted 61 s before crashing

    def loop() -> None:
        clock.now += next(durations)
        if len(sleeps) < 6:
            raise Boom("again")

    sup = Supervisor(lc, sleep=lambda d: sleeps.append(d) or False, clock=clock)
    sup.run("w", loop)
    assert sleeps == [1, 2, 4, 1, 2, 4]


def test_custom_backoff() -> None:
    sleeps: list[float] = []
    sup = Supervisor(
        make_lifecycle(), backoff=(0.1, 0.5), sleep=lambda d: sleeps.append(d) or False
    )
    loop, _ = crashing_loop(3)
    sup.run("w", loop)
    assert sleeps == [0.1, 0.5, 0.5]


def test_no_restart_once_draining() -> None:
    lc = make_lifecycle()
    sleeps: list[float] = []
    calls = {"n": 0}

    def loop() -> None:
        calls["n"] += 1
        lc.drain()
        raise Boom("during drain")

    sup = Supervisor(lc, sleep=lambda d: sleeps.append(d) or False)
    with capture_json_logs() as cap:
        sup.run("w", loop)
    assert calls["n"] == 1
    assert sleeps == []
    (rec,) = cap.events("worker-crashed-during-drain")
    assert rec["worker"] == "w" and "Traceback" in str(rec["exc"])
    assert cap.events("worker-crashed") == []


def test_drain_during_backoff_cancels_the_restart() -> None:
    lc = make_lifecycle()
    loop, calls = crashing_loop(5)

    def sleep(delay: float) -> bool:
        lc.drain()
        return lc.draining.is_set()

    with capture_json_logs() as cap:
        Supervisor(lc, sleep=sleep).run("w", loop)
    assert calls["n"] == 1
    assert cap.events("worker-restart-cancelled")[0]["worker"] == "w"


def test_default_sleep_wakes_at_once_on_drain() -> None:
    lc = make_lifecycle()
    loop, calls = crashing_loop(100)
    sup = Supervisor(lc, backoff=(30,))
    thread = sup.spawn("sleepy", loop)
    assert thread.name == "sleepy" and not thread.daemon
    threading.Timer(0.2, lc.drain).start()
    thread.join(5)
    assert not thread.is_alive()
    assert calls["n"] == 1


def test_returning_loop_is_not_restarted() -> None:
    sleeps: list[float] = []
    loop, calls = crashing_loop(0)
    Supervisor(make_lifecycle(), sleep=lambda d: sleeps.append(d) or False).run("w", loop)
    assert calls["n"] == 1 and sleeps == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_propagate(exc: type[BaseException]) -> None:
    def loop() -> None:
        raise exc()

    with pytest.raises(exc):
        Supervisor(make_lifecycle(), sleep=lambda d: False).run("w", loop)


def test_uses_given_logger() -> None:
    logger = logging.getLogger("outboxkit.relay.test")
    loop, _ = crashing_loop(1)
    with capture_json_logs() as cap:
        Supervisor(make_lifecycle(), logger=logger, sleep=lambda d: False).run("w", loop)
    assert cap.events("worker-crashed")[0]["logger"] == "outboxkit.relay.test"


def test_a_worker_crashing_three_times_in_a_row_is_a_crash_loop_until_a_run_lasts() -> None:
    """Three crashes in a row: readiness says not ready, naming the worker and the
    error's class, and one ``worker-crash-loop`` line is logged; a run that
    lasts ``reset_after`` ends it."""
    lc = make_lifecycle()
    clock = FakeClock()
    seen: list[dict[str, object]] = []
    sup = Supervisor(lc, clock=clock, sleep=lambda d: seen.append(sup.readiness()) or False)
    runs = iter([0.1, 0.1, 0.1, 0.1])

    def loop() -> None:
        clock.now += next(runs, 0.0)
        if len(seen) < 4:
            raise Boom("no such row password=hunter2")
        seen.append(sup.readiness())  # the fifth run, which does not crash
        clock.now += 60.0
        seen.append(sup.readiness())

    with capture_json_logs() as cap:
        sup.run("claimer", loop)
    assert seen[0] == {} and seen[1] == {}, "one or two crashes are not a loop"
    assert seen[2] == {
        "ready": False,
        "crash_loop": [
            {
                "worker": "claimer",
                "error": "Boom",
                "consecutive_crashes": 3,
                "detail": "Boom: no such row password=***",
            }
        ],
    }
    assert seen[3]["crash_loop"][0]["consecutive_crashes"] == 4  # type: ignore[index]
    assert seen[4]["ready"] is False, "a restarted run is not yet proof"
    assert seen[5] == {}, "a run that lasted reset_after ends the loop"
    (line,) = cap.events("worker-crash-loop")
    assert line["worker"] == "claimer" and line["error"] == "Boom" and line["level"] == "ERROR"
    assert "hunter2" not in cap.text


def test_a_drain_during_a_crash_loop_sets_a_failing_exit_code_and_keeps_the_loop() -> None:
    lc = make_lifecycle()
    loop, _ = crashing_loop(100)
    crashes = {"n": 0}

    def sleep(delay: float) -> bool:
        crashes["n"] += 1
        if crashes["n"] == 3:
            lc.drain("SIGTERM")
        return lc.draining.is_set()

    sup = Supervisor(lc, sleep=sleep)
    sup.run("consumer-worker-0", loop)
    assert [c.worker for c in sup.crash_loops_at_drain] == ["consumer-worker-0"]
    assert sup.crash_loops_at_drain[0].error == "Boom"
    assert lc.exit_code() == 1


def test_a_drain_after_two_crashes_keeps_the_exit_code_clean() -> None:
    lc = make_lifecycle()
    loop, _ = crashing_loop(100)

    def sleep(delay: float) -> bool:
        if delay == 2:
            lc.drain("SIGTERM")
        return lc.draining.is_set()

    sup = Supervisor(lc, sleep=sleep)
    sup.run("w", loop)
    assert sup.crash_loops_at_drain == () and lc.exit_code() == 0


def test_a_dependency_outage_is_no_crash_loop_and_a_drain_after_it_exits_clean() -> None:
    """A database restart makes the relay's loop raise ``OperationalError`` on every
    try until the server is back: restarts with backoff, as before, but not a crash
    loop (the outage is not the code's, and it has its own reports). Seen in a full
    chaos run: relays redeployed right after a database fault exited 1 with
    ``crash-loop``."""
    import pymysql
    import sqlalchemy.exc

    lc = make_lifecycle()
    calls = {"n": 0}

    def loop() -> None:
        calls["n"] += 1
        raise sqlalchemy.exc.OperationalError(
            "SELECT 1", {}, pymysql.err.OperationalError(2013, "Lost connection")
        )

    seen: list[dict[str, object]] = []

    def sleep(delay: float) -> bool:
        seen.append(sup.readiness())
        if calls["n"] == 5:
            lc.drain("SIGTERM")
        return lc.draining.is_set()

    sup = Supervisor(lc, sleep=sleep)
    with capture_json_logs() as cap:
        sup.run("relay", loop)
    assert seen == [{}] * 5
    assert sup.crash_loops_at_drain == () and lc.exit_code() == 0
    assert cap.events("worker-crash-loop") == []
    assert len(cap.events("worker-crashed")) == 5
