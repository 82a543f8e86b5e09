"""docs/quickstart.md runs as written: every ```sh block, in order, as one shell
script, and every ```python block saved under the file name its marker gives
(``<!-- snippet: typecheck (file service.py; ...) -->``) in the service's
folder the page makes (``../shop``), beside a fresh copy of this checkout named
``outboxkit``, as a newcomer's clone.

What is replaced, and only that: the local services' addresses the page tells
a user to set (the database URL and the ``mariadb`` client's options, the Kafka
bootstrap, the default health ports 8080/8081, given to each process as
``OUTBOXKIT_HEALTH_PORT``) by this test's (a fresh database, free ports), and
the topic ``shop.orders`` by a topic of this test's own on the shared broker.
The install runs for real (``python3 -m venv``, ``pip install``) with the
machine's own ``python3``, as the page says.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.naming import unique_name
from support.services import free_ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart.md"
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
FILE = re.compile(r"<!--\s*snippet:\s*\w+\s*\(file (\S+\.py)\b[^>]*-->\s*\Z")
LOCAL_DB = "mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3306/shop"
LOCAL_CLIENT = "-h 127.0.0.1 -P 3306 -u outboxkit -poutboxkit"


def page() -> str:
    """The page with blockquotes opened (the asyncio box), so its blocks count too."""
    return re.sub(r"^> ?", "", QUICKSTART.read_text(), flags=re.M)


def parts() -> list[tuple[str, str, str | None]]:
    """(language, body, file name for python) of each fenced block, in order."""
    text = page()
    out = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip()
        named = FILE.search(before[before.rfind("<!--") :]) if before.endswith("-->") else None
        out.append((match.group(1), match.group(2), named.group(1) if named else None))
    return out


def test_the_readme_links_the_quickstart_first() -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links[:1] == ["docs/quickstart.md"], links[:3]


def test_every_block_is_run() -> None:
    blocks = parts()
    assert [lang for lang, _, _ in blocks if lang not in ("sh", "python")] == []
    unnamed = [body for lang, body, name in blocks if lang == "python" and name is None]
    assert not unnamed, "a ```python block needs its file name in its marker"
    names = [name for _, _, name in blocks if name]
    assert names == ["service.py", "service_async.py", "billing.py"], names
    script = "\n".join(body for lang, body, _ in blocks if lang == "sh")
    for name in names:  # each file the page shows is run by a command it shows
        assert f"python {name}" in script or f"{name.removesuffix('.py')}:" in script, name


def _copy_checkout(dest: Path) -> Path:
    """What git tracks (plus new, not ignored files): a clone's files, no .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        src = REPO / os.fsdecode(raw)
        if src.is_file():
            target = dest / os.fsdecode(raw)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
            target.chmod(src.stat().st_mode)
    return dest


@pytest.mark.timeout(900)  # a real install into a new virtual environment, then the run
def test_the_quickstart_runs_as_written(db_url: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    url = sa.make_url(db_url)
    topic = unique_name("okt")
    health_relay, health_consumer = (str(p) for p in free_ports(2))
    client = f"-h {url.host} -P {url.port or 3306} -u {url.username} -p{url.password}"

    def localize(text: str) -> str:
        text = text.replace(LOCAL_DB, db_url).replace(LOCAL_CLIENT, client)
        text = re.sub(r"(?<= )shop(?=[ ']|$)", str(url.database), text, flags=re.M)
        text = text.replace("127.0.0.1:9092", kafka_bootstrap).replace("shop.orders", topic)
        # The page runs both on their default ports: here each gets a free one.
        text = text.replace(
            "outboxkit relay &", f"OUTBOXKIT_HEALTH_PORT={health_relay} outboxkit relay &"
        )
        text = text.replace(
            "outboxkit consume billing:Billing --inbox &",
            f"OUTBOXKIT_HEALTH_PORT={health_consumer} outboxkit consume billing:Billing --inbox &",
        )
        text = text.replace("localhost:8081", f"localhost:{health_consumer}")
        return text.replace("localhost:8080", f"localhost:{health_relay}")

    _copy_checkout(tmp_path / "outboxkit")
    script: list[str] = []
    for lang, body, name in parts():
        if lang == "python":
            assert name is not None
            (tmp_path / "shop").mkdir(exist_ok=True)
            (tmp_path / "shop" / name).write_text(localize(body))
        else:
            script.append(localize(body))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OUTBOXKIT_", "PYTHON")) and k != "VIRTUAL_ENV"
    }
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin:" + env.get("PATH", "")  # the machine's python3
    log = tmp_path / "quickstart.log"
    with log.open("w") as out:
        # Its own session: the relay and the consumer it starts in the background
        # stay in its process group, which cleanup signals by id if the page's own
        # `kill %1 %2` did not run.
        shell = subprocess.Popen(
            ["bash", "-e", "-c", "\n".join(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,  # the page starts with `cd outboxkit`
            env=env,
            start_new_session=True,
        )
    try:
        code = shell.wait(timeout=900)
        text = log.read_text()
        assert code == 0, text[-6000:]
        assert "billed order 1" in text and "billed order 2" in text, text[-6000:]
        assert re.search(r"^outbox_rows_delivered_total\S* 2\.0$", text, re.M), text[-6000:]
        assert re.search(r'^worker_messages_total\{result="success"\} 2\.0$', text, re.M), text
        engine = sa.create_engine(db_url)
        with engine.connect() as conn:
            billed = conn.execute(sa.text("SELECT order_id FROM bills ORDER BY order_id"))
            assert billed.scalars().all() == [1, 2]
        engine.dispose()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)
        if shell.poll() is None:
            shell.kill()
        _delete_topics(kafka_bootstrap, [topic, f"{topic}.dlq"])


def _delete_topics(bootstrap: str, names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    for fut in AdminClient({"bootstrap.servers": bootstrap}).delete_topics(names).values():
        with contextlib.suppress(Exception):  # best-effort cleanup
            fut.result(timeout=20)
