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
#: MariaDB through the C driver (``mysql+mysqldb://``, the ``mysqlclient`` extra)
#: instead of PyMySQL, the default.
MARIADB_MYSQLDB = "mariadb-mysqldb"
#: ``db_url`` params; a test's ``request.node.callspec.params["db_url"]`` is one of them.
DATABASES = (MARIADB, POSTGRESQL)

#: Run the test (or, as ``pytestmark``, the module) on MariaDB and on PostgreSQL.
on_both_databases = pytest.mark.parametrize("db_url", DATABASES, indirect=True)

#: Run the test on every database and MySQL driver.
on_every_driver = pytest.mark.parametrize(
    "db_url", (MARIADB, MARIADB_MYSQLDB, POSTGRESQL), indirect=True
)


def with_mysqldb(url: str) -> str:
    """The same MySQL/MariaDB URL through mysqlclient (``mysql+mysqldb://``)."""
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    return parsed.set(drivername=f"{parsed.get_backend_name()}+mysqldb").render_as_string(
        hide_password=False
    )
