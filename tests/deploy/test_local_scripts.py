"""deploy/local scripts are quiet: one short line per service or step, the rest on request.

``eval "$(deploy/local/up.sh)"`` must keep working: stdout holds the export
lines only, whatever the verbosity.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.services import free_port, free_ports
from support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "deploy" / "local"


def _run(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "VERBOSE"}
    full.update(env or {})
    return subprocess.run(
        args, capture_output=True, text=True, env=full, timeout=timeout, check=False, cwd=REPO
    )


@pytest.mark.integration
@pytest.mark.parametrize("verbose", [False, True])
def test_up_prints_the_exports_on_stdout_and_one_line_per_service(verbose: bool) -> None:
    env = {"VERBOSE": "1"} if verbose else {}
    out = _run(
        ["bash", "-c", 'eval "$(deploy/local/up.sh)"; echo "db=$OUTBOXKIT_TEST_DB_URL"'], env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("db=mysql+pymysql://"), out.stdout
    direct = _run([str(LOCAL / "up.sh"), *(["--verbose"] if verbose else [])])
    assert direct.returncode == 0, direct.stderr
    assert [line.split("=")[0] for line in direct.stdout.splitlines()] == [
        "export OUTBOXKIT_TEST_DB_URL",
        "export OUTBOXKIT_TEST_PG_URL",
        "export OUTBOXKIT_TEST_KAFKA_BOOTSTRAP",
        "export OUTBOXKIT_TEST_REDIS_URL",
        "export OUTBOXKIT_TEST_PUSHGATEWAY_URL",
    ]
    if not verbose:  # services already run: one line each and the total
        lines = direct.stderr.splitlines()
        assert len(lines) == 6, direct.stderr
        for service in ("mariadb", "postgres", "redis", "pushgateway", "kafka"):
            [line] = [x for x in lines if x.startswith(f"[{service}] ")]
            assert " ready on 127.0.0.1:" in line and len(line) < 100, line
        assert lines[-1].startswith("[up] all services up in ")


@pytest.mark.integration
def test_up_waits_while_another_up_runs_on_this_machine(tmp_path: Path) -> None:
    """The default services listen on fixed ports that every checkout shares: two
    ``up.sh`` at once with nothing running both started each service, and one
    failed on a port the other had just bound (reproduced by hand from two
    clones: "Can't start server: Bind on TCP/IP port", exit 1). Now an ``up.sh``
    waits while another holds the machine's lock, says so, then goes on."""
    lock_path = tmp_path / "up.lock"
    env = {k: v for k, v in os.environ.items() if k not in ("VERBOSE", "OUTBOXKIT_LOCAL_UP_LOCKED")}
    env |= {"OUTBOXKIT_LOCAL_UP_LOCK": str(lock_path), "OUTBOXKIT_LOCAL_UP_QUIET_WAIT": "0"}
    with lock_path.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another up.sh, mid-run
        up = subprocess.Popen(
            [str(LOCAL / "up.sh")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(up.stderr or ()), daemon=True)
        reader.start()
        try:
            wait_for(
                lambda: any("waiting for another up.sh on this machine" in x for x in lines),
                timeout=30,
                what="up.sh saying it waits",
            )
            assert up.poll() is None, "".join(lines)  # still waiting, started nothing
            assert [x for x in lines if "ready on" in x] == [], lines
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        with up:  # closes both pipes
            stdout = up.stdout.read() if up.stdout else ""  # stderr is the reader's
            up.wait(timeout=300)
            reader.join(10)
    assert up.returncode == 0, "".join(lines)
    assert stdout.startswith("export OUTBOXKIT_TEST_DB_URL="), stdout
    assert sum("ready on 127.0.0.1:" in x for x in lines) == 5, lines


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory every user can enter: as root, PostgreSQL runs as ``postgres``.

    (pytest's ``tmp_path`` lives under a directory only its owner may enter.)
    """
    path = Path(tempfile.mkdtemp(prefix="outboxkit-state-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("service", "daemon"), [("redis", "redis-server"), ("postgres", "postgres")]
)
def test_a_service_start_and_stop_print_one_line_unless_verbose(
    state_dir: Path, service: str, daemon: str
) -> None:
    port = free_port()
    name = f"quiet{port}"
    env = {"OUTBOXKIT_LOCAL_STATE": str(state_dir)}
    script = str(LOCAL / f"{service}.sh")
    try:
        start = _run([script, "start", "--name", name, "--port", str(port)], env=env)
        assert start.returncode == 0, start.stderr
        assert start.stderr.splitlines() == [
            f"[{service}] {name} ready on 127.0.0.1:{port} (pid {_pid(state_dir, service, name)})"
        ]
        again = _run([script, "start", "--name", name], env=env)
        assert again.stderr.splitlines() == [
            f"[{service}] {name} ready on 127.0.0.1:{port} (already running)"
        ]
        stop = _run([script, "stop", "--name", name], env=env)
        assert stop.returncode == 0, stop.stderr
        assert stop.stderr.splitlines() == [f"[{service}] {name} stopped"]

        loud = _run([script, "start", "--name", name, "--port", str(port), "--verbose"], env=env)
        assert loud.returncode == 0, loud.stderr
        assert f"[{service}] {name}: starting {daemon} on 127.0.0.1:{port}" in loud.stderr
        loud_stop = _run([script, "stop", "--name", name], env={**env, "VERBOSE": "1"})
        assert "stopping pid" in loud_stop.stderr and f"{name} stopped" in loud_stop.stderr
    finally:
        _run([script, "stop", "--name", name], env=env)


def _pid(state: Path, service: str, name: str) -> str:
    return (state / f"{service}-{name}" / "pid").read_text().strip()


@pytest.mark.integration
def test_postgres_runs_unprivileged_on_loopback_and_survives_a_crash(state_dir: Path) -> None:
    """The server never runs as root, and a restart after SIGKILL finds its data intact."""
    port = free_port()
    name = f"crash{port}"
    env = {"OUTBOXKIT_LOCAL_STATE": str(state_dir)}
    script = str(LOCAL / "postgres.sh")
    try:
        assert _run([script, "start", "--name", name, "--port", str(port)], env=env).returncode == 0
        pid = _pid(state_dir, "postgres", name)
        assert Path(f"/proc/{pid}").stat().st_uid != 0
        # Autovacuum looks at a draining outbox every 10 s, not every minute
        # (docs/postgresql.md, server settings).
        assert _pg_query(state_dir, name, port, "SHOW autovacuum_naptime") == "10s"
        # The benchmark's user sees the server's own processes (bench/activity.py).
        seen = "SELECT pg_has_role('outboxkit', 'pg_read_all_stats', 'MEMBER')"
        assert _pg_query(state_dir, name, port, seen) == "t"
        assert _run([script, "kill", "--name", name], env=env).returncode == 0
        assert _run([script, "status", "--name", name], env=env).returncode == 3
        restart = _run([script, "start", "--name", name], env=env)
        assert restart.returncode == 0, restart.stderr
        assert _run([script, "status", "--name", name], env=env).returncode == 0
    finally:
        _run([script, "stop", "--name", name], env=env)


#: Brokers started at once on a checkout whose jars are not fetched yet.
_CONCURRENT_BROKERS = 3


@pytest.mark.integration
def test_brokers_started_at_once_on_a_fresh_checkout_fetch_the_jars_once(
    state_dir: Path,
) -> None:
    """Tests start dedicated brokers in parallel; on a checkout whose jars are
    not fetched yet (its services were started from another checkout), each
    start fetched them at once, emptying the folder under the others, and all
    but one failed ("mvn could not fetch the Kafka jars"). Now one fetches and
    the others wait for it: every start succeeds, the jars are fetched once."""
    checkout = state_dir / "local"
    shutil.copytree(LOCAL, checkout, ignore=shutil.ignore_patterns(".kafka", ".state"))
    script = str(checkout / "kafka.sh")
    names = [f"fetch{i}" for i in range(_CONCURRENT_BROKERS)]
    ports = free_ports(2 * _CONCURRENT_BROKERS)
    starts = [
        subprocess.Popen(
            [
                script,
                "start",
                "--name",
                name,
                "--port",
                str(ports[2 * i]),
                "--controller-port",
                str(ports[2 * i + 1]),
                "--heap",
                "256m",
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "VERBOSE"},
        )
        for i, name in enumerate(names)
    ]
    try:
        outcomes = [(start.wait(timeout=600), start.communicate()[1]) for start in starts]
        for name, port, (code, stderr) in zip(names, ports[::2], outcomes, strict=True):
            assert code == 0, stderr
            assert f"[kafka] {name} ready on 127.0.0.1:{port}" in stderr, stderr
        fetched = [line for _, err in outcomes for line in err.splitlines() if "fetching" in line]
        assert len(fetched) == 1, fetched
        assert (checkout / ".kafka" / "lib" / ".complete").exists()
    finally:
        for start in starts:
            if start.poll() is None:
                start.kill()
        for name in names:
            _run([script, "stop", "--name", name])


def _pg_query(state: Path, name: str, port: int, query: str) -> str:
    run_dir = state / f"postgres-{name}" / "run"
    psql = "/usr/lib/postgresql/15/bin/psql"
    out = _run(
        [
            psql,
            "-X",
            "-At",
            "-h",
            str(run_dir),
            "-p",
            str(port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-c",
            query,
        ]
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _fake_apt(tmp_path: Path, *, fail: bool) -> dict[str, str]:
    """An ``apt-get`` on PATH that prints what a fresh machine's install prints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    script.write_text(
        "#!/bin/sh\n"
        'for i in $(seq 1 300); do echo "Selecting previously unselected package p$i."; done\n'
        + ("echo 'E: Unable to locate package' >&2; exit 100\n" if fail else "exit 0\n")
    )
    script.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUTBOXKIT_LOCAL_STATE": str(tmp_path / "state"),
        "OUTBOXKIT_APT_UPDATED": "",
    }


