"""The container image operators run: built here with buildah, run from the image.

``deploy/docker/build.sh`` builds ``deploy/docker/Dockerfile`` on a Debian base
made from Debian's packages (no Docker engine needed), tagged with the package
version and labelled with it. From that image, with the local services, these
tests apply the schema, run ``outboxkit relay`` as the image's entrypoint and
user against a backlog and stop it the way a container runtime does (SIGTERM to
the entrypoint process), then run the example consumer the same way; run the
relay against PostgreSQL; and run ``opentelemetry-instrument outboxkit relay``,
whose spans reach the exporter. ``buildah run --isolation chroot`` shares the
host's network, so the container reaches the services on 127.0.0.1.

Where buildah cannot be installed the tests skip locally and fail under CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.services import free_port
from support.waiting import bound, wait_for

import outboxkit
from outboxkit.demo.tables import shipments
from outboxkit.schema import outbox_table

# The first build on a machine makes the Debian base (a few minutes).
pytestmark = [pytest.mark.integration, pytest.mark.image, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
IMAGE_UID = "10001"
# What build.sh writes into the source label when told; a clone takes its origin.
SOURCE_URL = "https://example.invalid/outboxkit"


def package_version() -> str:
    with (REPO / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    """Build the image with build.sh's default tags (cached after the first
    time); its id, OCI config and the tags that point at it."""
    if shutil.which("apt-get") is None and shutil.which("buildah") is None:
        _missing("buildah is not installed and apt-get is not available to install it")
    env = {k: v for k, v in os.environ.items() if k != "OUTBOXKIT_IMAGE"}
    build = subprocess.run(
        [str(REPO / "deploy/docker/build.sh")],
        env={**env, "OUTBOXKIT_SOURCE_URL": SOURCE_URL},
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert build.returncode == 0, f"build.sh failed:\n{build.stderr[-4000:]}"
    image_id = build.stdout.strip().splitlines()[-1]
    assert len(image_id) == 64, build.stdout
    # By id from here on: another checkout on the machine may retag the names.
    info = subprocess.run(
        ["buildah", "inspect", "--type", "image", image_id],
        capture_output=True,
        text=True,
        check=True,
    )
    tags = subprocess.run(
        ["buildah", "images", "--no-trunc", "--format", "{{.Name}}:{{.Tag}} {{.ID}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return {
        "id": image_id,
        "config": json.loads(info.stdout)["OCIv1"]["config"],
        "tags": {line.split()[0] for line in tags if line.endswith(image_id.split(":")[-1])},
    }


@pytest.fixture(scope="module")
def image(built: dict[str, Any]) -> dict[str, Any]:
    """The image's OCI config."""
    config: dict[str, Any] = built["config"]
    return config


@pytest.fixture
def container(built: dict[str, Any]) -> Iterator[str]:
    name = subprocess.run(
        ["buildah", "from", "-q", built["id"]], capture_output=True, text=True, check=True
    ).stdout.strip()
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


def _run_args(container: str, env: dict[str, str], argv: list[str]) -> list[str]:
    flags = [f"--env={k}={v}" for k, v in env.items()]
    return ["buildah", "run", "--isolation", "chroot", *flags, container, "--", *argv]


