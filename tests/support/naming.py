"""What a test module needs from the root conftest, importable by name.

Test modules cannot ``from conftest import ...``: with ``--import-mode=importlib``
and several conftests (tests/, tests/relay/, tests/consumer/, ...), the module
named ``conftest`` is whichever was imported last, so such an import fails or
succeeds by the order a worker collected the files in.
"""

from __future__ import annotations

import os
import uuid
from typing import NoReturn

import pytest

#: The suite runs under CI (``CI=true``, ``1`` or ``yes``): a missing service fails.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_service(reason: str) -> NoReturn:
    """Fail under CI, skip elsewhere."""
    if IN_CI:
        pytest.fail(f"service unavailable under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def unique_name(prefix: str = "t") -> str:
    """A name no other test of any run uses (databases, topics, groups)."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"
