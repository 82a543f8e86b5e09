"""examples/fastapi_orders end to end on the local services, as a user runs it.

The commands of the example's README, as written (read from it), without
PYTHONPATH: the order service under a real uvicorn (``serve.py``), orders
posted over HTTP, ``outboxkit relay`` and ``outboxkit consume invoicing:Invoicing``
as processes; every order is invoiced exactly once, in order per customer, and
SIGTERM ends all three with status 0.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.services import free_ports
from support.waiting import bound, wait_for

from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

httpx = pytest.importorskip("httpx", reason="the examples extra is not installed")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fastapi_orders"
FAST_GROUP = "session.timeout.ms=6000,heartbeat.interval.ms=500"


class Proc:
    """A child process whose stderr lines are kept (JSON ones parsed)."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], cwd: Path) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.raw: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.raw.append(line)
        self.proc.stderr.close()

    def records(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.raw):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                out.append(record)
        return out

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"exited {self.proc.returncode}:\n{self.tail()}")
            return next((m for line in list(self.raw) if (m := regex.search(line))), None)

        match: re.Match[str] = wait_for(found, timeout=timeout, what=pattern)
        return match

    def stop(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(bound(timeout))
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)

    def tail(self, n: int = 20) -> str:
        return "".join(self.raw[-n:])


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def readme_commands(substitutions: dict[str, str]) -> list[str]:
    """The shell commands of the README's "Run it" block, continuation lines joined,
    comments and blank lines left out, with ``substitutions`` made: each must occur,
    so a README that changes them fails here instead of going untested."""
    text = (EXAMPLE / "README.md").read_text()
    block = text.split("## Run it", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    for old, new in substitutions.items():
        assert old in block, f"the README's commands no longer contain {old!r}"
        block = block.replace(old, new)
    lines = block.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _invoices(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id, order_id, customer, amount_cents, event_id "
                    "FROM example_invoices ORDER BY id"
                )
            )
        )


