#!/usr/bin/env bash
# The first-run demo on a fresh Debian machine (no Docker):   ./deploy/local/demo.sh [demo args]
# Installs the package into the project's virtual environment (.venv/, made on
# the first run; PYTHON=... or an active virtual environment is used instead, see
# use_python in lib.sh), skipping the install when pyproject.toml is unchanged
# since the last one; then `outboxkit demo` starts MariaDB, Kafka and Redis on
# loopback (deploy/local/up.sh), applies the schema in its own database, and runs
# an order service, two relays and the example consumer with live progress and
# a summary. Ctrl-C drains everything. See docs/demo.md.
# Quiet set-up: pip's output goes to deploy/local/.state/pip.log (shown when it
# fails), or to stderr with VERBOSE=1.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
SERVICE=demo
# shellcheck source=lib.sh
source "$REPO_ROOT/deploy/local/lib.sh"

use_python
install_package . || exit 1
exec "$PY" -m outboxkit demo "$@"
