"""The relay on MariaDB through mysqlclient (``mysql+mysqldb://``, the
``mysqlclient`` extra) as well as through PyMySQL, the default: a claim, a
finalize against a stale lease and a SIGTERM drain of the relay process, taken
from their own modules (which run them on PyMySQL) and run here on the C driver.

The lock-conflict and connection-loss errors each driver raises are read in
tests/runtime/test_db_errors.py, on every driver.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay
from support.databases import MARIADB_MYSQLDB
from test_claim import test_claim_cost_does_not_grow_with_delivered_history
from test_drain import test_sigterm_drains_releases_with_refund_and_restart_finishes
from test_finalize import test_stale_relay_cannot_finalize_or_release_reclaimed_rows as stale

pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize("db_url", (MARIADB_MYSQLDB,), indirect=True),
]

__all__ = [
    "test_claim_cost_does_not_grow_with_delivered_history",
    "test_sigterm_drains_releases_with_refund_and_restart_finishes",
]


def test_the_module_runs_on_the_c_driver(engine: sa.Engine) -> None:
    assert engine.dialect.driver == "mysqldb"


def test_stale_relay_cannot_finalize_or_release_reclaimed_rows(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    # Called, not imported under its name: there it carries its own database marks.
    stale(engine, db_url, outbox, kafka_bootstrap, kafka_topics, embedded)