def run_in(container: str, *argv: str, env: dict[str, str] | None = None) -> str:
    """Run a command in the container as the image's user; its stdout."""
    done = subprocess.run(
        _run_args(container, env or {}, list(argv)),
        capture_output=True,
        text=True,
        timeout=bound(120),
        check=False,
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


class ImageProcess:
    """The image's entrypoint, started with ``buildah run``, its JSON log lines kept."""

    def __init__(
        self,
        container: str,
        config: dict[str, Any],
        args: list[str],
        env: dict[str, str],
        *,
        wrapper: tuple[str, ...] = (),
    ):
        """``wrapper``: a command the entrypoint runs under (as a Kubernetes
        ``command`` would put it), e.g. ``opentelemetry-instrument``."""
        argv = [*wrapper, *config["Entrypoint"], *args]
        self.proc = subprocess.Popen(
            _run_args(container, env, argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.records: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.stdout: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._out_reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            self.stdout.extend(self.proc.stdout)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:  # closed at EOF: no unclosed pipe for a later test
            for line in self.proc.stderr:
                self.raw.append(line)
                with contextlib.suppress(json.JSONDecodeError):
                    self.records.append(json.loads(line))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in list(self.records) if r.get("event") == name]

    def entrypoint_pid(self) -> int:
        """The container's entrypoint process (a descendant of ``buildah run``)."""

        def find() -> int | None:
            for pid in _descendants(self.proc.pid):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                # buildah-chroot-runtime -> buildah-chroot-exec ARGV -> the entrypoint
                if not cmdline[0].startswith(b"buildah") and any(
                    part.endswith(b"/outboxkit") for part in cmdline
                ):
                    return pid
            return None

        return wait_for(find, timeout=30, what="the entrypoint process")

    def terminate(self) -> None:
        """What a container runtime does on stop: SIGTERM to the entrypoint."""
        os.kill(self.entrypoint_pid(), signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(bound(timeout))
        self._reader.join(5)
        self._out_reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in _descendants(self.proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)
        self._out_reader.join(10)

    def last_lines(self) -> str:
        return "".join(self.raw[-20:])


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def _counts(engine: sa.Engine) -> dict[str, int]:
    t = outbox_table("outbox_events")
    with engine.connect() as conn:
        return {
            str(s): int(n)
            for s, n in conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status))
        }


@pytest.fixture
def processes() -> Iterator[list[ImageProcess]]:
    started: list[ImageProcess] = []
    yield started
    for p in started:
        p.kill()


def test_image_runs_as_its_user_without_compiler_or_tests(
    image: dict[str, Any], container: str
) -> None:
    assert image["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert image["Entrypoint"] == ["outboxkit"]
    assert image["Cmd"] == ["relay"]
    assert run_in(container, "id", "-u").strip() == IMAGE_UID
    compilers = run_in(container, "sh", "-c", "command -v gcc cc c++ clang || true")
    assert compilers.strip() == "", f"a compiler is in the image: {compilers}"
    tests = run_in(
        container,
        "sh",
        "-c",
        "find / -xdev \\( -name 'test_*.py' -o -name conftest.py \\) -path '*outboxkit*' "
        "2>/dev/null; find / -xdev -type d -path '*site-packages/tests' 2>/dev/null; true",
    )
    assert tests.strip() == "", f"test files in the image:\n{tests}"
    assert "No broken requirements found" in run_in(container, "pip", "check")
    # What MySQL 8's default login needs over plain TCP is installed too.
    run_in(container, "python", "-c", "import outboxkit, outboxkit.relay, outboxkit.consumer")


def test_relay_and_consumer_from_the_image_drain_cleanly_on_sigterm(
    image: dict[str, Any],
    container: str,
    db_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    processes: list[ImageProcess],
) -> None:
    run_in(container, *image["Entrypoint"], "schema", "apply", "--db-url", db_url, "--shards", "8")
    topic = kafka_topics(partitions=3)
    total = 3000
    with engine.begin() as conn:
        outboxkit.enqueue_many(
            conn,
            [
                outboxkit.Event(topic=topic, key=f"o-{i % 50}", payload={"order_id": f"o-{i}"})
                for i in range(total)
            ],
        )

    port = free_port()
    relay = ImageProcess(
        container,
        image,
        list(image["Cmd"]),  # the image's default command: the relay
        {
            "OUTBOXKIT_DB_URL": db_url,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_HEALTH_HOST": "127.0.0.1",
            "OUTBOXKIT_HEALTH_PORT": str(port),
            "OUTBOXKIT_BATCH_SIZE": "100",
            "OUTBOXKIT_NODE_ID": "image-relay",
        },
    )
    processes.append(relay)
    wait_for(
        lambda: _status(f"http://127.0.0.1:{port}/healthz/ready") == 200,
        timeout=60,
        what=f"relay ready; last lines:\n{relay.last_lines()}",
    )
    wait_for(lambda: _counts(engine).get("delivered", 0) >= 300, timeout=60, what="deliveries")
    relay.terminate()
    assert relay.wait(60) == 0, relay.last_lines()
    (record,) = relay.events("relay-exit")
    assert record["signal"] == "SIGTERM" and record["result"] == "clean", record
    assert record["left_leased"] == 0
    counts = _counts(engine)
    assert "delivering" not in counts, counts
    assert sum(counts.values()) == total
    delivered = counts["delivered"]

    consumer_port = free_port()
    consumer = ImageProcess(
        container,
        image,
        ["consume", "outboxkit.demo:OrderConsumer"],
        {
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_DB_URL": db_url,
            "OUTBOXKIT_INBOX": "true",
            "OUTBOXKIT_TOPICS": topic,
            "OUTBOXKIT_GROUP_ID": f"image-{topic}",
            "OUTBOXKIT_HEALTH_HOST": "127.0.0.1",
            "OUTBOXKIT_HEALTH_PORT": str(consumer_port),
            "OUTBOXKIT_NODE_ID": "image-consumer",
        },
    )
    processes.append(consumer)

    def shipped() -> int:
        with engine.connect() as conn:
            try:
                return int(
                    conn.execute(sa.select(sa.func.count()).select_from(shipments)).scalar_one()
                )
            except sa.exc.ProgrammingError:
                return 0  # the consumer creates the table at start

    try:
        wait_for(lambda: shipped() >= delivered, timeout=120, what=f"{delivered} shipments")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; consumer's last lines:\n{consumer.last_lines()}") from None
    consumer.terminate()
    assert consumer.wait(60) == 0, consumer.last_lines()
    (exit_record,) = consumer.events("consumer-exit")
    assert exit_record["result"] == "clean" and exit_record["unknown"] == 0, exit_record
    assert shipped() == delivered, "each delivered event shipped exactly once"


def _shipped_outboxkit_containers() -> list[tuple[str, dict[str, Any]]]:
    """(where, container spec) of every outboxkit container in compose and k8s."""
    yaml = pytest.importorskip("yaml")
    found: list[tuple[str, dict[str, Any]]] = []
    compose = yaml.safe_load((REPO / "deploy/compose/compose.yaml").read_text())
    for name, service in compose["services"].items():
        if str(service.get("image", "")).startswith("outboxkit:"):
            found.append((f"compose {name}", service))
    for path in sorted((REPO / "deploy/k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                if str(c.get("image", "")).startswith("outboxkit:"):
                    found.append((f"{path.relative_to(REPO)} {c['name']}", c))
    return found


def test_compose_and_kubernetes_use_the_image_as_tested(
    built: dict[str, Any], image: dict[str, Any], container: str
) -> None:
    """They name the image build.sh tagged (buildah and podman store the
    unqualified ``outboxkit:<version>`` as ``localhost/outboxkit:<version>``),
    keep its entrypoint (arguments only, as the tests above run it), and their
    preStop hooks run in it."""
    shipped = _shipped_outboxkit_containers()
    assert len(shipped) >= 5, shipped
    subcommands = run_in(container, *image["Entrypoint"], "--help")
    for where, spec in shipped:
        assert f"localhost/{spec['image']}" in built["tags"], (where, spec["image"], built["tags"])
        # compose's `command` and Kubernetes' `args` are the arguments to the
        # entrypoint; Kubernetes' `command` would replace it.
        args = spec["command"] if where.startswith("compose") else spec.get("args")
        assert where.startswith("compose") or "command" not in spec, f"{where} replaces it"
        assert args and args[0] in subcommands, f"{where}: {args}"
        hook = spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if hook:
            run_in(container, *hook)


def test_the_image_is_tagged_and_labelled_with_the_package_version(
    built: dict[str, Any], container: str
) -> None:
    version = package_version()
    assert {f"localhost/outboxkit:{version}", "localhost/outboxkit:dev"} <= built["tags"]
    labels = built["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"] == SOURCE_URL
    assert version in run_in(container, "outboxkit", "--version").replace(",", " ").split()


def test_relay_from_the_image_delivers_from_postgresql(
    image: dict[str, Any],
    container: str,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    processes: list[ImageProcess],
) -> None:
    """The image holds the ``postgres`` extra: on main a postgresql+psycopg URL
    exited 2 there (no driver)."""
    run_in(container, *image["Entrypoint"], "schema", "apply", "--db-url", pg_url, "--shards", "4")
    topic = kafka_topics(partitions=2)
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            outboxkit.enqueue_many(
                conn,
                [
                    outboxkit.Event(topic=topic, key=f"k-{i % 5}", payload={"n": i})
                    for i in range(50)
                ],
            )
        relay = ImageProcess(
            container,
            image,
            list(image["Cmd"]),
            {
                "OUTBOXKIT_DB_URL": pg_url,
                "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
                "OUTBOXKIT_HEALTH_HOST": "127.0.0.1",
                "OUTBOXKIT_HEALTH_PORT": str(free_port()),
                "OUTBOXKIT_NODE_ID": "image-relay-pg",
            },
        )
        processes.append(relay)
        try:
            wait_for(lambda: _counts(engine).get("delivered", 0) == 50, timeout=60, what="50")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; relay's last lines:\n{relay.last_lines()}") from None
        relay.terminate()
        assert relay.wait(60) == 0, relay.last_lines()
        (record,) = relay.events("relay-exit")
        assert record["result"] == "clean" and record["left_leased"] == 0, record
    finally:
        engine.dispose()


def test_opentelemetry_instrument_relay_from_the_image_exports_its_spans(
    image: dict[str, Any],
    container: str,
    db_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    processes: list[ImageProcess],
) -> None:
    """``opentelemetry-instrument outboxkit relay``, as docs/tracing.md says to
    run it, works in the image: the relay's ``send`` span for a row written
    inside a trace continues that trace and reaches the configured exporter
    (the SDK's console exporter here, on stdout; in production OTLP)."""
    run_in(container, *image["Entrypoint"], "schema", "apply", "--db-url", db_url, "--shards", "4")
    topic = kafka_topics(partitions=1)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with engine.begin() as conn:
        outboxkit.enqueue(
            conn,
            topic=topic,
            payload={"n": 1},
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
    relay = ImageProcess(
        container,
        image,
        list(image["Cmd"]),
        {
            "OUTBOXKIT_DB_URL": db_url,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_HEALTH_HOST": "127.0.0.1",
            "OUTBOXKIT_HEALTH_PORT": str(free_port()),
            "OUTBOXKIT_NODE_ID": "image-relay-otel",
            "OTEL_SERVICE_NAME": "outboxkit-relay",
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        },
        wrapper=("opentelemetry-instrument",),
    )
    processes.append(relay)
    try:
        wait_for(lambda: _counts(engine).get("delivered", 0) == 1, timeout=60, what="delivery")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; relay's last lines:\n{relay.last_lines()}") from None
    relay.terminate()
    assert relay.wait(60) == 0, relay.last_lines()
    spans = "".join(relay.stdout)  # the exporter writes at the latest on exit
    assert f'"name": "send {topic}"' in spans, spans[-3000:] or relay.last_lines()
    assert f'"trace_id": "0x{trace_id}"' in spans, spans[-3000:]