def _count(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


def test_the_readme_commands_run_as_written_invoice_every_order_once_and_all_exit_0(
    db_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    procs: list[Proc],
) -> None:
    """The README's commands, run as written from a clone's top folder without
    PYTHONPATH: only the database, the addresses and the ports are this test's
    own, and its topic and group come from the environment. On main, its
    ``outboxkit consume invoicing:Invoicing --inbox`` failed as written ("cannot
    import 'invoicing' ...: No module named 'invoicing'", exit 2): the test passed
    only because it set PYTHONPATH to the example's folder."""
    topic = kafka_topics(3)
    kafka_topics(3, name=f"{topic}.dlq")
    url = sa.make_url(db_url)
    async_url = url.set(drivername="mysql+asyncmy").render_as_string(hide_password=False)
    web, relay_port, consumer_port = free_ports(3)
    commands = readme_commands(
        {
            "-h 127.0.0.1 -u outboxkit -poutboxkit": (
                f"-h {url.host} -P {url.port} -u {url.username} -p{url.password}"
            ),
            "CREATE DATABASE IF NOT EXISTS shop": f"CREATE DATABASE IF NOT EXISTS {url.database}",
            "mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3306/shop": db_url,
            "mysql+asyncmy://outboxkit:outboxkit@127.0.0.1:3306/shop": async_url,
            "127.0.0.1:9092": kafka_bootstrap,
            # The test's own topics (made above): `topics ensure` finds them as asked.
            "topics ensure orders orders.dlq": f"topics ensure {topic} {topic}.dlq",
            "--port 8000": f"--port {web}",
            "localhost:8000": f"127.0.0.1:{web}",
        }
    )
    # The README runs the relay and the consumer side by side on their default
    # health ports (8080, 8081); this shared machine gives the test its own,
    # through the environment, so the commands stay as written.
    assert not any("--health-port" in c for c in commands), commands
    # A newcomer's shell: this environment's python and outboxkit first on PATH,
    # no PYTHONPATH, no OUTBOXKIT_* but what the README exports.
    shell_env = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("OUTBOXKIT_")
    }
    shell_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    # The test's own topic and group, and a quick group and commit, per process.
    own_env = {
        "serve.py": {"ORDERS_TOPIC": topic},
        "relay": {"OUTBOXKIT_POLL_INTERVAL": "0.2", "OUTBOXKIT_HEALTH_PORT": str(relay_port)},
        "consume": {
            "OUTBOXKIT_HEALTH_PORT": str(consumer_port),
            "OUTBOXKIT_TOPICS": topic,
            "OUTBOXKIT_GROUP_ID": f"invoicing-{topic}",
            "OUTBOXKIT_KAFKA_CONFIG": FAST_GROUP,
            "OUTBOXKIT_COMMIT_INTERVAL": "0.5",
        },
    }
    cwd = REPO
    started: dict[str, Proc] = {}
    outputs: list[str] = []
    for command in commands:
        words = shlex.split(command, comments=True)
        background = words[-1] == "&"
        words = words[:-1] if background else words
        if words[:2] == ["pip", "install"]:
            continue  # the suite's environment has the examples extra
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            shell_env[name] = value
            continue
        if words[0] == "cd":
            cwd = cwd / words[1]
            continue
        env = dict(shell_env)
        while re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value command ...
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        kind = next((k for k in own_env if k in words), None)
        env.update(own_env.get(kind or "", {}))
        if not background:
            done = subprocess.run(
                words, env=env, cwd=cwd, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            outputs.append(done.stdout)
            continue
        assert kind is not None, f"a background command the test does not know: {command}"
        started[kind] = proc = Proc(words, env=env, cwd=cwd)
        procs.append(proc)
        if kind == "serve.py":  # what a newcomer waits to see before curl
            proc.wait_line(r"Uvicorn running on http://[\d.]+:\d+", 60)
    service, relay, consumer = started["serve.py"], started["relay"], started["consume"]
    first = json.loads(outputs[-1])  # the README's curl: ada's order
    placed: dict[int, tuple[str, int, str]] = {first["id"]: ("ada", 1999, first["event_id"])}

    customers = ["ada", "bob", "cy", "dee", "eve"]

    def place(client: Any, n: int) -> None:
        customer, amount = customers[n % len(customers)], 100 + n
        r = client.post("/orders", json={"customer": customer, "amount_cents": amount})
        assert r.status_code == 201, r.text
        body = r.json()
        placed[body["id"]] = (customer, amount, body["event_id"])

    with httpx.Client(base_url=f"http://127.0.0.1:{web}", timeout=10) as client:
        # Refused before anything is written: no order, no event.
        events_before = _count(engine, "outbox_events")
        bad = client.post("/orders", json={"customer": "ada", "amount_cents": 0})
        assert bad.status_code == 422
        assert _count(engine, "outbox_events") == events_before
        for n in range(44):
            place(client, n)

    def invoiced() -> bool:
        for proc in (service, relay, consumer):  # one that exited says why at once
            if proc.proc.poll() is not None:
                raise AssertionError(f"{proc.argv} exited {proc.proc.returncode}:\n{proc.tail()}")
        return _count(engine, "example_invoices") >= 45

    wait_for(invoiced, timeout=90, what="45 invoices")
    # Settle: anything invoiced twice would show up by now (commit interval 0.5 s).
    time.sleep(1.0)

    invoices = _invoices(engine)
    assert len(placed) == 45
    assert sorted(row.order_id for row in invoices) == sorted(placed)  # each order exactly once
    for row in invoices:
        assert (row.customer, row.amount_cents, row.event_id) == placed[row.order_id]
    for customer in customers:  # in placement order per customer (the event key)
        ids = [row.order_id for row in invoices if row.customer == customer]
        assert ids == sorted(ids), customer
    with engine.connect() as conn:
        statuses = {
            status: n
            for status, n in conn.execute(
                sa.text("SELECT status, COUNT(*) FROM outbox_events GROUP BY status")
            )
        }
    assert statuses == {"delivered": 45}
    assert _count(engine, "outbox_inbox") == 45

    # SIGTERM: the service first (no new orders), then the relay, then the consumer.
    assert service.stop() == 0, service.tail()
    assert relay.stop() == 0, relay.tail()
    assert consumer.stop() == 0, consumer.tail()
    [relay_exit] = relay.records("relay-exit")
    assert relay_exit["result"] == "clean", relay_exit
    [consumer_exit] = consumer.records("consumer-exit")
    assert consumer_exit["result"] == "clean", consumer_exit
    # Each event handled once; a redelivery (the relay and Kafka are at-least-once)
    # would be a duplicate skipped by the inbox, never a second invoice.
    assert consumer_exit["totals"]["success"] == 45, consumer_exit
    assert set(consumer_exit["totals"]) <= {"success", "duplicate"}, consumer_exit


def test_an_amount_no_column_holds_is_a_422_not_a_500(
    db_url: str, engine: sa.Engine, procs: list[Proc]
) -> None:
    """``amount_cents`` is a BIGINT: 1e20 (an integral JSON number, which pydantic
    takes as an int) and 2**63 are refused before anything is written, with a
    message naming the field, not a database error and a traceback."""
    apply_schema(engine, shards=8)
    async_url = sa.make_url(db_url).set(drivername="mysql+asyncmy")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ORDERS_DB_URL"] = async_url.render_as_string(hide_password=False)
    # Run from the example's folder, as its README does.
    service = Proc([sys.executable, "serve.py", "--port", "0"], env=env, cwd=EXAMPLE)
    procs.append(service)
    base_url = service.wait_line(r"Uvicorn running on (http://[\d.]+:\d+)", 60).group(1)
    with httpx.Client(base_url=base_url, timeout=10) as client:
        for amount in ("1e20", "1e19", str(2**63), "1e400"):
            body = f'{{"customer": "ada", "amount_cents": {amount}}}'
            r = client.post("/orders", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (amount, r.status_code, r.text)
            [detail] = r.json()["detail"]
            assert detail["loc"] == ["body", "amount_cents"], detail
        ok = client.post("/orders", json={"customer": "ada", "amount_cents": 2**63 - 1})
        assert ok.status_code == 201, ok.text
    assert service.stop() == 0, service.tail()
    assert "Traceback" not in "".join(service.raw), service.tail()
    assert _count(engine, "outbox_events") == 1
    assert _count(engine, "example_orders") == 1


@pytest.mark.unit
def test_the_examples_extra_is_separate_and_the_package_imports_without_it() -> None:
    import tomllib

    pyproject = tomllib.loads((EXAMPLE.parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", r, maxsplit=1)[0].lower() for r in extras["examples"]}
    assert {"fastapi", "uvicorn", "httpx"} <= names
    assert "outboxkit[examples]" in extras["dev"]  # the suite runs the example's test
    runtime = {
        re.split(r"[<>=\[ ]", r, maxsplit=1)[0].lower()
        for r in pyproject["project"]["dependencies"]
    }
    assert not {"fastapi", "uvicorn", "httpx", "starlette"} & runtime
    probe = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'httpx', 'starlette', 'greenlet', 'asyncmy'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "import outboxkit, outboxkit.consumer, outboxkit.relay, outboxkit.cli\n"
        "from outboxkit.consumer import Consumer, ConsumerSettings, Message\n"
        "class Billing(Consumer):\n"
        "    topics = ('orders',)\n"
        "    group_id = 'billing'\n"
        "    async def handle(self, message: Message) -> None: ...\n"
        "Billing(ConsumerSettings(kafka_bootstrap='127.0.0.1:1'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **os.environ,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "OUTBOXKIT_HEALTH_PORT": "0",
        },
        cwd=EXAMPLE,
    )
    assert out.returncode == 0, out.stderr
