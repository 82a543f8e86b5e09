"""``outboxkit demo`` end to end: a short run on the real services, and Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration


def demo_command(
    db_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path, *args: str
) -> list[str]:
    return [
        sys.executable,
        "-P",
        "-m",
        "outboxkit",
        "demo",
        "--db-url",
        db_url,
        "--kafka-bootstrap",
        kafka_bootstrap,
        "--redis-url",
        redis_url,
        # Its own topic: the demo creates it (and its .dlq); the fixture cannot see it.
        "--topic",
        f"okt_demo_{uuid.uuid4().hex[:10]}",
        "--state-dir",
        str(tmp_path / "state"),
        *args,
    ]


def counts(out: str) -> dict[str, int]:
    return {
        name: int(m.group(1))
        for name in ("written", "delivered", "consumed")
        if (m := re.search(rf"^  {name}\s+(\d+)", out, re.MULTILINE))
    }


def topics_cleanup(kafka_bootstrap: str, out: str) -> None:
    from confluent_kafka.admin import AdminClient

    m = re.search(r"topics (\S+), (\S+)", out)
    if m:
        AdminClient({"bootstrap.servers": kafka_bootstrap}).delete_topics(list(m.groups()))


def test_a_short_demo_delivers_and_consumes_everything_it_wrote(
    db_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    cmd = demo_command(
        db_url, kafka_bootstrap, redis_url, tmp_path, "--duration", "3", "--rate", "50"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        n = counts(out)
        # How many depends on the machine (one transaction per order, paced to at
        # most --rate): a busy one writes fewer. Every one written must arrive.
        assert n["written"] > 0, out
        assert n["written"] == n["delivered"] == n["consumed"], out
        assert "result    OK: delivered = consumed = written" in out
        assert re.search(r"relay-1 0, relay-2 0, consumer 0", out), out
        assert len(re.findall(r"http://127\.0\.0\.1:\d+/metrics", out)) >= 6  # start + summary
        assert re.search(r"written +\d+ +delivered +\d+ +consumed +\d+ +\| +per second", out)
        password = sa.make_url(db_url).password
        assert f":{password}@" not in out + proc.stderr
    finally:
        topics_cleanup(kafka_bootstrap, proc.stdout)


def test_ctrl_c_stops_writing_and_drains_cleanly(
    db_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    cmd = demo_command(
        db_url, kafka_bootstrap, redis_url, tmp_path, "--duration", "120", "--rate", "50"
    )
    out_path = tmp_path / "out.txt"
    with out_path.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "written" not in out_path.read_text() or "per second" not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
        code = proc.wait(timeout=90)
        out = out_path.read_text()
        assert code == 0, out
        assert "interrupted: stopped writing" in out
        assert "(interrupted)" in out
        n = counts(out)
        assert 0 < n["written"] < 120 * 50
        assert n["written"] == n["delivered"] == n["consumed"], out
        assert "relay-1 0, relay-2 0, consumer 0" in out
    finally:
        if proc.poll() is None:
            proc.kill()
        topics_cleanup(kafka_bootstrap, out_path.read_text())


def test_console_log_format_gives_the_children_readable_logs(
    db_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    cmd = demo_command(
        db_url, kafka_bootstrap, redis_url, tmp_path,
        "--duration", "1", "--rate", "20", "--relays", "1", "--log-format", "console",
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "(readable lines; the exit record is the last line)" in proc.stdout
        logs = sorted((tmp_path / "state").rglob("*.log"))
        assert {p.name for p in logs} >= {"relay-1.log", "consumer.log"}
        line = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [A-Z]+ +[a-z-]+( .*)?")
        for log in logs:
            text = log.read_text()
            heads = [x for x in text.splitlines() if not x.startswith(" ")]  # not tracebacks
            assert heads and all(line.fullmatch(x) for x in heads), text
            assert "state-changed" in text
    finally:
        topics_cleanup(kafka_bootstrap, proc.stdout)


def run_the_docs_afterwards_block(db_server_url: str, env: dict[str, str]) -> None:
    """docs/demo.md's last ```sh block (status, purge), line by line as written,
    with the test's server in place of the local stack's address."""
    text = (REPO / "docs" / "demo.md").read_text()
    block = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)[-1]
    local = "mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3306/"
    assert local in block, block
    server = sa.make_url(db_server_url).set(database="").render_as_string(hide_password=False)
    script = block.replace(local, server.rstrip("/") + "/")
    if not (REPO / ".venv" / "bin" / "activate").is_file():  # a run outside the clone's .venv
        script = script.replace(". .venv/bin/activate", f". {Path(sys.executable).parent}/activate")
    assert "admin purge --older-than 1m" in script and "--db-url" not in script
    ran = subprocess.run(
        ["bash", "-e", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
        env=env,
    )  # fmt: skip
    assert ran.returncode == 0, f"{script}\n{ran.stdout}{ran.stderr}"
    assert "outbox_events" in ran.stdout and "delivered rows from outbox_events" in ran.stdout, (
        ran.stdout
    )


def test_the_inspect_line_of_the_local_stack_runs_as_printed(
    kafka_bootstrap: str, redis_url: str, db_server_url: str, tmp_path: Path
) -> None:
    """``demo.sh`` with the local stack's own database (no --db-url): the summary's
    ``inspect`` line is pasted as printed into a shell whose PATH has no ``.venv``,
    as a newcomer's has after demo.sh, and works. On main it printed ``***`` for
    the password and a bare ``outboxkit`` that such a shell does not find."""
    cmd = demo_command("", kafka_bootstrap, redis_url, tmp_path, "--duration", "1",
                       "--rate", "20", "--relays", "1")  # fmt: skip
    cmd[cmd.index("--db-url") : cmd.index("--db-url") + 2] = []  # up.sh's database
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("  inspect ")]
        pasted = line.removeprefix("  inspect").strip()
        assert "***" not in pasted, line
        assert "plain `outboxkit` once the virtual environment is active: . " in proc.stdout
        shown = subprocess.run(
            ["bash", "-c", pasted], capture_output=True, text=True, timeout=120,
            cwd=tmp_path, env=env,
        )  # fmt: skip
        assert shown.returncode == 0, f"{pasted}\n{shown.stdout}{shown.stderr}"
        assert "outbox_events" in shown.stdout, shown.stdout
        run_the_docs_afterwards_block(db_server_url, env)
    finally:
        topics_cleanup(kafka_bootstrap, proc.stdout)


REPO = Path(__file__).resolve().parents[2]
DEBIAN_PYTHON = Path("/usr/bin/python3")


def _fresh_checkout(dest: Path) -> Path:
    """This working tree's files as a new clone has them: what git tracks (plus new,
    not ignored files), without .venv/, .state/, .kafka/ or anything installed."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        src = REPO / os.fsdecode(raw)
        if src.is_file():  # a tracked file deleted in the working tree is left out
            target = dest / os.fsdecode(raw)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
            target.chmod(src.stat().st_mode)
    return dest


