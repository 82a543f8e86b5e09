"""The Grafana dashboard in deploy/grafana/ is provisionable and every query in it works.

Static: the dashboard is valid JSON with unique panel ids, every panel carries
the ``${DS_PROMETHEUS}`` datasource, every ``$variable`` a query uses is
defined, the provisioning files point at the dashboard folder and provide the
data source uid the dashboard defaults to, every metric a query names is one
the code registers, and each metric issue 12 asks for has a panel.

Live: a real relay (with Redis shard leases) delivers a small backlog, a real
consumer handles it (one message dead-lettered), and a real Prometheus scrapes
both under the job names of deploy/prometheus/prometheus.yml. Every panel
query and every variable query then runs through Prometheus's HTTP API with
the dashboard variables replaced by concrete values, as Grafana would send it:
it must parse, name only metrics Prometheus has scraped, and return data
unless it selects pushed series or a family with no series yet.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from support.metric_names import exported_metric_names
from support.services import free_port
from support.waiting import bound, wait_for

from outboxkit import Event, enqueue_many
from outboxkit.consumer import Consumer, ConsumerSettings, Message, PermanentError
from outboxkit.relay import Relay, RelaySettings
from outboxkit.runtime.testing import reset_logging

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "outboxkit.json"
DASHBOARD_PROVIDER = GRAFANA / "provisioning" / "dashboards" / "outboxkit.yaml"
DATASOURCE = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"

RELAY_JOB = "outboxkit-relay"
CONSUMER_JOB = "outboxkit-consumer"

#: What issue 12 asks the dashboard to show, as the metric each needs.
REQUIRED = {
    "relay backlog": "outbox_backlog_rows",
    "oldest pending age": "outbox_oldest_pending_age_seconds",
    "delivered rate": "outbox_rows_delivered_total",
    "failed rate": "outbox_rows_failed_total",
    "retryable rate": "outbox_rows_retryable_total",
    "publish latency": "outbox_publish_latency_seconds_bucket",
    "paused topics": "outbox_topic_paused",
    "shards owned per relay": "outbox_shards_owned",
    "shutdown pending": "outbox_shutdown_pending",
    "out-of-order acknowledgements": "outbox_rows_acked_out_of_order_total",
    "shard grants fenced": "outbox_shard_grants_fenced",
    "producer fatal errors": "outbox_kafka_producer_fatal_total",
    "consumer processed rate by outcome": "worker_messages_total",
    "consumer lag": "worker_consumer_lag",
    "handler latency": "worker_handle_seconds_bucket",
    "dead-letter write failures": "worker_dlq_unavailable_total",
    # Issue 53: a relay retrying because of the cluster told apart from a stuck one.
    "kafka delivery errors by topic and error": "outbox_kafka_delivery_errors_total",
    "ownership conflicts": "outbox_ownership_conflicts",
}

# --- reading the dashboard ------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title / refId, expr)`` of every query target."""
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in all_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variable_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(variable, query)`` of every Prometheus query variable."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append((var["name"], query["query"] if isinstance(query, dict) else query))
    return out


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_WORDS |= {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, labels or keywords)."""
    bare = _STRING.sub('""', expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = _GROUPING.sub(" ", bare)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][\w:]*", bare):
        word = match.group(0)
        if bare[match.end() :].lstrip().startswith("(") or word.lower() in _WORDS:
            continue
        names.add(word)
    return names


def unknown_metrics(dashboard: dict[str, Any], known: set[str]) -> dict[str, list[str]]:
    """Per query (panels and variables), the metric names it uses that are not ``known``."""
    queries = targets(dashboard) + [
        (f"variable {name}", _label_values(query)[0]) for name, query in variable_queries(dashboard)
    ]
    unknown = {where: sorted(metric_names(expr) - known) for where, expr in queries}
    return {where: names for where, names in unknown.items() if names}


def _label_values(query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> ``(selector, label)``."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
    assert match, f"unsupported variable query {query!r}"
    return match.group(1), match.group(2)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$name`` / ``${name}`` as Grafana does; an unknown variable fails."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"{expr!r} uses ${name}, which the test does not know"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


# --- static checks ------------------------------------------------------------------


@pytest.mark.unit
def test_the_dashboard_is_valid_json_with_unique_ids_and_a_datasource_everywhere() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for panel in panels:
        assert panel.get("datasource") == datasource, panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource") == datasource, panel["title"]
            assert target["expr"].strip(), panel["title"]
    # No two panels overlap on the grid.
    cells = [
        (x, y)
        for p in panels
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells)), "panels overlap"

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    used = {
        name
        for _, expr in targets(dashboard) + variable_queries(dashboard)
        for name in re.findall(r"\$\{?(\w+)", expr)
        if not name.startswith("__")
    }
    assert used <= set(variables), sorted(used - set(variables))
    for name, _ in variable_queries(dashboard):
        assert variables[name]["datasource"] == datasource, name


@pytest.mark.unit
def test_the_provisioning_files_load_the_dashboard_and_its_datasource(
    yaml_module: ModuleType,
) -> None:
    provider = yaml_module.safe_load(DASHBOARD_PROVIDER.read_text())
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file" and entry["options"]["path"].startswith("/")

    datasources = yaml_module.safe_load(DATASOURCE.read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    # The dashboard's datasource variable defaults to the provisioned uid.
    (ds_var,) = [v for v in load_dashboard()["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert ds_var["current"]["value"] == source["uid"]

    # The docs tell an operator where to mount these files.
    docs = (REPO / "docs" / "operations.md").read_text()
    for path in (DASHBOARD, DASHBOARD_PROVIDER, DATASOURCE):
        assert str(path.relative_to(REPO)) in docs, path
    assert entry["options"]["path"] in docs


@pytest.mark.unit
def test_every_query_names_a_metric_the_code_registers() -> None:
    assert unknown_metrics(load_dashboard(), exported_metric_names()) == {}


@pytest.mark.unit
def test_each_metric_the_issue_asks_for_has_a_panel() -> None:
    exprs = [expr for _, expr in targets(load_dashboard())]
    named = set().union(*(metric_names(e) for e in exprs))
    missing = {what: metric for what, metric in REQUIRED.items() if metric not in named}
    assert missing == {}
    # Dead-letter writes: the dlq result of the consumer's message counter.
    assert any("worker_messages_total" in e and 'result="dlq"' in e for e in exprs)


@pytest.mark.unit
def test_a_renamed_metric_in_a_panel_is_caught() -> None:
    dashboard = copy.deepcopy(load_dashboard())
    panel = next(p for p in all_panels(dashboard) if p["title"] == "Oldest pending age")
    target = panel["targets"][0]
    target["expr"] = target["expr"].replace(
        "outbox_oldest_pending_age_seconds", "outbox_oldest_age"
    )
    assert unknown_metrics(dashboard, exported_metric_names()) == {
        "Oldest pending age / A": ["outbox_oldest_age"]
    }


@pytest.mark.unit
def test_metric_names_skips_functions_labels_and_grouping() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, topic) (rate(a_bucket{job="$j", x=~"y|z"}'
        "[$__rate_interval]))) > on (instance) group_left (pod) b_total or vector(1e3) * c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


# --- live: a real relay, consumer and Prometheus -----------------------------------------


class DeadLetterPoison(Consumer):
    """Dead-letters the message whose payload says ``poison``; the rest succeed."""

    def handle(self, message: Message) -> None:
        if b"poison" in (message.value or b""):
            raise PermanentError("poison payload")


class _Running:
    """``run()`` of a relay or consumer in a thread of this process."""

    def __init__(self, run: Callable[[], int], stop: Callable[[], None]) -> None:
        self._stop = stop
        self.thread = threading.Thread(target=run, name="dashboard-test", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "did not stop within 30 s"


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
    pytest.skip(reason)


def _prom_json(url: str, path: str, **params: str) -> dict[str, Any]:
    """Prometheus's JSON answer, also for an error status (an invalid query is a 400)."""
    full = f"{url}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(full, timeout=5) as resp:  # noqa: S310 - loopback test URL
            body = resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    answer: dict[str, Any] = json.loads(body)
    return answer


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=2):  # noqa: S310 - loopback
            return True
    except OSError:
        return False