def _ensure(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    probe = f"set -euo pipefail; source {LOCAL / 'lib.sh'}; ensure_packages outboxkit-no-such-pkg"
    return _run(["bash", "-c", probe], env=env)


@pytest.mark.unit
def test_package_manager_output_goes_to_a_log_file_unless_verbose(tmp_path: Path) -> None:
    env = _fake_apt(tmp_path, fail=False)
    quiet = _ensure(env)
    assert quiet.returncode == 0, quiet.stderr
    log = tmp_path / "state" / "apt.log"
    assert quiet.stderr.splitlines() == [f"[local] installing outboxkit-no-such-pkg (log: {log})"]
    assert (
        log.read_text().count("Selecting previously unselected package") == 600
    )  # update + install

    loud = _ensure({**env, "VERBOSE": "1"})
    assert loud.returncode == 0
    assert loud.stderr.count("Selecting previously unselected package") == 600


@pytest.mark.unit
def test_a_failed_install_shows_the_end_of_its_log(tmp_path: Path) -> None:
    out = _ensure(_fake_apt(tmp_path, fail=True))
    assert out.returncode != 0
    assert "E: Unable to locate package" in out.stderr
    assert "ERROR: apt-get install outboxkit-no-such-pkg failed" in out.stderr
    assert out.stderr.count("Selecting previously unselected package") <= 30  # a tail, not all


def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """A ``python`` that records its ``-m pip`` calls, says its environment is
    ``tmp_path/env`` and that the package imports from the checkout."""
    prefix, calls = tmp_path / "env", tmp_path / "pip-calls"
    prefix.mkdir()
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n'
        f'  -m) echo "$*" >>{calls}; exit 0 ;;\n'
        "  -P) exit 0 ;;\n"  # the package imports from this checkout
        f"  -c) echo {prefix}; exit 0 ;;\n"  # sys.prefix
        "esac\n"
        "exit 1\n"
    )
    script.chmod(0o755)
    return script, calls


