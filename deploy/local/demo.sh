#!/usr/bin/env bash
# The first-run demo on a fresh Debian machine (no Docker):   ./deploy/local/demo.sh [demo args]
# Installs the package, then `outboxkit demo` starts MariaDB, Kafka and Redis on
# loopback (deploy/local/up.sh), applies the schema in its own database, and runs
# an order service, two relays and the example consumer with live progress and
# a summary. Ctrl-C drains everything. See docs/demo.md.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
PY="${PYTHON:-python3}"

"$PY" -m pip install -q --disable-pip-version-check -e . </dev/null >&2
exec "$PY" -m outboxkit demo "$@"
