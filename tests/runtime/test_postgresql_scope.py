"""Which databases each command takes, said at start: exit 2, naming the setting.

Schema apply and the writer run on MySQL/MariaDB, PostgreSQL and SQLite; the
relay, the consumer inbox and ``outboxkit admin`` on MySQL/MariaDB and
PostgreSQL (docs/postgresql.md; their tests run on both databases). Given a
SQLite URL those three must refuse before doing anything (no health server, no
connection), with a message that names ``--db-url / OUTBOXKIT_DB_URL`` and the
databases they take. A PostgreSQL URL gets as far as connecting, and no message
ever prints the password.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.procs import run_captured

pytestmark = pytest.mark.unit

SECRET = "pg-secret-never-shown"
PG_URL = f"postgresql+psycopg://outboxkit:{SECRET}@127.0.0.1:1/outboxkit"


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pgscope_consumer.py").write_text(
        textwrap.dedent(
            """
            from outboxkit.consumer import Consumer

            class Noop(Consumer):
                topics = ("t",)
                group_id = "g"

                def handle(self, message):
                    pass
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = str(tmp_path)
    return run_captured([sys.executable, "-m", "outboxkit", *args], env=env, cwd=tmp_path)


SERVER_COMMANDS = pytest.mark.parametrize(
    "args",
    [
        ["relay", "--kafka-bootstrap", "127.0.0.1:1", "--health-port", "0"],
        ["consume", "pgscope_consumer:Noop", "--kafka-bootstrap", "127.0.0.1:1", "--inbox"],
        ["admin", "status"],
        ["admin", "purge", "--older-than", "7d"],
    ],
    ids=["relay", "consume", "admin-status", "admin-purge"],
)


@SERVER_COMMANDS
def test_a_sqlite_url_is_refused_at_start_with_exit_2(args: list[str], tmp_path: Path) -> None:
    out = _cli([*args, "--db-url", f"sqlite:///{tmp_path}/o.db"], tmp_path)
    assert out.returncode == 2, out.stderr
    err = out.stderr
    assert "--db-url / OUTBOXKIT_DB_URL" in err, err
    assert "MySQL/MariaDB or PostgreSQL, not sqlite" in err, err
    assert "Traceback" not in err
    assert "health-server-started" not in err  # refused before starting anything
    assert not (tmp_path / "o.db").exists()  # nothing connected


@SERVER_COMMANDS
def test_a_postgresql_url_is_taken(args: list[str], tmp_path: Path) -> None:
    """Not refused: the command gets as far as connecting (port 1 answers nothing)."""
    out = _cli([*args, "--db-url", PG_URL], tmp_path)
    assert out.returncode != 2, out.stderr
    assert "MySQL/MariaDB only" not in out.stderr
    assert SECRET not in out.stderr + out.stdout


def test_schema_apply_still_takes_a_postgresql_url(tmp_path: Path) -> None:
    """Not refused: it gets as far as connecting (exit 3, port 1 answers nothing)."""
    out = _cli(["schema", "apply", "--db-url", PG_URL], tmp_path)
    assert out.returncode == 3, out.stderr
    assert "cannot reach" in out.stderr and SECRET not in out.stderr


def test_schema_apply_without_the_extra_says_which_extra(tmp_path: Path) -> None:
    """No psycopg: exit 2 naming the setting and the extra to install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    probe = (
        "import sys\n"
        "sys.modules['psycopg'] = None  # as if outboxkit[postgres] were not installed\n"
        "from outboxkit.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = run_captured(
        [sys.executable, "-c", probe, "schema", "apply", "--db-url", PG_URL], env=env, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    assert "--db-url / OUTBOXKIT_DB_URL" in out.stderr
    # A command that works today: outboxkit is not on the package index.
    assert "'postgres' extra" in out.stderr and "pip install '.[postgres]'" in out.stderr, (
        out.stderr
    )
    assert "pip install 'outboxkit" not in out.stderr, out.stderr
    assert SECRET not in out.stderr
