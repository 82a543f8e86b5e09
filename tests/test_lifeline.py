"""A run that is killed leaves no relay, consumer or proxy behind for the next
one: the next run kills what carries a dead run's mark (support.lifeline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.lifeline import HARNESS_ENV, _started, reap_orphans

REPO = Path(__file__).resolve().parents[1]


def _sleeper(marker: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != HARNESS_ENV}
    if marker is not None:
        env[HARNESS_ENV] = marker
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


@pytest.mark.unit
def test_only_the_processes_of_a_run_that_is_gone_are_killed() -> None:
    root = subprocess.Popen(["sleep", "60"])  # a run, killed below
    dead_run = f"{root.pid}:{_started(root.pid)}"
    root.kill()
    root.wait()
    orphan = _sleeper(dead_run)
    reused = _sleeper(f"{os.getpid()}:0")  # our pid, another start time: not us
    ours = _sleeper(f"{os.getpid()}:{_started(os.getpid())}")
    unmarked = _sleeper(None)
    try:
        reaped = reap_orphans()
        assert orphan.wait(10) == -9 and orphan.pid in reaped
        assert reused.wait(10) == -9, "a pid reused by a live process does not save an orphan"
        assert ours.poll() is None and unmarked.poll() is None
        assert ours.pid not in reaped and unmarked.pid not in reaped
    finally:
        for p in (orphan, reused, ours, unmarked):
            p.kill()
            p.wait()


@pytest.mark.unit
def test_this_session_marks_what_it_starts_and_a_service_daemon_drops_the_mark(
    tmp_path: Path,
) -> None:
    assert os.environ.get(HARNESS_ENV), "the session's root marked this run"
    script = tmp_path / "spawn.sh"
    pid_file = tmp_path / "daemon.pid"
    script.write_text(
        f'source "{REPO}/deploy/local/lib.sh"\n'
        f'PID_FILE="{pid_file}"\n'
        f'spawn_daemon "{tmp_path}/daemon.log" sleep 60\n'
    )
    subprocess.run(["bash", str(script)], check=True, timeout=30)
    pid = int(pid_file.read_text())
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(HARNESS_ENV.encode())]
    finally:
        os.kill(pid, 9)
