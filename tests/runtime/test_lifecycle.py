from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import bound

from outboxkit.runtime import (
    EXIT_DEPENDENCY,
    EXIT_FAILURE,
    EXIT_FORCED,
    EXIT_OK,
    Lifecycle,
    State,
)
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.unit

APP = Path(__file__).with_name("lifecycle_app.py")


# -- in-process ----------------------------------------------------------------


def make() -> Lifecycle:
    return Lifecycle(service="t", node_id="n", shutdown_timeout=10)


def test_state_machine_and_log_lines() -> None:
    lc = make()
    with capture_json_logs() as cap:
        assert lc.state is State.STARTING
        assert lc.remaining() == math.inf
        lc.set_running()
        lc.set_running()
        assert lc.state is State.RUNNING and not lc.draining.is_set()
        lc.drain()
        lc.drain("SIGTERM")  # later calls change nothing
        assert lc.state is State.DRAINING and lc.draining.is_set()
        assert lc.signal_name == "api"
        assert lc.drain_started_at is not None
        assert 9 < lc.remaining() <= 10
        assert not lc.hurry.is_set()
        lc.set_running()  # no-op once draining
        assert lc.state is State.DRAINING
        lc.set_stopped()
        assert lc.state is State.STOPPED
    changes = [(r["from"], r["to"]) for r in cap.events("state-changed")]
    assert changes == [("starting", "running"), ("running", "draining"), ("draining", "stopped")]
    assert cap.events("state-changed")[1]["reason"] == "api"
    assert lc.exit_code() == EXIT_OK


def test_hurry_is_an_event_and_a_call() -> None:
    lc = make()
    lc.set_running()
    seen: list[str] = []
    lc.on_hurry(lambda: seen.append("hurry"))
    lc.on_drain(lambda: seen.append("drain"))
    lc.hurry()
    assert lc.hurry.is_set() and lc.draining.is_set()
    assert lc.state is State.DRAINING
    lc.hurry()
    assert seen == ["drain", "hurry"]


def test_failing_callback_is_logged_not_raised() -> None:
    lc = make()

    def bad() -> None:
        raise RuntimeError("hook broke")

    lc.on_drain(bad)
    with capture_json_logs() as cap:
        lc.drain()
    assert lc.draining.is_set()
    assert cap.events("lifecycle-callback-failed")[0]["error"] == "RuntimeError: hook broke"


def test_fatal_records_exit_code_and_drains() -> None:
    lc = make()
    lc.set_running()
    with capture_json_logs() as cap:
        lc.fatal("kafka gone", ConnectionError("broker redis://:pw@x down"))
        lc.fatal("second", exit_code=EXIT_FAILURE)  # first intent wins
    assert lc.state is State.DRAINING
    assert lc.signal_name == "fatal"
    assert lc.exit_code_hint == EXIT_DEPENDENCY == lc.exit_code()
    rec = cap.events("fatal")[0]
    assert rec["level"] == "ERROR" and rec["reason"] == "kafka gone"
    assert rec["error"] == "ConnectionError: broker redis://:***@x down"


def test_wait_draining_wakes_at_once() -> None:
    lc = make()
    threading.Timer(0.1, lc.drain).start()
    start = time.monotonic()
    assert lc.wait_draining(10) is True
    assert time.monotonic() - start < 2
    assert make().wait_draining(0.01) is False


def test_signal_handlers_in_process() -> None:
    # Python's own SIGINT handler first: a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then installs none.
    original_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _check_signal_handlers_in_process()
    finally:
        signal.signal(signal.SIGINT, original_int)


def _check_signal_handlers_in_process() -> None:
    lc = make()
    before = signal.getsignal(signal.SIGTERM)
    before_int = signal.getsignal(signal.SIGINT)
    lc.install_signal_handlers()
    try:
        lc.set_running()
        os.kill(os.getpid(), signal.SIGTERM)
        assert lc.wait_draining(5)
        assert lc.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)
        assert lc.hurry.wait(5)
    finally:
        lc.uninstall_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) == before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was given back
    assert signal.getsignal(signal.SIGINT) is before_int
    with pytest.raises(KeyboardInterrupt):  # SIGINT default behaviour is back
        # To this thread: a signal sent to the process may be taken by any of its threads.
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)


def test_install_outside_main_thread_is_refused() -> None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            make().install_signal_handlers()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])


