"""Running a command to its end as a test does: output captured as text."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_captured(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` to the end with stdout and stderr captured as text; the exit
    code is the caller's to check (no exception for a non-zero one)."""
    return subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