def _eventually(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until true or ``bound(timeout)`` passed; its last answer."""
    deadline = time.monotonic() + bound(timeout)
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture
def prometheus_scraping(tmp_path: Path) -> Iterator[Callable[[str, str], str]]:
    """``start(relay_target, consumer_target)``: a real Prometheus scraping both every
    second under the shipped job names; returns its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        _missing("prometheus not found; install Debian's `prometheus` package")
    procs: list[subprocess.Popen[bytes]] = []
    workdir = tmp_path / "prometheus"

    def start(relay_target: str, consumer_target: str) -> str:
        workdir.mkdir()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: {RELAY_JOB}\n"
            f"    static_configs: [{{targets: ['{relay_target}']}}]\n"
            f"  - job_name: {CONSUMER_JOB}\n"
            f"    static_configs: [{{targets: ['{consumer_target}']}}]\n"
        )
        port = free_port()
        log = (workdir / "prometheus.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    str(binary),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        )
        log.close()
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(url), timeout=30, interval=0.25, what="prometheus ready")
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture
def relay_and_consumer(
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
) -> Iterator[tuple[str, str]]:
    """A relay (Redis leases) that delivers a backlog of events, one of them poison,
    and a consumer that handles them; yields both scrape targets."""
    topic = kafka_topics(1)
    kafka_topics(1, name=f"{topic}.dlq")
    events = [
        Event(topic=topic, key=f"k{i % 4}", payload={"n": i, "kind": "poison" if i == 5 else "ok"})
        for i in range(20)
    ]
    with engine.begin() as conn:
        enqueue_many(conn, events, table=outbox)
    relay = Relay(
        RelaySettings(
            db_url=db_url,
            kafka_bootstrap=kafka_bootstrap,
            kafka_config={"message.timeout.ms": "2000"},
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            node_id=f"relay-{uuid.uuid4().hex[:6]}",
            poll_interval=0.05,
            start_jitter=0.0,
            metrics_interval=0.5,
            health_port=0,
            shutdown_timeout=15.0,
        )
    )
    consumer = DeadLetterPoison(
        ConsumerSettings(
            kafka_bootstrap=kafka_bootstrap,
            topics=(topic,),
            group_id=f"g-{topic}",
            health_port=0,
            stats_interval=0.5,
            commit_interval=0.5,
            worker_drain_timeout=5.0,
            close_timeout=5.0,
            shutdown_timeout=15.0,
            kafka_config={"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"},
        )
    )
    running = [_Running(relay.run, relay.stop)]
    try:
        running.append(_Running(lambda: consumer.run(handle_signals=False), consumer.stop))

        def handled() -> float:
            return sum(
                consumer.registry.get_sample_value("worker_messages_total", {"result": r}) or 0
                for r in ("success", "dlq")
            )

        wait_for(lambda: handled() >= len(events), timeout=30, what="every event handled")
        yield f"127.0.0.1:{relay.health.port}", f"127.0.0.1:{consumer.health.port}"
    finally:
        for service in reversed(running):
            service.stop()
        reset_logging()


