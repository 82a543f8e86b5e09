"""The wheel and the sdist a user installs, built, checked and run here.

Built once per session with ``python -m build`` (the build tool's own isolated
environment, as a user or a release job runs it) from the files a fresh clone
would hold, uncommitted work included:

- the sdist and the wheel from the source tree; then a wheel from the sdist,
  which must be the same wheel (same files, same bytes): what an index user
  who builds from the sdist gets is what was tested;
- ``twine check --strict`` on both (what an index would refuse or render badly);
- the wheel holds the package and its metadata only: no tests, bench/, deploy/
  or local state (.state, .kafka, .venv);
- installed into a fresh virtual environment with the runtime extras (``async``,
  ``postgres``, ``otel``) from the package index (pip's cache keeps it fast),
  that environment's ``outboxkit`` applies the schema, its relay delivers an
  enqueued row from MariaDB and from PostgreSQL to Kafka and exits 0 on
  SIGTERM, and its ``outboxkit consume module:Class`` receives both messages.

One environment holds all three runtime extras rather than one environment
each: they add disjoint dependencies to the same base (no choice between them
to resolve), each environment would reinstall the same fifteen packages (about
half a minute each on the 2-core machine), and each extra's own imports are
checked one by one below. The ``examples`` and ``dev`` extras are tools for
this repository, not for users of the package, and are not installed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.services import free_port
from support.waiting import bound, wait_for

from outboxkit.schema import outbox_table

# The first test of a run pays the builds and the install in its setup: minutes
# on a loaded machine, beyond the suite's default per-test timeout.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_EXTRAS = ("async", "postgres", "otel", "mysqlclient")
# Extras for working on outboxkit itself, not for running it.
TOOL_EXTRAS = {"dev", "docs", "examples", "bench"}
# What each runtime extra exists for, imported from the installed environment.
EXTRA_IMPORTS = {
    "async": "import asyncmy, greenlet, sqlalchemy.ext.asyncio as a;"
    " a.create_async_engine('mysql+asyncmy://u:p@127.0.0.1:1/d')",
    "postgres": "import psycopg, sqlalchemy as sa;"
    " sa.create_engine('postgresql+psycopg://u:p@127.0.0.1:1/d')",
    "otel": "import opentelemetry.trace, opentelemetry.propagate",
    "mysqlclient": "import MySQLdb, sqlalchemy as sa;"
    " sa.create_engine('mysql+mysqldb://u:p@127.0.0.1:1/d')",
}
# Nothing of these may ship in the wheel.
NOT_IN_WHEEL = {"tests", "bench", "deploy", "docs", "examples", "chaos"}
NOT_IN_WHEEL |= {".state", ".kafka", ".venv", ".build"}


def project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)["project"]
    return data


@dataclass(frozen=True)
class Artifacts:
    sdist: Path
    wheel: Path  # built from the source tree
    wheel_from_sdist: Path


def _run(args: list[str], *, timeout: float, cwd: Path | None = None) -> str:
    done = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=bound(timeout), check=False
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def _as_a_clone_holds_it(dst: Path) -> Path:
    """The source tree as a fresh clone holds it, with uncommitted work: tracked
    and untracked files, not the ignored ones. setuptools builds through
    ``build/lib``, which keeps files an earlier build copied there; from the
    working tree, a module deleted since would come back in the wheel."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dst / name)
    return dst


