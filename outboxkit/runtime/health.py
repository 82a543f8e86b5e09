"""The small HTTP port every process serves: liveness, readiness and metrics.

* ``GET /healthz/live``: 200 while the process is up (also while draining), 503
  once stopped. A failing live probe makes Kubernetes restart the pod, so it
  only fails when the process really is finished.
* ``GET /healthz/ready``: 200 only while ``running`` and ``details()`` does not
  say ``"ready": false``; 503 otherwise. The lifecycle state is read on every
  request, so readiness turns 503 the instant the drain starts.
* ``GET /metrics``: Prometheus text exposition of the given registry.

Requests are not logged (probes every few seconds would be chatter).

Each connection is served by its own thread. The listen queue holds
``LISTEN_BACKLOG`` connections (capped by the kernel's ``somaxconn``): with a
short queue a burst of probes overflows it, and a dropped connection attempt
is only repeated by the client after 1 s, Kubernetes' default probe timeout.

Connections are bounded in number and in time, whatever a client sends:

* at most ``max_connections`` (default 128) are open at once; one more is
  closed at once, unanswered, and counted
  (``health_connections_refused_total``);
* each is closed ``idle_timeout`` seconds (default 5) after it was accepted,
  answered or not, and counted if it was cut (``health_connections_expired_total``).
  This is a deadline for the whole connection, not a timeout per read: a
  client that sends one byte every few seconds never completes a request and
  is still closed on time. A probe is answered in milliseconds.

So slow or idle clients hold at most ``max_connections`` threads, each for at
most ``idle_timeout`` (plus the 0.2 s the server loop takes to notice).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from outboxkit.runtime.errors import DependencyError
from outboxkit.runtime.lifecycle import Lifecycle, State
from outboxkit.runtime.logs import log_event, redact, sanitize

__all__ = ["DEFAULT_IDLE_TIMEOUT", "DEFAULT_MAX_CONNECTIONS", "LISTEN_BACKLOG", "HealthServer"]

#: Connections the listen queue holds; the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = max(128, socket.SOMAXCONN)
#: Seconds a connection may stay open from its accept, answered or not.
DEFAULT_IDLE_TIMEOUT = 5.0
#: Connections open at once; more are closed at once. Probes and scrapes need a few.
DEFAULT_MAX_CONNECTIONS = 128

_log = logging.getLogger("outboxkit.runtime.health")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Rebind at once after a restart (sockets in TIME_WAIT); on Linux a second
    # listener on the same port is still refused, so "port in use" is detected.
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG
    health: HealthServer

    def process_request(self, request: Any, client_address: Any) -> None:
        # On the serving thread, before a handler thread exists: a connection
        # over the cap costs no thread.
        if not self.health._connections.admit(request):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.health._connections.release(request)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        # Called by serve_forever() every poll_interval (0.2 s).
        self.health._connections.expire()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (or was cut at its deadline): nothing to report


class _Connections:
    """The open connections and their deadlines; shared by the serving thread
    (admit, expire) and the handler threads (release)."""

    def __init__(self, *, limit: int, lifetime: float) -> None:
        self.limit = limit
        self.lifetime = lifetime
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        self.refused = 0
        self.expired = 0

    def admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if len(self._deadlines) >= self.limit:
                self.refused += 1
                return False
            self._deadlines[sock] = time.monotonic() + self.lifetime
            return True

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(sock, None)

    def expire(self) -> None:
        """Cut every connection past its deadline: ``shutdown()`` ends the read or
        write its handler thread waits in, and the thread closes it."""
        now = time.monotonic()
        # Under the lock: its thread releases a socket (with this lock) before it
        # closes it, so no socket is shut down while, or after, it is closed and
        # its descriptor reused.
        with self._lock:
            due = [sock for sock, deadline in self._deadlines.items() if deadline <= now]
            for sock in due:
                self._deadlines[sock] = math.inf  # cut once; released by its thread
                with contextlib.suppress(OSError):  # already closed by its client
                    sock.shutdown(socket.SHUT_RDWR)
            self.expired += len(due)

    def __len__(self) -> int:
        return len(self._deadlines)


class _ConnectionMetrics(Collector):
    """``health_connections_refused_total`` / ``health_connections_expired_total``."""

    def __init__(self, connections: _Connections) -> None:
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "health_connections_refused",
            "Connections to the health port closed at once: max_connections were open",
            value=self.connections.refused,
        )
        yield CounterMetricFamily(
            "health_connections_expired",
            "Connections to the health port cut at their deadline (idle_timeout after accept)",
            value=self.connections.expired,
        )


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "outboxkit"
    sys_version = ""

    def setup(self) -> None:
        # Each read or write waits at most idle_timeout; the connection's deadline
        # (_Connections.expire) bounds them all together.
        super().setup()
        self.connection.settimeout(self.server.health.idle_timeout)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: no per-request lines

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, *, head: bool) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        health = self.server.health
        try:
            if path == "/healthz/live":
                status, body = health.live()
                self._send_json(status, body, head=head)
            elif path == "/healthz/ready":
                status, body = health.ready()
                self._send_json(status, body, head=head)
            elif path == "/metrics":
                payload = generate_latest(health.registry)
                self._send(HTTPStatus.OK, payload, CONTENT_TYPE_LATEST, head=head)
            else:
                self._send_json(HTTPStatus.NOT_FOUND, {"error": "not found"}, head=head)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # never let one request take the server down
            health._note_error(exc)
            with contextlib.suppress(OSError):
                self._send_json(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    {"error": redact(f"{type(exc).__name__}: {exc}")},
                    head=head,
                )

    def _send_json(self, status: int, body: dict[str, object], *, head: bool) -> None:
        payload = (json.dumps(body, default=str) + "\n").encode()
        self._send(status, payload, "application/json", head=head)

    def _send(self, status: int, payload: bytes, content_type: str, *, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(payload)


class HealthServer:
    """Serves the probes and ``/metrics`` from a daemon thread."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        registry: CollectorRegistry,
        details: Callable[[], dict[str, object]] | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be > 0, got {idle_timeout!r}")
        if not max_connections >= 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        self.lifecycle = lifecycle
        self.idle_timeout = idle_timeout
        self._connections = _Connections(limit=max_connections, lifetime=idle_timeout)
        registry.register(_ConnectionMetrics(self._connections))
        self.host = host
        self._port = port
        self.registry = registry
        self.details = details
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    @property
    def port(self) -> int:
        """The bound port once started (``port=0`` picks a free one)."""
        return self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host  # noqa: S104
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    def start(self) -> None:
        """Bind and serve. Raises :class:`DependencyError` if the port cannot be bound."""
        if self._server is not None:
            return
        try:
            server = _Server((self.host, self._port), _Handler)
        except OSError as exc:
            raise DependencyError(
                f"health server cannot listen on {self.host}:{self._port} "
                f"(--health-host/--health-port): {exc.strerror or exc}"
            ) from exc
        server.health = self
        self._server = server
        self._port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="outboxkit-health",
            daemon=True,
        )
        self._thread.start()
        log_event(_log, "health-server-started", host=self.host, port=self._port)

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    # -- probe logic (also usable without HTTP) -------------------------------

    def live(self) -> tuple[int, dict[str, object]]:
        state = self.lifecycle.state
        status = HTTPStatus.SERVICE_UNAVAILABLE if state is State.STOPPED else HTTPStatus.OK
        return int(status), {"state": state.value}

    def ready(self) -> tuple[int, dict[str, object]]:
        state = self.lifecycle.state
        body: dict[str, object] = {"state": state.value}
        ok = state is State.RUNNING
        if self.details is not None:
            try:
                extra = self.details()
                vetoed = extra.get("ready") is False
            except Exception as exc:
                self._note_error(exc)
                body["error"] = redact(f"{type(exc).__name__}: {exc}")
                return int(HTTPStatus.SERVICE_UNAVAILABLE), body
            cleaned = sanitize(extra)
            if isinstance(cleaned, dict):
                for key, value in cleaned.items():
                    if key != "state":
                        body[key] = value
            if vetoed:
                ok = False
        status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
        return int(status), body

    def _note_error(self, exc: BaseException) -> None:
        # Log a failing details() once per distinct error, not once per probe.
        text = redact(f"{type(exc).__name__}: {exc}")
        if text != self._last_error:
            self._last_error = text
            log_event(_log, "health-details-failed", level=logging.WARNING, error=text)
