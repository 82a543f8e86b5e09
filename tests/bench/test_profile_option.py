"""``--profile`` finds py-spy where a virtualenv puts it, and refuses to run without it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import cli, profile


def _interpreter_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A virtualenv-like bin folder that is not on PATH (PATH is empty)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    return bin_dir


def test_profile_uses_the_py_spy_beside_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = _interpreter_in(tmp_path, monkeypatch)
    spy = bin_dir / "py-spy"
    spy.write_text("#!/bin/sh\n")
    spy.chmod(0o755)
    assert profile.executable() == str(spy)


def test_profile_without_py_spy_exits_2_before_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _interpreter_in(tmp_path, monkeypatch)
    ran: list[object] = []
    monkeypatch.setattr(cli, "run", lambda *a, **k: ran.append(a))
    code = cli.main(["--profile", "--db-url", "mysql+pymysql://u:p@127.0.0.1:1/x"])
    assert code == 2
    assert "--profile needs py-spy" in capsys.readouterr().out
    assert ran == []
