"""Helpers for tests of code built on the runtime (public, like ``structlog.testing``)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from outboxkit.runtime import logs

__all__ = ["LogCapture", "capture_json_logs", "reset_logging"]


class LogCapture:
    """The JSON lines written while capturing, as text and as parsed objects."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    @property
    def records(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.text.splitlines() if line.strip()]

    def events(self, name: str) -> list[dict[str, object]]:
        """Records whose ``event`` is ``name``."""
        return [r for r in self.records if r.get("event") == name]


def reset_logging() -> None:
    """Forget registered secrets and remove the handler :func:`configure_logging` added."""
    logs._clear_secrets_for_tests()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logs._OutboxkitHandler):
            root.removeHandler(handler)
            handler.close()


@contextmanager
def capture_json_logs(
    *, level: str = "DEBUG", service: str = "test", node_id: str = "test-node"
) -> Iterator[LogCapture]:
    """Route all logging through the JSON formatter into memory for the block."""
    capture = LogCapture()
    root = logging.getLogger()
    old_level = root.level
    logs.configure_logging(level=level, service=service, node_id=node_id, stream=capture.stream)
    try:
        yield capture
    finally:
        for handler in list(root.handlers):
            if isinstance(handler, logs._OutboxkitHandler):
                root.removeHandler(handler)
                handler.close()
        root.setLevel(old_level)