def _regex_escape(value: str) -> str:
    """What Grafana sends for one selected value of a multi-value variable."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


@pytest.mark.integration
def test_every_query_runs_on_a_real_prometheus_scraping_a_relay_and_a_consumer(
    relay_and_consumer: tuple[str, str],
    prometheus_scraping: Callable[[str, str], str],
) -> None:
    relay_target, consumer_target = relay_and_consumer
    prom = prometheus_scraping(relay_target, consumer_target)
    dashboard = load_dashboard()
    values = {
        "relay_job": RELAY_JOB,
        "consumer_job": CONSUMER_JOB,
        "relay_instance": _regex_escape(relay_target),
        "consumer_instance": _regex_escape(consumer_target),
        # Grafana's $__rate_interval for a 1 s scrape interval is 4 s; a few more
        # samples make the rates of this short run non-empty.
        "__rate_interval": "15s",
        "__interval": "15s",
        "__range": "5m",
    }

    def scraped() -> tuple[set[str], set[str]]:
        """Names with series, and names Prometheus knows only from a scrape's metadata
        (a labelled family with no series yet, like outbox_topic_paused)."""
        series = set(_prom_json(prom, "/api/v1/label/__name__/values")["data"])
        metadata = set(_prom_json(prom, "/api/v1/metadata")["data"])
        families = metadata | {m + "_total" for m in metadata}
        return series, families

    def targets_up() -> bool:
        up: list[dict[str, Any]] = _prom_json(prom, "/api/v1/query", query="up")["data"]["result"]
        return sum(r["value"][1] == "1" for r in up) == 2

    wait_for(targets_up, timeout=20, interval=0.25, what="both scrape targets up")

    queries = [(where, substitute(expr, values)) for where, expr in targets(dashboard)]
    expect_data: list[tuple[str, str]] = []

    def answers() -> dict[str, Any]:
        return {where: _prom_json(prom, "/api/v1/query", query=expr) for where, expr in queries}

    # Wait until every query that should have data has it: rates need a few scrapes.
    def all_have_data() -> bool:
        series, _ = scraped()
        # Pushed series (job outboxkit_<component>) need a Pushgateway, not scraped here.
        expect_data[:] = [
            (where, expr)
            for where, expr in queries
            if metric_names(expr) <= series and not re.search(r'job=~?"outboxkit_', expr)
        ]
        got = answers()
        if any(answer["status"] != "success" for answer in got.values()):
            return True  # an invalid query stays invalid; reported below
        return all(got[where]["data"]["result"] for where, _ in expect_data)

    _eventually(all_have_data, 20)  # if not, the checks below say which query lacks data

    series, families = scraped()
    got = answers()
    errors = {
        where: answer.get("error") for where, answer in got.items() if answer["status"] != "success"
    }
    assert errors == {}
    missing = {
        where: sorted(metric_names(expr) - series - families)
        for where, expr in queries
        if metric_names(expr) - series - families
    }
    assert missing == {}, f"metrics Prometheus never scraped: {missing}"
    static_unknown = unknown_metrics(dashboard, exported_metric_names())
    assert static_unknown == {}
    empty = [where for where, _ in expect_data if not got[where]["data"]["result"]]
    assert empty == [], "queries over scraped series returned nothing (a label mismatch?)"

    # Variable queries: the selector has series with the label the variable lists.
    expected = {"relay_instance": relay_target, "consumer_instance": consumer_target}
    for name, query in variable_queries(dashboard):
        selector, label = _label_values(substitute(query, values))
        answer = _prom_json(prom, "/api/v1/series", **{"match[]": selector})
        assert answer["status"] == "success", (name, answer)
        found = {s.get(label) for s in answer["data"]}
        assert expected[name] in found, (name, selector, found)
