"""A TCP proxy a test can cut and restore at once, for a broker that must look
gone (connections refused) and come back within a fraction of a second, where
stopping and starting the real process would take seconds::

    with TcpProxy(listen_port, upstream_port) as proxy:
        proxy.cut()      # live connections closed, new ones closed at once
        proxy.restore()  # new connections are forwarded again
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Self

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, listen_port: int, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.listen_port = listen_port
        self.upstream = (host, upstream_port)
        self._host = host
        self._up = True
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self._host, self.listen_port))
        server.listen(64)
        self._server = server
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        self.cut()
        if self._thread is not None:
            self._thread.join(5)

    def cut(self) -> None:
        """Close every live connection; new ones are closed as soon as accepted."""
        with self._lock:
            self._up = False
            live, self._live = self._live, set()
        for s in live:
            _close(s)

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def _accept(self) -> None:
        while self._server is not None:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                up = self._up
            if not up:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._live.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._live.discard(src)
                self._live.discard(dst)
            _close(src)
            _close(dst)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
