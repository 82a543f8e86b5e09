"""Start-up time: the CPU a fresh interpreter spends to import outboxkit.

Services import ``outboxkit`` in every web worker to call ``enqueue``, and every
CLI call, probe and test subprocess pays the start of ``outboxkit``. Each command
below runs in a fresh subprocess, in turns (one of each per round, so the
machine's noise falls on all of them alike), and the table shows the median CPU
time (user + system, from the kernel's accounting of the child) of the rounds:

* a bare interpreter (``python -c pass``), the floor every command pays;
* ``import sqlalchemy``, the one import the writer cannot do without;
* ``import outboxkit``, what a service pays to call ``enqueue``;
* ``outboxkit --version``, the console script;
* ``import outboxkit.relay``.

The goals are ratios taken in one run, each beyond the bare interpreter:
``(X - bare) / (sqlalchemy - bare)``. No service is used; the commands run in
an empty folder so the repository's own folders cannot shadow the install.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.context import BenchContext
from bench.report import ScenarioResult
from bench.scenarios import Results

TITLE = "CPU to start: import outboxkit, outboxkit --version, vs import sqlalchemy"


def commands() -> dict[str, list[str]]:
    """What is measured, by figure name: each a fresh process."""
    python = sys.executable
    script = Path(python).with_name("outboxkit")  # the console script, as users run it
    cli = [str(script)] if script.exists() else [python, "-m", "outboxkit"]
    return {
        "bare": [python, "-c", "pass"],
        "sqlalchemy": [python, "-c", "import sqlalchemy"],
        "outboxkit": [python, "-c", "import outboxkit"],
        "version": [*cli, "--version"],
        "relay": [python, "-c", "import outboxkit.relay"],
    }


LABELS = {
    "bare": "bare interpreter (python -c pass)",
    "sqlalchemy": "import sqlalchemy",
    "outboxkit": "import outboxkit",
    "version": "outboxkit --version",
    "relay": "import outboxkit.relay",
}


def cpu_seconds(args: list[str], *, cwd: str, env: dict[str, str]) -> float:
    """User + system CPU of one run of ``args`` to its end (exit 0 required)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(args, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(runs: int) -> dict[str, list[float]]:
    """CPU seconds of each command, ``runs`` rounds of one run each."""
    cmds = commands()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    samples: dict[str, list[float]] = {name: [] for name in cmds}
    with tempfile.TemporaryDirectory(prefix="outboxkit-startup-") as cwd:
        for args in cmds.values():  # a first round unmeasured: warm file caches
            cpu_seconds(args, cwd=cwd, env=env)
        for _ in range(runs):
            for name, args in cmds.items():
                samples[name].append(cpu_seconds(args, cwd=cwd, env=env))
    return samples


def ratio(x: float, base: float, bare: float) -> float:
    """``(x - bare) / (base - bare)``: the cost of ``x`` beyond the interpreter, in
    units of ``base``'s."""
    return (x - bare) / (base - bare)


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    runs = ctx.config.startup_runs
    res = ScenarioResult("startup", TITLE)
    samples = measure(runs)
    median = {name: statistics.median(values) for name, values in samples.items()}
    bare, base = median["bare"], median["sqlalchemy"]
    for name, value in median.items():
        res.rows.append(
            {
                "command": LABELS[name],
                "CPU ms (median)": value * 1000,
                "min ms": min(samples[name]) * 1000,
                "max ms": max(samples[name]) * 1000,
                "x sqlalchemy beyond bare": None
                if name in ("bare", "sqlalchemy")
                else ratio(value, base, bare),
            }
        )
        res.figures[f"{name}_cpu_ms"] = value * 1000
    for name in ("outboxkit", "version", "relay"):
        res.figures[f"{name}_ratio"] = ratio(median[name], base, bare)
    res.settings = {"runs": runs, "python": sys.version.split()[0]}
    res.notes.append(
        f"median of {runs} fresh processes each, in turns; CPU is user + system of the child"
    )
    return res


def main() -> None:
    """``python -m bench.scenarios.startup [RUNS]``: the table without a benchmark
    run (no database, no Kafka)."""
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    samples = measure(runs)
    median = {name: statistics.median(values) for name, values in samples.items()}
    for name, value in median.items():
        extra = ""
        if name not in ("bare", "sqlalchemy"):
            extra = f"  {ratio(value, median['sqlalchemy'], median['bare']):.2f}x sqlalchemy"
        print(f"{LABELS[name]:40} {value * 1000:7.1f} ms CPU (median of {runs}){extra}")


if __name__ == "__main__":
    main()
