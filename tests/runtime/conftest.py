from __future__ import annotations

from collections.abc import Iterator

import pytest

from outboxkit.runtime.testing import reset_logging


@pytest.fixture(autouse=True)
def _clean_logging() -> Iterator[None]:
    # Registered secrets are process-wide; one test's secrets must not mask another's output.
    reset_logging()
    yield
    reset_logging()
