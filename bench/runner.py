"""Run scenarios in one context and collect one report."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from bench import goals
from bench.config import BenchConfig
from bench.context import BenchContext, Services, machine
from bench.dblog import purge_old_logs
from bench.report import ScenarioResult, print_scenario, write_json
from bench.scenarios import Results, Unavailable, all_scenarios

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run(
    config: BenchConfig,
    services: Services,
    *,
    scenarios: list[str] | None = None,
    results_dir: Path = RESULTS_DIR,
    smoke: bool = False,
    keep: bool = False,
    quiet: bool = False,
    profile: bool = False,
) -> dict[str, Any]:
    """Run the chosen scenarios (all by default); return the report also written as JSON.

    A scenario that fails is recorded with its error and the run goes on: one
    broken scenario should not cost the figures of the others.
    """
    chosen = [s for s in all_scenarios() if scenarios is None or s.name in scenarios]
    unknown = set(scenarios or ()) - {s.name for s in all_scenarios()}
    if unknown:
        raise ValueError(f"unknown scenarios: {', '.join(sorted(unknown))}")
    started = time.time()
    results: Results = {}
    with BenchContext(config, services, keep=keep, results_dir=results_dir, profile=profile) as ctx:
        path = results_dir / f"{ctx.run_id}.json"
        report: dict[str, Any] = {
            "run_id": ctx.run_id,
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
            "smoke": smoke,
            "machine": machine(),
            "versions": ctx.versions(),
            "config": config.as_dict(),
            "scenarios": {},
            "goals": [],
            "duration_s": 0.0,
        }
        for scenario in chosen:
            purge_old_logs(ctx.engine)
            t0 = time.perf_counter()
            try:
                result = scenario.run(ctx, results)
            except Unavailable as exc:
                result = ScenarioResult(scenario.name, scenario.title, skipped=str(exc))
            except Exception as exc:
                if not quiet:
                    traceback.print_exc()
                result = ScenarioResult(
                    scenario.name, scenario.title, error=f"{type(exc).__name__}: {exc}"
                )
            result.seconds = time.perf_counter() - t0
            results[scenario.name] = result
            if not quiet:
                print_scenario(result)
            report["scenarios"][scenario.name] = result.as_dict()
            report["goals"] = goals.evaluate(results)
            report["duration_s"] = time.time() - started
            report["shared"] = _jsonable(ctx.cache)
            write_json(path, report)
        write_json(results_dir / "latest.json", report)
    report["path"] = str(path)
    return report


def _jsonable(cache: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cache.items() if isinstance(v, int | float | str | list | dict)}
