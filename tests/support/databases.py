"""Which databases a test runs on.

``db_url`` (and so ``engine`` and ``outbox``) is a MariaDB/MySQL database unless
the test is marked :data:`on_both_databases`: then it runs once per database,
with ids ``[mariadb]`` and ``[postgresql]``::

    from support.databases import on_both_databases

    pytestmark = [pytest.mark.integration, on_both_databases]  # a whole module
"""

from __future__ import annotations

import pytest

MARIADB = "mariadb"
POSTGRESQL = "postgresql"
#: ``db_url`` params; a test's ``request.node.callspec.params["db_url"]`` is one of them.
DATABASES = (MARIADB, POSTGRESQL)

#: Run the test (or, as ``pytestmark``, the module) on MariaDB and on PostgreSQL.
on_both_databases = pytest.mark.parametrize("db_url", DATABASES, indirect=True)
