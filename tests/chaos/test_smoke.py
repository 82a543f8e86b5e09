"""The chaos suite at smoke size, so it cannot rot: ``./chaos/run.sh --smoke``
runs a writer, three relays and two inbox consumers on its own named MariaDB,
Kafka and Redis under a few faults of every kind, and every end-of-run check
must pass (docs/reliability.md). The same on PostgreSQL, with the relays
sharing shards by advisory locks and woken by NOTIFY (no Redis for them), and
Kafka a three-node cluster (``--kafka-brokers 3``: replication factor 3,
``min.insync.replicas`` 2) under the cluster's faults too: leader kill, follower
freeze, controller kill, coordinator kill, rolling restart.

The seed is fixed so the suite is deterministic; ``CHAOS_SEED`` replays another.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.fault]

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("CHAOS_SEED", "11"))
CHECKS = {
    "writer committed every event",
    "nothing lost",
    "per-key order",
    "duplicates accounted for",
    "nothing stuck",
    "drains clean",
    "no overlapping shard owners",
    "neighbour outbox delivered",
}


#: (database, shard ownership, Kafka brokers, fault kinds): MariaDB with Redis
#: leases and one broker, every kind; PostgreSQL with advisory locks, whose relays
#: use no Redis (its 2 faults left out), on the cluster (its 5 kinds added, the
#: total outages left to the first run).
RUNS = {
    "mariadb-redis": ("mariadb", "redis", 1, 16),
    "postgresql-advisory-cluster": ("postgresql", "advisory", 3, 17),
}
CLUSTER_KINDS = {
    "kafka-leader-kill",
    "kafka-follower-freeze",
    "kafka-controller-kill",
    "kafka-coordinator-kill",
    "kafka-rolling-restart",
}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("run", list(RUNS))
def test_smoke_run_passes_every_check(run: str) -> None:
    database, ownership, brokers, kinds = RUNS[run]
    built = list((REPO / "chaos" / ".bin").glob("toxiproxy-server-*"))
    if not built and not (shutil.which("go") or Path("/usr/local/go/bin/go").exists()):
        reason = "Go is needed to build Toxiproxy for the chaos suite"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [
            str(REPO / "chaos" / "run.sh"),
            "--smoke",
            "--seed",
            str(SEED),
            "--database",
            database,
            "--ownership",
            ownership,
            "--kafka-brokers",
            str(brokers),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1150,
        check=False,
    )
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    assert f"CHAOS RESULT: {'PASS' if proc.returncode == 0 else 'FAIL'} seed={SEED}" in out
    # this run's own summary (results/latest.json may be another run's)
    path = re.search(r"^summary: (.+)$", out, re.MULTILINE)
    assert path, out[-4000:]
    summary = json.loads(Path(path.group(1)).read_text())
    assert summary["seed"] == SEED and summary["size"] == "smoke"
    assert summary["config"]["database"] == database
    assert summary["config"]["ownership"] == ownership
    assert summary["config"]["kafka_brokers"] == brokers
    if database == "mariadb":
        # As production runs it: the faults and checks ran on a binary-log server.
        assert summary["database_log"] == {
            "log": "binlog",
            "log_bin": "ON",
            "binlog_format": "ROW",
            "binlog_row_image": "FULL",
        }
    failed = {k: v["summary"] for k, v in summary["checks"].items() if not v["ok"]}
    assert proc.returncode == 0, f"checks failed: {failed}\n{out[-4000:]}"
    assert set(summary["checks"]) == CHECKS
    assert summary["events"] == 20_000
    assert len(summary["config"]["faults"]) == kinds
    assert (set(summary["config"]["faults"]) >= CLUSTER_KINDS) == (brokers == 3)
    assert set(summary["faults"]) == set(summary["config"]["faults"]), "every fault kind ran"
    assert not summary["fault_errors"], summary["fault_errors"]
    assert summary["checks"]["nothing lost"]["lost_kafka"] == 0
    assert summary["checks"]["nothing lost"]["lost_effect"] == 0
    assert summary["checks"]["drains clean"]["relay_drains"] >= 2
    assert summary["checks"]["drains clean"]["consumer_drains"] >= 2
    # A consumer drained at the revocation a joining replacement caused (a rolling
    # deploy with surge): its exit commit ran while the group rebalanced, and the
    # drain check above says it still ended clean.
    assert re.search(r"consumer-rebalance-drain .*\"at_revocation\": true", out), out[-4000:]
