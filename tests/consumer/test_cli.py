"""``outboxkit consume``: bad targets and bad settings exit 2 with a message naming them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from procs import HERE

from outboxkit.cli import main

pytestmark = pytest.mark.unit


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["consume", *argv])
    return code, capsys.readouterr().err


def test_unknown_module_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "no_such_module_here:Orders", "--kafka-bootstrap", "x:9092")
    assert code == 2
    assert "cannot import 'no_such_module_here'" in err


def test_missing_class_and_not_a_consumer_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "consumer_apps:Nope")
    assert code == 2 and "has no attribute 'Nope'" in err
    code, err = _run(capsys, "consumer_apps:NotAConsumer")
    assert code == 2 and "is not a subclass of outboxkit.consumer.Consumer" in err
    code, err = _run(capsys, "consumer_apps")
    assert code == 2 and "package.module:ClassName" in err


def test_bad_settings_exit_2_naming_the_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOXKIT_MAX_ATTEMPTS", "0")
    code, err = _run(capsys, "consumer_apps:Sleepy", "--worker-drain-timeout", "-1")
    assert code == 2
    assert "--max-attempts / OUTBOXKIT_MAX_ATTEMPTS" in err
    assert "--worker-drain-timeout / OUTBOXKIT_WORKER_DRAIN_TIMEOUT" in err


def test_cross_field_and_class_level_problems_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _run(capsys, "consumer_apps:Sleepy", "--worker-drain-timeout", "40")
    assert code == 2
    assert "must be < shutdown_timeout" in err
    code, err = _run(capsys, "consumer_apps:Sleepy", "--topics", "t")
    assert code == 2
    assert "--group-id / OUTBOXKIT_GROUP_ID" in err
    assert "--kafka-bootstrap / OUTBOXKIT_KAFKA_BOOTSTRAP" in err


def test_the_console_entry_point_exits_2_for_a_bad_target(tmp_path: Path) -> None:
    import os

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "outboxkit", "consume", "consumer_apps:NotAConsumer"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "not a subclass" in done.stderr


def test_the_demo_consumer_the_manifests_run_loads() -> None:
    from outboxkit.consumer.cli import load_consumer_class

    cls = load_consumer_class("outboxkit.demo:OrderConsumer")
    assert cls.topics == ("orders",) and cls.group_id == "outboxkit-demo"
