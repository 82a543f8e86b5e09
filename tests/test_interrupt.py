"""The test command at a terminal: it shows progress while the suite is
collected, and Ctrl-C stops everything the run started within seconds.

The run is pytest as ``deploy/local/test.sh`` starts it (two xdist workers),
in its own process group, on ``tests/relay/interrupted_run.py``: one test that
starts a relay subprocess that stays in its start (its database never answers)
and waits. Once the relay runs, SIGINT goes to the whole group, as a terminal's
Ctrl-C does; on its own, that relay would go on starting for its whole
``--connect-timeout``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.lifeline import HARNESS_ENV
from support.waiting import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
PROC = Path("/proc")
#: The command line of a pytest-xdist worker (execnet's bootstrap).
WORKER = "exec(eval(sys.stdin.readline()))"


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to read its exit."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_processes(root: int) -> dict[int, str]:
    """Live processes marked as started by the run whose session is ``root``."""
    mark = f"{HARNESS_ENV}={root}:".encode()
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(v.startswith(mark) for v in environ) and alive(int(entry.name)):
            found[int(entry.name)] = cmdline
    return found


def test_ctrl_c_stops_the_run_and_its_relays_and_collection_shows_progress(
    tmp_path: Path,
) -> None:
    # The inner run marks its own processes (not under this session's mark).
    env = {k: v for k, v in os.environ.items() if k != HARNESS_ENV}
    env["OUTBOXKIT_TEST_PROGRESS_INTERVAL"] = "0.5"
    ready = tmp_path / "relay.pid"
    env["OUTBOXKIT_TEST_INTERRUPT_READY"] = str(ready)
    run = subprocess.Popen(
        [
            *(sys.executable, "-m", "pytest", "-n", "2", "--dist", "worksteal"),
            *("-p", "no:cacheprovider", "tests/relay/interrupted_run.py"),
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: ready.exists() or run.poll() is not None,
            timeout=120,
            what="the run's relay to be starting",
        )
        assert run.poll() is None, "".join(output)
        relay = int(ready.read_text())
        assert "outboxkit relay" in run_processes(run.pid)[relay]
        os.killpg(run.pid, signal.SIGINT)
        interrupted = time.monotonic()
        # The relay first: it is killed at once, not left to its own start.
        wait_for(
            lambda: not alive(relay),
            timeout=2,  # killed, not left to its start (on main: 3.7 s and more)
            interval=0.01,
            what=f"the relay {relay} to stop",
        )
        relay_stopped = time.monotonic() - interrupted
        # Then everything else the run started, but its own pytest processes.
        wait_for(
            lambda: not [c for c in run_processes(run.pid).values() if WORKER not in c],
            timeout=5,
            what=f"the run's processes to stop: {run_processes(run.pid)}",
        )
        # pytest and its workers: interrupted, their clean-up cut short.
        wait_for(
            lambda: run.poll() is not None and not run_processes(run.pid),
            timeout=10,
            what=f"the run to end: {run_processes(run.pid)}",
        )
        stopped = time.monotonic() - interrupted
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(30)
        for pid in run_processes(run.pid):
            os.kill(pid, signal.SIGKILL)
    reader.join(10)
    if run.stdout is not None:
        run.stdout.close()
    text = "".join(output)
    print(f"relay stopped {relay_stopped:.1f} s, all {stopped:.1f} s after the interrupt")
    assert run.returncode == 2, text  # pytest's "interrupted"
    assert "KeyboardInterrupt" in text, text
    # Lines while the workers collected, before they reported what they found.
    progress = [line for line in text.splitlines() if line.startswith("collecting: ")]
    assert progress, text
    assert text.index(progress[0]) < text.index("workers [1 item]"), text
    assert relay not in run_processes(run.pid)
