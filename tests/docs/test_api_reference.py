"""The API reference (docs/api) builds from the docstrings, warnings as errors.

``python -m sphinx -W --keep-going``, as README's "API reference" says, into a
temporary folder; then its inventory (``objects.inv``, what other Sphinx
projects link against) must hold every public name: a name added to an
``__all__`` without a docstring, or a docstring whose markup Sphinx cannot read,
fails here.
"""

from __future__ import annotations

import importlib
import posixpath
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "docs" / "api"

# module -> the names of it the reference must document (None: its __all__).
REQUIRED: dict[str, list[str] | None] = {
    "outboxkit": None,
    "outboxkit.relay": ["Relay", "RelaySettings"],
    "outboxkit.consumer": None,
    "outboxkit.consumer.inbox": None,
    "outboxkit.schema": None,
    "outboxkit.runtime.testing": None,
}
# Where a re-exported name is documented instead: the module that defines it.
ALSO_AT = ("outboxkit.errors", "outboxkit.writer")


def _required() -> list[str]:
    names = []
    for module, wanted in REQUIRED.items():
        listed = wanted if wanted is not None else importlib.import_module(module).__all__
        names += [f"{module}.{n}" for n in listed if not n.startswith("__")]
    return names


def test_the_api_reference_builds_without_a_warning_and_covers_the_public_names(
    tmp_path: Path,
) -> None:
    out = tmp_path / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(SOURCES), str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    assert "WARNING" not in build.stderr, build.stderr[-4000:]

    from sphinx.util.inventory import InventoryFile

    with (out / "objects.inv").open("rb") as f:
        inventory = InventoryFile.load(f, "", posixpath.join)
    documented = {name for objects in inventory.values() for name in objects}
    missing = []
    for name in _required():
        short = name.rsplit(".", 1)[1]
        if name not in documented and not any(f"{m}.{short}" in documented for m in ALSO_AT):
            missing.append(name)
    assert missing == [], f"public names not in the API reference: {missing}"
    for page in ("writer", "errors", "relay", "consumer", "schema", "testing"):
        assert (out / f"{page}.html").exists(), page