@contextlib.contextmanager
def _once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, bool]]:
    """A folder shared by the run's xdist workers (their temporary folders'
    parent), and whether it still has to be made: the first worker to ask makes
    it while the others wait on the lock, then they all use it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / ".done"
        yield folder, not done.exists()
        folder.mkdir(exist_ok=True)
        done.touch()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    """``python -m build`` once per run: sdist and wheel from the tree, then a
    wheel from that sdist."""
    with _once(tmp_path_factory, "packaging-dist") as (out, needed):
        if needed:
            _build(out)
    return Artifacts(
        sdist=_one(out / "tree", "outboxkit-*.tar.gz"),
        wheel=_one(out / "tree", "outboxkit-*.whl"),
        wheel_from_sdist=_one(out / "from-sdist", "outboxkit-*.whl"),
    )


def _one(folder: Path, pattern: str) -> Path:
    [found] = folder.glob(pattern)
    return found


def _build(out: Path) -> None:
    tree = _as_a_clone_holds_it(out / "source")
    build = [sys.executable, "-m", "build", "--outdir"]
    _run([*build, str(out / "tree"), "--sdist", "--wheel", str(tree)], timeout=120)
    with tarfile.open(_one(out / "tree", "outboxkit-*.tar.gz")) as tar:
        tar.extractall(out / "unpacked", filter="data")
    [unpacked] = (out / "unpacked").iterdir()
    _run([*build, str(out / "from-sdist"), "--wheel", str(unpacked)], timeout=120)


def _contents(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()}


@pytest.mark.unit
def test_artifacts_are_named_for_the_version_and_pass_twine_check(artifacts: Artifacts) -> None:
    version = project()["version"]
    assert artifacts.sdist.name == f"outboxkit-{version}.tar.gz"
    assert artifacts.wheel.name == f"outboxkit-{version}-py3-none-any.whl"
    out = _run(
        [sys.executable, "-m", "twine", "check", "--strict", str(artifacts.sdist),
         str(artifacts.wheel)],
        timeout=60,
    )  # fmt: skip
    assert out.count("PASSED") == 2, out


@pytest.mark.unit
def test_the_wheel_holds_the_package_and_its_metadata_only(artifacts: Artifacts) -> None:
    version = project()["version"]
    names = list(_contents(artifacts.wheel))
    dist_info = f"outboxkit-{version}.dist-info/"
    strays = [n for n in names if not n.startswith(("outboxkit/", dist_info))]
    assert strays == [], strays
    for n in names:
        parts = n.split("/")
        assert not set(parts) & NOT_IN_WHEEL, n
        assert not parts[-1].startswith(("test_", "conftest")), n
        assert "__pycache__" not in parts and not n.endswith(".pyc"), n
    # Every subpackage of the mapped folders is there, with py.typed.
    for module in ("relay/claim.py", "relay/ownership/__init__.py", "consumer/base.py",
                   "schema/table.py", "runtime/settings.py", "cli.py", "py.typed"):  # fmt: skip
        assert f"outboxkit/{module}" in names, module


@pytest.mark.unit
def test_the_sdist_rebuilds_the_same_wheel(artifacts: Artifacts) -> None:
    with tarfile.open(artifacts.sdist) as tar:
        members = tar.getnames()
    local = [m for m in members if set(m.split("/")) & {".state", ".kafka", ".venv", ".build"}]
    assert local == [], local
    tree, again = _contents(artifacts.wheel), _contents(artifacts.wheel_from_sdist)
    assert sorted(again) == sorted(tree), set(tree) ^ set(again)
    differ = [n for n in tree if tree[n] != again[n]]
    assert differ == [], f"files whose bytes differ: {differ}"


# --- the wheel with its extras, run against the local services ---------------

CONSUMER_MODULE = '''\
"""A consumer as a user writes one: each message's payload, one line a message."""
import os

from outboxkit.consumer import Consumer, Message


class Recorder(Consumer):
    def handle(self, message: Message) -> None:
        with open(os.environ["RECORD_TO"], "a", encoding="utf-8") as f:
            f.write((message.value or b"").decode() + "\\n")