def _debian_python_env() -> dict[str, str]:
    """A newcomer's shell: Debian's python3 first on PATH, no virtual environment."""
    gone = ("VIRTUAL_ENV", "PYTHON", "PYTHONPATH", "PYTHONHOME", "VERBOSE", "PYENV_VERSION")
    env = {k: v for k, v in os.environ.items() if k not in gone and not k.startswith("OUTBOXKIT_")}
    env["PATH"] = "/usr/bin:/bin:/usr/sbin:/sbin:" + os.environ.get("PATH", "")
    return env


def test_demo_sh_runs_from_a_fresh_clone_with_debians_own_python(
    db_url: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """The README's first command, as a newcomer on Debian runs it. Debian's
    python3 is externally managed (PEP 668): on main, demo.sh ran ``python3 -m pip
    install -e .`` into it, which stopped with ``error: externally-managed-
    environment`` (exit 1). Now it makes the project's virtual environment
    (.venv/), says so, installs there and runs the demo; the next start skips the
    install."""
    if not DEBIAN_PYTHON.exists():
        pytest.skip("no /usr/bin/python3 on this machine")
    clone = _fresh_checkout(tmp_path / "clone")
    script = str(clone / "deploy" / "local" / "demo.sh")
    env = _debian_python_env()
    venv = clone / ".venv"
    found = subprocess.run(
        ["bash", "-c", "command -v python3"], env=env, capture_output=True, text=True, check=False
    )
    assert found.stdout.strip() == str(DEBIAN_PYTHON)  # the system's, no environment active
    cmd = demo_command(
        db_url, kafka_bootstrap, redis_url, tmp_path,
        "--duration", "1", "--rate", "20", "--relays", "1",
    )[5:]  # fmt: skip
    first = subprocess.run(
        [script, *cmd], capture_output=True, text=True, timeout=900, cwd=clone, env=env
    )
    try:
        assert first.returncode == 0, first.stdout + first.stderr[-5000:]
        assert (
            f"[demo] python: {venv}/bin/python (created; the project's virtual environment; "
            "in a shell: . .venv/bin/activate)" in first.stderr
        ), first.stderr
        assert f"[demo] installing outboxkit . into {venv}" in first.stderr
        assert "externally-managed-environment" not in first.stderr
        n = counts(first.stdout)
        assert n["written"] >= 10 and n["written"] == n["delivered"] == n["consumed"], first.stdout
        assert "relay-1 0, consumer 0" in first.stdout
    finally:
        topics_cleanup(kafka_bootstrap, first.stdout)

    again = subprocess.run(
        [script, "--help"], capture_output=True, text=True, timeout=300, cwd=clone, env=env
    )
    assert again.returncode == 0, again.stderr
    assert f"[demo] outboxkit . already installed in {venv} (pyproject.toml unchanged)" in (
        again.stderr
    )
    assert "installing" not in again.stderr
    # When pyproject.toml changes the install runs again:
    # tests/deploy/test_local_scripts.py::test_the_install_is_skipped_only_while_nothing_changed
