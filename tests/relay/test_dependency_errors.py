"""A database login the driver cannot complete is a dependency error: exit 3, with
the exit record, not a traceback and exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from relay_support import REPO
from support import broken_login

from outboxkit.runtime import EXIT_DEPENDENCY


@pytest.mark.integration
def test_a_mysql8_login_failure_at_start_exits_3_with_the_exit_record(
    db_url: str, outbox: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    site = broken_login.sitecustomize_dir(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    env.update(
        {
            "OUTBOXKIT_DB_URL": db_url,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_CONNECT_TIMEOUT": "5",
        }
    )
    result = subprocess.run(
        [sys.executable, "-P", "-m", "outboxkit", "relay"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert result.returncode == EXIT_DEPENDENCY, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    [failed] = [x for x in lines if x.get("event") == "start-failed"]
    assert failed["kind"] == "dependency" and "cryptography" in failed["error"]
    [record] = [x for x in lines if x.get("event") == "relay-exit"]
    assert record["exit_code"] == EXIT_DEPENDENCY
