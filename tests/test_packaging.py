"""A built wheel installs every subpackage from its mapped folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_wheel_installs_and_imports_every_subpackage(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = wheels.glob("outboxkit-*.whl")
    venv = tmp_path / "venv"
    # System site-packages provide the dependencies; the wheel itself goes into the venv.
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120
    )
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    probe = (
        "import importlib, outboxkit, pathlib\n"
        "for m in ('outboxkit.relay', 'outboxkit.consumer', 'outboxkit.schema',"
        " 'outboxkit.runtime', 'outboxkit.cli'):\n"
        "    f = pathlib.Path(importlib.import_module(m).__file__)\n"
        "    assert 'site-packages' in f.parts, f\n"
        "assert (pathlib.Path(outboxkit.__file__).parent / 'py.typed').exists()\n"
        "print(outboxkit.__version__)\n"
    )
    out = subprocess.run(
        [str(py), "-c", probe], cwd=tmp_path, check=True, timeout=60, capture_output=True, text=True
    )
    assert out.stdout.strip() == "0.1.0"
    cli = subprocess.run(
        [str(venv / "bin" / "outboxkit"), "--help"],
        cwd=tmp_path,
        timeout=60,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0 and "schema" in cli.stdout
