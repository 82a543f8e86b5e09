"""The benchmark at tiny sizes, so it cannot rot: every scenario runs end to end
and writes a JSON report with the fields the docs and later runs rely on.

Figures at these sizes mean nothing and are never compared to a bound here;
speed is shown by the real run (docs/performance.md), not by a timed test.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from bench.config import BenchConfig
from bench.context import Services
from bench.runner import run
from bench.scenarios import names

pytestmark = pytest.mark.integration

#: Modules a scenario measures; it may only be skipped while one is missing.
NEEDS = {
    "db-ceiling": ("outboxkit.relay.claim", "outboxkit.relay.finalize"),
    "relay-throughput": ("outboxkit.relay.relay",),
    "backlog-scaling": ("outboxkit.relay.relay",),
    "latency": ("outboxkit.relay.relay",),
    "drain": ("outboxkit.relay.relay",),
    "consumer": ("outboxkit.consumer",),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def test_smoke_run_writes_a_complete_report(
    db_server_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    services = Services(db_url=db_server_url, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url)
    report = run(BenchConfig.smoke(), services, results_dir=tmp_path, smoke=True, quiet=True)

    saved = json.loads(Path(report["path"]).read_text())
    assert json.loads((tmp_path / "latest.json").read_text())["run_id"] == saved["run_id"]
    assert saved["machine"]["cpu_count"] >= 1
    for field in ("python", "confluent_kafka", "librdkafka", "database", "kafka"):
        assert saved["versions"][field], field
    assert saved["config"]["rows"] == BenchConfig.smoke().rows

    assert list(saved["scenarios"]) == names()
    for name, result in saved["scenarios"].items():
        assert result["error"] is None, f"{name}: {result['error']}"
        if result["skipped"] is not None:
            # Only while the code it measures does not exist; never to hide a break.
            assert not all(map(_importable, NEEDS.get(name, ()))), result["skipped"]
            continue
        assert result["rows"], name
        assert result["figures"], name
        for figure, value in result["figures"].items():
            assert math.isfinite(value) and value > 0, f"{name}.{figure} = {value}"

    assert {g["goal"] for g in saved["goals"]} >= {"consumer base class vs raw poll loop"}
    for goal in saved["goals"]:
        assert set(goal) == {"goal", "target", "measured", "met"}
