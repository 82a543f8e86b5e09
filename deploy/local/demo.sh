#!/usr/bin/env bash
# The first-run demo on a fresh Debian machine (no Docker):
#   ./deploy/local/demo.sh
# Installs the package, starts MariaDB, Kafka and Redis on loopback, applies the
# outbox schema and runs the demo: a service writing orders and their events in
# one transaction (see outboxkit/demo when it is there).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
PY="${PYTHON:-python3}"

"$PY" -m pip install -q --disable-pip-version-check -e . </dev/null >&2
eval "$(deploy/local/up.sh)"
# The demo keeps its own database, apart from the tests' one.
mariadb -h127.0.0.1 -uoutboxkit -poutboxkit -e "CREATE DATABASE IF NOT EXISTS outboxkit_demo"
export OUTBOXKIT_DB_URL="${OUTBOXKIT_TEST_DB_URL%/*}/outboxkit_demo"
export OUTBOXKIT_KAFKA_BOOTSTRAP="$OUTBOXKIT_TEST_KAFKA_BOOTSTRAP"
export OUTBOXKIT_REDIS_URL="$OUTBOXKIT_TEST_REDIS_URL"

"$PY" -m outboxkit schema apply
if "$PY" -m outboxkit demo --help >/dev/null 2>&1; then
    exec "$PY" -m outboxkit demo "$@"
fi
# Until the full demo exists: write a few orders and their events, then count them.
"$PY" - <<'PY'
import os

import sqlalchemy as sa

import outboxkit

engine = sa.create_engine(os.environ["OUTBOXKIT_DB_URL"])
with engine.begin() as conn:
    conn.execute(sa.text("CREATE TABLE IF NOT EXISTS demo_orders (id INT PRIMARY KEY, total INT)"))
    start = conn.execute(sa.text("SELECT COALESCE(MAX(id), 0) FROM demo_orders")).scalar_one()
for order_id in range(start + 1, start + 101):
    with engine.begin() as conn:  # the order and its event commit together
        conn.execute(sa.text("INSERT INTO demo_orders VALUES (:i, :t)"), {"i": order_id, "t": 10 * order_id})
        outboxkit.enqueue(conn, topic="orders", key=f"order-{order_id}",
                          payload={"order_id": order_id, "total": 10 * order_id})
with engine.connect() as conn:
    counts = dict(conn.execute(sa.text("SELECT status, COUNT(*) FROM outbox_events GROUP BY status")).all())
print(f"wrote 100 orders with their events; outbox rows by status: {counts}")
PY