def test_shutdown_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="shutdown_timeout"):
        Lifecycle(service="t", node_id="n", shutdown_timeout=0)


# -- real process, real signals -------------------------------------------------


class App:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return err.code

    def wait_status(self, path: str, status: int, timeout: float = 5.0) -> float:
        start = time.monotonic()
        while time.monotonic() - start < bound(timeout):
            if self.get(path) == status:
                return time.monotonic() - start
            time.sleep(0.01)
        raise AssertionError(f"{path} never returned {status}")

    def finish(self, timeout: float = 15.0) -> tuple[int, list[dict[str, object]], str]:
        _, err = self.proc.communicate(timeout=timeout)
        records = []
        for line in err.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"non-JSON line on stderr: {line!r}")
        return self.proc.returncode, records, err


@pytest.fixture
def start_app() -> Iterator[object]:
    procs: list[subprocess.Popen[str]] = []

    def start(mode: str, timeout: float, drain_work: float) -> App:
        proc = subprocess.Popen(
            [sys.executable, str(APP), mode, str(timeout), str(drain_work)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"app did not start: {proc.communicate(timeout=5)[1]}")
        app = App(proc, json.loads(line)["port"])
        app.wait_status("/healthz/ready", 200)
        return app

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def events(records: list[dict[str, object]], name: str) -> list[dict[str, object]]:
    return [r for r in records if r.get("event") == name]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_drains_cleanly(start_app, sig: signal.Signals) -> None:  # type: ignore[no-untyped-def]
    app = start_app("clean", 10, 1.0)
    os.kill(app.proc.pid, sig)
    took = app.wait_status("/healthz/ready", 503)
    assert took < 0.5
    assert app.get("/healthz/live") == 200  # still alive while draining
    code, records, _ = app.finish()
    assert code == EXIT_OK
    (received,) = events(records, "signal-received")
    assert (received["signal"], received["action"]) == (sig.name, "drain")
    changes = [(r["from"], r["to"], r.get("reason")) for r in events(records, "state-changed")]
    assert changes == [
        ("starting", "running", "started"),
        ("running", "draining", sig.name),
        ("draining", "stopped", sig.name),
    ]
    assert events(records, "drained")[0]["hurried"] is False
    assert events(records, "forced-shutdown") == []


def test_second_signal_hurries(start_app) -> None:  # type: ignore[no-untyped-def]
    app = start_app("clean", 20, 15.0)
    os.kill(app.proc.pid, signal.SIGTERM)
    app.wait_status("/healthz/ready", 503)
    start = time.monotonic()
    os.kill(app.proc.pid, signal.SIGTERM)
    code, records, _ = app.finish()
    assert time.monotonic() - start < 5  # far below the 15 s soft drain
    assert code == EXIT_OK
    assert [r["action"] for r in events(records, "signal-received")] == ["drain", "hurry"]
    assert events(records, "hurry")[0]["level"] == "WARNING"
    assert events(records, "unfinished-work")[0]["count"] == 3
    assert events(records, "drained")[0]["hurried"] is True


def test_watchdog_forces_exit_and_names_cut_resources(start_app) -> None:  # type: ignore[no-untyped-def]
    app = start_app("hang", 1, 0)
    start = time.monotonic()
    os.kill(app.proc.pid, signal.SIGTERM)
    code, records, err = app.finish()
    elapsed = time.monotonic() - start
    assert code == EXIT_FORCED
    assert 0.9 < elapsed < 5
    (forced,) = events(records, "forced-shutdown")
    assert forced["level"] == "ERROR"
    assert forced["cut"] == ["fake-producer", "fake-db"]
    assert forced["shutdown_timeout_s"] == 1.0
    assert forced["signal"] == "SIGTERM"
    # on_forced ran after the cut and its output was flushed before os._exit
    assert events(records, "exit-record")[0]["password"] == "***"
    assert "app-s3cret" not in err


def test_fatal_drains_and_exits_with_dependency_code(start_app) -> None:  # type: ignore[no-untyped-def]
    app = start_app("fatal", 10, 0.2)
    code, records, err = app.finish()
    assert code == EXIT_DEPENDENCY
    (fatal,) = events(records, "fatal")
    assert fatal["reason"] == "database gone for good"
    assert "app-s3cret" not in err
    assert [r["to"] for r in events(records, "state-changed")] == ["running", "draining", "stopped"]