'''


@dataclass(frozen=True)
class Installed:
    venv: Path
    workdir: Path  # not the repository: its outboxkit/ folder would shadow the wheel

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return {**env, **extra}

    def run(self, *args: str, timeout: float = 60, **env: str) -> str:
        done = subprocess.run(
            list(args),
            cwd=self.workdir,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=bound(timeout),
            check=False,
        )
        assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
        return done.stdout


@pytest.fixture(scope="session")
def installed(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh virtual environment with the wheel and its runtime extras, their
    dependencies from the package index (pip's cache); once per run."""
    with _once(tmp_path_factory, "packaging-venv") as (root, needed):
        venv = root / "venv"
        if needed:
            _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
            wheel = f"{artifacts.wheel_from_sdist}[{','.join(RUNTIME_EXTRAS)}]"
            _run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", wheel],
                timeout=600,
            )  # fmt: skip
    return Installed(venv=venv, workdir=tmp_path_factory.mktemp("work"))


@pytest.mark.integration
def test_each_runtime_extra_installs_what_it_is_for(installed: Installed) -> None:
    # Every extra a user installs to run outboxkit is installed and probed here.
    assert set(RUNTIME_EXTRAS) == set(project()["optional-dependencies"]) - TOOL_EXTRAS
    # Every subpackage comes from the installed wheel's mapped folders.
    probe = (
        "import importlib, outboxkit, pathlib\n"
        "for m in ('outboxkit.relay', 'outboxkit.relay.ownership', 'outboxkit.consumer',"
        " 'outboxkit.schema', 'outboxkit.runtime', 'outboxkit.admin', 'outboxkit.cli'):\n"
        "    f = pathlib.Path(importlib.import_module(m).__file__)\n"
        f"    assert f.is_relative_to({str(installed.venv)!r}), f\n"
        "assert (pathlib.Path(outboxkit.__file__).parent / 'py.typed').exists()\n"
        "print(outboxkit.__version__)\n"
    )
    assert installed.run(installed.bin("python"), "-c", probe).strip() == project()["version"]
    assert "schema" in installed.run(installed.bin("outboxkit"), "--help")
    for extra, imports in EXTRA_IMPORTS.items():
        done = subprocess.run(
            [installed.bin("python"), "-c", imports],
            cwd=installed.workdir, capture_output=True, text=True, timeout=bound(60), check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"extra {extra}: {done.stderr[-2000:]}"
    # pip check: the extras' dependencies agree with each other.
    assert "No broken requirements" in installed.run(installed.bin("python"), "-m", "pip", "check")


class Service:
    """An ``outboxkit`` process from the installed environment, its stderr kept."""

    def __init__(self, installed: Installed, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [installed.bin("outboxkit"), *args],
            cwd=installed.workdir,
            env=installed.env(**env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            self.lines.extend(self.proc.stderr)

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in list(self.lines):
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == name:
                    found.append(record)
        return found

    def stop(self) -> int:
        """SIGTERM, as a container runtime stops it; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(bound(60))
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)

    def tail(self) -> str:
        return "".join(self.lines[-20:])


@pytest.fixture
def services() -> Iterator[Callable[..., Service]]:
    started: list[Service] = []

    def start(installed: Installed, args: list[str], **env: str) -> Service:
        service = Service(installed, args, env)
        started.append(service)
        return service

    yield start
    for service in started:
        service.kill()


def _delivered(url: str) -> tuple[str, int] | None:
    engine = sa.create_engine(url)
    t = outbox_table("outbox_events")
    try:
        with engine.connect() as conn:
            row = conn.execute(sa.select(t.c.status, t.c.kafka_offset)).one_or_none()
    finally:
        engine.dispose()
    return None if row is None or row.status != "delivered" else (row.status, row.kafka_offset)


@pytest.mark.integration
def test_the_installed_wheel_applies_relays_and_consumes(
    installed: Installed,
    db_url: str,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    services: Callable[..., Service],
) -> None:
    topic = kafka_topics(partitions=1)
    common = {
        "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOXKIT_HEALTH_HOST": "127.0.0.1",
        "OUTBOXKIT_LOG_FORMAT": "json",
    }
    enqueue = (
        "import sys, sqlalchemy as sa, outboxkit\n"
        "with sa.create_engine(sys.argv[1]).begin() as conn:\n"
        "    outboxkit.enqueue(conn, topic=sys.argv[2], key='k', payload=sys.argv[3])\n"
    )
    for name, url in (("mariadb", db_url), ("postgresql", pg_url)):
        installed.run(installed.bin("outboxkit"), "schema", "apply", "--db-url", url)
        installed.run(installed.bin("python"), "-c", enqueue, url, topic, f"from {name}")
        relay = services(
            installed,
            ["relay"],
            **common,
            OUTBOXKIT_DB_URL=url,
            OUTBOXKIT_HEALTH_PORT=str(free_port()),
            OUTBOXKIT_NODE_ID=f"wheel-{name}",
        )
        try:
            wait_for(lambda url=url: _delivered(url), timeout=60, what=f"{name} row delivered")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; relay's last lines:\n{relay.tail()}") from None
        assert relay.stop() == 0, relay.tail()
        (exit_record,) = relay.events("relay-exit")
        assert exit_record["result"] == "clean", exit_record

    (installed.workdir / "recorder.py").write_text(CONSUMER_MODULE)
    record = installed.workdir / "received.txt"
    consumer = services(
        installed,
        ["consume", "recorder:Recorder"],
        **common,
        OUTBOXKIT_TOPICS=topic,
        OUTBOXKIT_GROUP_ID=f"wheel-{topic}",
        OUTBOXKIT_HEALTH_PORT=str(free_port()),
        OUTBOXKIT_NODE_ID="wheel-consumer",
        RECORD_TO=str(record),
    )

    def received() -> list[str]:
        return record.read_text().splitlines() if record.exists() else []

    try:
        wait_for(lambda: len(received()) >= 2, timeout=90, what="both messages consumed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; consumer's last lines:\n{consumer.tail()}") from None
    assert consumer.stop() == 0, consumer.tail()
    assert sorted(received()) == ["from mariadb", "from postgresql"]
