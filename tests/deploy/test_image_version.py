"""The image's tag is the package version, everywhere it is named.

``deploy/docker/build.sh`` tags the image ``outboxkit:<version>`` with the
version in pyproject.toml (checked on a real build in test_image.py); the
compose file and the Kubernetes manifests must pin exactly that name and tag,
and no document may name another version's image. When the version changes,
the failures below list every place still naming the old one.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def package_version() -> str:
    with (REPO / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _is_outboxkit(image: str) -> bool:
    last = image.rsplit("@", 1)[0].rsplit("/", 1)[-1]
    return last.split(":", 1)[0] == "outboxkit"


def _k8s_images(yaml: ModuleType) -> list[tuple[str, str]]:
    found = []
    for path in sorted((REPO / "deploy/k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                if _is_outboxkit(str(c.get("image", ""))):
                    found.append((f"{path.relative_to(REPO)} container {c['name']}", c["image"]))
    return found


def test_compose_and_kubernetes_pin_the_package_version(yaml_module: ModuleType) -> None:
    expected = f"outboxkit:{package_version()}"
    compose: dict[str, Any] = yaml_module.safe_load(
        (REPO / "deploy/compose/compose.yaml").read_text()
    )
    pinned = [
        (f"deploy/compose/compose.yaml service {name}", str(service["image"]))
        for name, service in compose["services"].items()
        if _is_outboxkit(str(service.get("image", "")))
    ]
    compose_count = len(pinned)
    pinned += _k8s_images(yaml_module)
    assert compose_count >= 4 and len(pinned) >= compose_count + 5, pinned
    wrong = [f"{where}: {image}" for where, image in pinned if image != expected]
    assert wrong == [], f"expected {expected}:\n" + "\n".join(wrong)
    # What the compose build writes into the image's version label.
    builds = {
        name: service["build"]
        for name, service in compose["services"].items()
        if isinstance(service.get("build"), dict)
    }
    assert builds
    for name, build in builds.items():
        assert str(build.get("args", {}).get("OUTBOXKIT_VERSION")) == package_version(), name


def test_no_document_names_another_versions_image() -> None:
    """``outboxkit:<x.y.z>`` in deploy/, docs/ or the README is this version."""
    version = package_version()
    pattern = re.compile(r"\boutboxkit:(\d+\.\d+\.\d+\S*)")
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    files += [p for p in sorted((REPO / "deploy").rglob("*")) if p.is_file()]
    stale = []
    for path in files:
        if any(part.startswith(".") for part in path.relative_to(REPO).parts):
            continue  # deploy/local/.state, deploy/docker/.build
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in pattern.finditer(line):
                if m.group(1).rstrip("`'\",.)") != version:
                    stale.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)}")
    assert stale == [], f"expected outboxkit:{version}:\n" + "\n".join(stale)


def test_build_script_reads_the_version_instead_of_naming_one() -> None:
    script = (REPO / "deploy/docker/build.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert package_version() not in code, "build.sh hard-codes the version"
    assert "localhost/outboxkit:$VERSION" in code
