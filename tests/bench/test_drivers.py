"""The ``relay-drivers`` scenario at tiny sizes: one relay drains the backlog
through PyMySQL and through mysqlclient, and the report has each driver's rows,
its CPU per event and the ratio the docs quote. (The smoke run covers it too,
among every scenario; this runs it alone.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.config import BenchConfig
from bench.context import Services
from bench.runner import run

pytestmark = pytest.mark.integration


def test_each_driver_drains_the_backlog_and_the_ratio_is_reported(
    db_server_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    services = Services(db_url=db_server_url, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url)
    report = run(
        BenchConfig.smoke(rows=2_000),
        services,
        scenarios=["relay-drivers"],
        results_dir=tmp_path,
        smoke=True,
        quiet=True,
    )
    result = json.loads(Path(report["path"]).read_text())["scenarios"]["relay-drivers"]
    assert result["error"] is None and result["skipped"] is None, result
    assert sorted({(r["driver"], r["round"]) for r in result["rows"]}) == [
        ("mysqldb", 1),
        ("mysqldb", 2),
        ("pymysql", 1),
        ("pymysql", 2),
    ]
    assert all(r["events/s"] > 0 for r in result["rows"])
    for figure in ("rate_pymysql", "rate_mysqldb"):
        assert result["figures"][figure] > 0, figure
