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


def _console_script() -> str:
    """The installed ``outboxkit`` command (beside this interpreter, as pip puts it)."""
    beside = Path(sys.executable).parent / "outboxkit"
    if beside.exists():
        return str(beside)
    import shutil

    found = shutil.which("outboxkit")
    assert found, "the outboxkit console script is not installed"
    return found


def _newcomer_env() -> dict[str, str]:
    import os

    return {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("OUTBOXKIT_")
    }


def test_the_console_script_imports_the_consumer_from_the_current_directory(
    tmp_path: Path,
) -> None:
    """``outboxkit consume mypkg.handlers:Orders`` run from the folder that holds
    ``mypkg/``, without PYTHONPATH, as uvicorn, gunicorn and celery load an app.
    On main the console script searched only its own folder and the installed
    packages: "cannot import 'mypkg.handlers' ...: No module named 'mypkg'", exit 2."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "handlers.py").write_text(
        "from outboxkit.consumer import Consumer, Message\n\n\n"
        "class Orders(Consumer):\n"
        "    topics = ('orders',)\n"
        "    group_id = 'orders'\n\n"
        "    def handle(self, message: Message) -> None:\n"
        "        pass\n"
    )
    done = subprocess.run(
        [_console_script(), "consume", "mypkg.handlers:Orders"],
        env=_newcomer_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Loaded: what stops it now is the setting it lacks, not the import.
    assert done.returncode == 2, done.stderr
    assert "cannot import" not in done.stderr, done.stderr
    assert "--kafka-bootstrap / OUTBOXKIT_KAFKA_BOOTSTRAP" in done.stderr, done.stderr


def test_a_consumer_module_not_found_says_where_it_looked_and_what_to_do(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [_console_script(), "consume", "invoicing:Invoicing"],
        env=_newcomer_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot import 'invoicing' for consumer 'invoicing:Invoicing'" in done.stderr
    assert f"Searched the current directory ({tmp_path})" in done.stderr, done.stderr
    assert "Run outboxkit from the folder that holds invoicing/ or invoicing.py" in done.stderr
    assert "add that folder to PYTHONPATH" in done.stderr


def test_an_import_failing_inside_the_consumer_module_names_what_is_missing(
    tmp_path: Path,
) -> None:
    (tmp_path / "billing.py").write_text("import no_such_dependency_here\n")
    done = subprocess.run(
        [_console_script(), "consume", "billing:Billing"],
        env=_newcomer_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert (
        "cannot import 'billing' for consumer 'billing:Billing': it imports "
        "'no_such_dependency_here', which is not installed in"
    ) in done.stderr, done.stderr
