"""Optional sampling profiles of the processes under test (``--profile``), with py-spy.

py-spy attaches to a running process from outside, so the relay runs exactly
as it would without it (apart from the sampling itself, a few percent).  The raw
output (collapsed stacks) is kept next to the run's logs; :func:`summary`
turns it into the table of hottest functions that docs/performance.md quotes.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

_LINE = re.compile(r":\d+\)")


def executable() -> str | None:
    """py-spy on PATH, else beside this interpreter (``pip install py-spy`` into
    the virtualenv that runs the benchmark, not activated), else None."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else None


def available() -> bool:
    return executable() is not None


def attach(pid: int, out: Path, *, rate: int = 100) -> subprocess.Popen[bytes] | None:
    """Sample ``pid`` until it exits; collapsed stacks go to ``out``.

    Idle samples are kept: a loop waiting on the database or on Kafka is where
    the wall time goes, and that is what the summary should show.
    """
    spy = executable()
    if spy is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
            "--threads",
            "--gil",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def summary(path: Path, *, top: int = 16, within: str | None = None) -> list[dict[str, object]]:
    """Hottest functions: share of the samples (under frames matching ``within``)
    that were in the function (inclusive) or in its own code (self)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [_LINE.sub(")", f) for f in stack.split(";")[1:]]
        if within and not any(within in f for f in frames):
            continue
        n = int(count)
        total += n
        for f in set(frames):
            inclusive[f] += n
        if frames:
            own[frames[-1]] += n
    if not total:
        return []
    # Frames in (nearly) every sample are the entry point's wrappers: no information.
    hot = [(f, n) for f, n in inclusive.most_common() if n < 0.99 * total]
    return [
        {"function": f, "inclusive %": 100 * n / total, "self %": 100 * own[f] / total}
        for f, n in hot[:top]
    ]