@pytest.mark.unit
def test_the_install_is_skipped_only_while_nothing_changed(tmp_path: Path) -> None:
    """demo.sh and test.sh ran ``pip install -e`` on every start (12.7 s of each
    demo). Now a stamp in the environment skips it while pyproject.toml, the
    checkout and the extras are those of the last install; ``.[dev]`` covers ``.``."""
    checkout = tmp_path / "checkout"
    (checkout / "deploy" / "local").mkdir(parents=True)
    shutil.copy(LOCAL / "lib.sh", checkout / "deploy" / "local" / "lib.sh")
    (checkout / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python, calls = _fake_python(tmp_path)

    def install(spec: str) -> list[str]:
        probe = (
            f"set -euo pipefail; source {checkout}/deploy/local/lib.sh; "
            f"PY={python}; install_package '{spec}'"
        )
        out = _run(["bash", "-c", probe], env={"OUTBOXKIT_LOCAL_STATE": str(tmp_path / "state")})
        assert out.returncode == 0, out.stderr
        return out.stderr.splitlines()

    env = tmp_path / "env"
    assert install(".") == [
        f"[local] installing outboxkit . into {env} (pip log: {tmp_path}/state/pip.log)"
    ]
    assert install(".") == [
        f"[local] outboxkit . already installed in {env} (pyproject.toml unchanged)"
    ]
    assert install(".[dev]")[0].startswith("[local] installing outboxkit .[dev] into")
    assert "already installed" in install(".")[0]  # the dev install includes the package
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("# changed\n")
    assert install(".")[0].startswith("[local] installing outboxkit . into")
    assert "already installed" in install(".")[0]
    assert calls.read_text().splitlines() == [
        "-m pip install -q --disable-pip-version-check -e .",
        "-m pip install -q --disable-pip-version-check -e .[dev]",
        "-m pip install -q --disable-pip-version-check -e .",
    ]
