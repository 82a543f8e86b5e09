"""A built wheel installs every subpackage from its mapped folder."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
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
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # The dependencies come from this test's own environment, appended to the new
    # one's path (a plain path line: that environment's .pth files, its editable
    # outboxkit among them, are not read), so the wheel installed into the new
    # environment is the only outboxkit there. ``--system-site-packages`` gave
    # the base interpreter's packages instead, which a fresh machine's lack.
    own = sysconfig.get_paths()
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout.strip()
    lines = dict.fromkeys([own["purelib"], own["platlib"]])
    (Path(site) / "outboxkit_test_dependencies.pth").write_text("\n".join(lines) + "\n")
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
        [str(py), "-c", probe],
        cwd=tmp_path,
        check=False,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.stdout.strip() == version
    cli = subprocess.run(
        [str(venv / "bin" / "outboxkit"), "--help"],
        cwd=tmp_path,
        timeout=60,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0 and "schema" in cli.stdout
