from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry
from support.waiting import bound

from outboxkit.runtime import (
    DependencyError,
    HealthServer,
    Lifecycle,
    RuntimeSettings,
    ServiceMetrics,
    ServiceRuntime,
)

pytestmark = pytest.mark.unit


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - local test server
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def lifecycle() -> Lifecycle:
    return Lifecycle(service="test", node_id="n", shutdown_timeout=5)


@pytest.fixture
def make_server(lifecycle: Lifecycle) -> Iterator[Callable[..., HealthServer]]:
    servers: list[HealthServer] = []

    def make(**kwargs: object) -> HealthServer:
        registry = CollectorRegistry()
        ServiceMetrics(registry, service="test")
        server = HealthServer(lifecycle, port=0, registry=registry, **kwargs)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def test_ready_flips_to_503_the_moment_drain_starts(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    server = make_server()
    assert server.port != 0
    base = f"http://127.0.0.1:{server.port}"
    status, body = get(base + "/healthz/ready")
    assert (status, json.loads(body)) == (503, {"state": "starting"})
    lifecycle.set_running()
    assert get(base + "/healthz/ready") == (200, '{"state": "running"}\n')
    lifecycle.drain()
    status, body = get(base + "/healthz/ready")
    assert (status, json.loads(body)["state"]) == (503, "draining")
    status, body = get(base + "/healthz/live")
    assert (status, json.loads(body)) == (200, {"state": "draining"})
    lifecycle.set_stopped()
    assert get(base + "/healthz/live")[0] == 503
    assert get(base + "/healthz/ready")[0] == 503


def test_details_are_merged_and_can_veto_readiness(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    details: dict[str, object] = {"paused_topics": [], "ready": True}
    server = make_server(details=lambda: dict(details))
    lifecycle.set_running()
    url = f"http://127.0.0.1:{server.port}/healthz/ready"
    status, body = get(url)
    assert status == 200
    assert json.loads(body) == {"state": "running", "paused_topics": [], "ready": True}
    details.update(ready=False, reason="kafka auth failed, password=abc", state="bogus")
    status, body = get(url)
    assert status == 503
    payload = json.loads(body)
    assert payload["state"] == "running"  # details cannot override the lifecycle state
    assert payload["reason"] == "kafka auth failed, password=***"


def test_details_exception_is_503_with_redacted_error(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    def broken() -> dict[str, object]:
        raise RuntimeError("lost redis://:pw@r:6379")

    server = make_server(details=broken)
    lifecycle.set_running()
    base = f"http://127.0.0.1:{server.port}"
    for _ in range(3):
        status, body = get(base + "/healthz/ready")
        assert status == 503
        assert json.loads(body) == {
            "state": "running",
            "error": "RuntimeError: lost redis://:***@r:6379",
        }
    assert get(base + "/healthz/live")[0] == 200  # the server survived


def test_details_returning_a_non_dict_is_503(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    server = make_server(details=lambda: None)
    lifecycle.set_running()
    status, body = get(f"http://127.0.0.1:{server.port}/healthz/ready")
    assert status == 503
    assert "AttributeError" in json.loads(body)["error"]


def test_metrics_endpoint_and_unknown_path(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    server = make_server()
    base = f"http://127.0.0.1:{server.port}"
    status, text = get(base + "/metrics")
    assert status == 200
    assert "service_forced_shutdowns_total 0.0" in text
    assert 'service_state{service_state="starting"} 1.0' in text
    assert get(base + "/nope")[0] == 404


def test_metrics_follow_the_lifecycle(lifecycle: Lifecycle) -> None:
    registry = CollectorRegistry()
    lifecycle.attach_metrics(ServiceMetrics(registry, service="test"))
    lifecycle.set_running()
    assert registry.get_sample_value("service_state", {"service_state": "running"}) == 1
    assert registry.get_sample_value("service_draining") == 0
    lifecycle.drain()
    assert registry.get_sample_value("service_draining") == 1
    assert registry.get_sample_value("service_state", {"service_state": "draining"}) == 1
    assert registry.get_sample_value("service_state", {"service_state": "running"}) == 0
    lifecycle.set_stopped()
    duration = registry.get_sample_value("service_shutdown_duration_seconds")
    assert duration is not None and 0 <= duration < 5


def test_port_in_use_raises_dependency_error(lifecycle: Lifecycle) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = HealthServer(lifecycle, port=port, registry=CollectorRegistry())
        with pytest.raises(
            DependencyError, match=rf"health server cannot listen on 127.0.0.1:{port}"
        ):
            server.start()


def test_stop_is_idempotent_and_frees_the_port(lifecycle: Lifecycle) -> None:
    server = HealthServer(lifecycle, port=0, registry=CollectorRegistry())
    server.start()
    port = server.port
    server.stop()
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/live", timeout=2)


def test_service_runtime_wires_one_registry_through_every_piece() -> None:
    settings = RuntimeSettings(service="billing", node_id="pod-7", health_port=0)
    rt = ServiceRuntime.build(settings, logger=logging.getLogger("test"), details=lambda: {"x": 1})
    assert rt.supervisor.lifecycle is rt.lifecycle is rt.health.lifecycle
    assert rt.health.registry is rt.registry
    rt.health.start()
    try:
        rt.lifecycle.set_running()
        status, body = get(f"http://127.0.0.1:{rt.health.port}/healthz/ready")
        assert status == 200 and json.loads(body)["x"] == 1
        _, metrics = get(f"http://127.0.0.1:{rt.health.port}/metrics")
        assert 'service_info{service="billing"} 1.0' in metrics
    finally:
        rt.health.stop()


def _probe(port: int) -> tuple[float, int]:
    """One readiness probe as a kubelet makes it: a new connection, one request."""
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
    except TimeoutError:
        return time.monotonic() - start, 0
    return time.monotonic() - start, int(data.split(b" ", 2)[1])


def test_a_burst_of_probes_is_answered_beside_idle_connections(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    """100 concurrent probes while 20 idle connections are open: every probe is
    answered well within Kubernetes' default 1 s probe timeout. A full listen
    queue drops the connection attempt, which the client only repeats after 1 s
    (then 3 s...), so a backlog that is too short shows as probes over 1 s; and
    no probe may wait for an idle connection to time out (10 s here)."""
    server = make_server(idle_timeout=10.0)
    lifecycle.set_running()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    try:
        barrier = threading.Barrier(100)

        def probe() -> tuple[float, int]:
            barrier.wait()
            return _probe(server.port)

        with concurrent.futures.ThreadPoolExecutor(100) as pool:
            results = list(pool.map(lambda _: probe(), range(100)))
    finally:
        for sock in idle:
            sock.close()
    unanswered = sum(1 for _, status in results if status != 200)
    assert not unanswered, f"{unanswered} of 100 probes got no 200 within 20 s"
    slow = sorted(round(t, 2) for t, _ in results if t >= 0.9)
    assert not slow, f"{len(slow)} of 100 probes took 0.9 s or more: {slow}"


def test_an_idle_connection_is_closed_after_the_timeout(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    server = make_server(idle_timeout=0.5)
    threads_before = threading.active_count()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        start = time.monotonic()
        assert sock.recv(1) == b"", "the server closes the connection (EOF)"
        waited = time.monotonic() - start
        # a half-sent request is idle too
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as half:
            half.sendall(b"GET /healthz/ready HT")
            assert half.recv(4096) == b"", "closed without an answer"
    assert 0.4 <= waited < 5, waited
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before, "the connection's thread has ended"


#: The documented default cap on open connections (HealthServer(max_connections=...)).
_CAP = 128


def _closed(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (EOF or reset), without blocking.

    ``sock`` must be in blocking mode: with a timeout set, Python waits for data
    (up to the timeout) before the ``recv``, MSG_DONTWAIT or not."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slow_clients_are_capped_and_closed_at_the_request_deadline(
    lifecycle: Lifecycle, make_server: Callable[..., HealthServer]
) -> None:
    """200 clients that each send one byte every 0.25 s, never a whole request.
    A per-read timeout never fires for them: each would hold a thread for as
    long as it keeps sending. At most the cap is served (one thread each); the
    rest are closed at once and counted; every served one is closed at the
    1 s deadline however it trickles; probes are answered again afterwards."""
    server = make_server(idle_timeout=1.0)
    lifecycle.set_running()
    threads_before = threading.active_count()
    clients = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(200)]
    for sock in clients:
        sock.settimeout(None)  # see _closed
    peak = 0
    try:
        deadline = time.monotonic() + bound(10.0)
        open_ = list(clients)
        while open_ and time.monotonic() < deadline:
            peak = max(peak, threading.active_count() - threads_before)
            for sock in open_:
                with contextlib.suppress(OSError):
                    sock.send(b"G")
            time.sleep(0.25)
            open_ = [sock for sock in open_ if not _closed(sock)]
        assert not open_, (
            f"{len(open_)} trickling connections still open after {bound(10.0)} s, "
            f"served by up to {peak} threads"
        )
    finally:
        for sock in clients:
            sock.close()
    assert peak <= _CAP + 2, f"{peak} threads served 200 slow clients (cap {_CAP})"
    _, metrics = get(f"http://127.0.0.1:{server.port}/metrics")
    refused = _sample(metrics, "health_connections_refused_total")
    expired = _sample(metrics, "health_connections_expired_total")
    assert refused >= 200 - _CAP and expired >= 1, (refused, expired)
    assert _probe(server.port)[1] == 200
    end = time.monotonic() + bound(5.0)
    while threading.active_count() > threads_before and time.monotonic() < end:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before, "every connection's thread has ended"


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")
