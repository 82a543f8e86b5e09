"""``admin status --relay-url`` against a server that does not answer like a relay.

Whatever the server at the URL does (a body nested too deeply for the JSON
parser, a byte a second forever, megabytes of body, a status line that is not
HTTP), ``status`` reports that relay as unreadable with the reason, within its
deadline, and still reports the table: no traceback, no hang.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from support.waiting import bound

from outboxkit.admin.status import RelayView, read_relay

pytestmark = pytest.mark.integration

#: What docs/admin.md promises: a relay gets 5 s in total to answer.
RELAY_DEADLINE_S = 5.0

Serve = Callable[[socket.socket], None]


@pytest.fixture
def hostile() -> Iterator[Callable[[Serve], str]]:
    """``hostile(serve)``: a server on a free port that runs ``serve(conn)`` per connection."""
    stop = threading.Event()
    listeners: list[socket.socket] = []

    def start(serve: Serve) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.2)
        listeners.append(listener)

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                threading.Thread(target=_serve_then_close, args=(serve, conn), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    def _serve_then_close(serve: Serve, conn: socket.socket) -> None:
        try:
            conn.recv(65536)  # the request
            serve(conn)
        except OSError:
            pass
        finally:
            conn.close()

    yield start
    stop.set()
    for listener in listeners:
        listener.close()


def _answer(body: bytes, status: str = "200 OK") -> Serve:
    head = f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\n\r\n".encode()

    def serve(conn: socket.socket) -> None:
        conn.sendall(head + body)

    return serve


def _trickle(conn: socket.socket) -> None:
    """A byte every 0.2 s, forever: no read ever waits long enough to time out."""
    for byte in b"HTTP/1.0 200 OK\r\n" + b"X-Slow: " + b"a" * 100_000:
        conn.sendall(bytes([byte]))
        time.sleep(0.2)


def _read_within(url: str, seconds: float) -> RelayView:
    """``read_relay(url)`` on a thread; fails if it has not returned after ``seconds``."""
    views: list[RelayView] = []
    thread = threading.Thread(target=lambda: views.append(read_relay(url)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"read_relay still waiting after {seconds:g} s"
    assert views, "read_relay raised (see the thread's traceback above)"
    return views[0]


@pytest.mark.unit
def test_a_byte_a_second_relay_is_given_up_at_the_deadline(
    hostile: Callable[[Serve], str],
) -> None:
    view = _read_within(hostile(_trickle), bound(RELAY_DEADLINE_S + 10))
    assert view.error is not None and "within" in view.error, view
    assert view.state is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("serve", "reason"),
    [
        (_answer(b"[" * 200_000 + b"]" * 200_000), "not JSON"),
        (_answer(b'{"state": "' + b"x" * 3_000_000 + b'"}'), "larger than"),
        (lambda conn: conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n"), "not an HTTP answer"),
        (_answer(b"[" * 200_000, status="503 Service Unavailable"), "not JSON"),
    ],
    ids=["nested", "huge", "not-http", "nested-503"],
)
def test_a_hostile_answer_is_a_clean_error(
    hostile: Callable[[Serve], str], serve: Serve, reason: str
) -> None:
    view = _read_within(hostile(serve), bound(RELAY_DEADLINE_S + 10))
    assert view.error is not None and reason in view.error, view


def test_status_reports_the_table_and_the_unreadable_relay(
    admin: Callable[..., object], outbox: str, hostile: Callable[[Serve], str]
) -> None:
    nested = hostile(_answer(b"[" * 200_000 + b"]" * 200_000))
    res = admin("status", "--relay-url", nested)
    assert res.code == 0, res.err  # type: ignore[attr-defined]
    assert "Traceback" not in res.err  # type: ignore[attr-defined]
    assert f"relay {nested}: unreachable (readiness body is not JSON" in res.out  # type: ignore[attr-defined]
