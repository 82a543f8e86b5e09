#!/usr/bin/env bash
# The chaos suite's one command:  ./chaos/run.sh [--smoke|--medium] [--seed N]
#                                   [--events N] [--keys N] [--duration S] [--keep]
#                                   [--database mariadb|postgresql] [--ownership redis|advisory]
#                                   [--kafka-brokers 1|3]
# Default: the full run (1,000,000 events, 10,000 keys, 3 relays, 2 consumers,
# >= 200 faults, about 30 minutes; with --kafka-brokers 3, a three-node Kafka cluster and its
# fault kinds, 500,000 events). Starts its own named MariaDB (or PostgreSQL), Kafka, Redis
# and Toxiproxy instances on free ports and removes them afterwards.
# Exit 0 when every check passed; 1 when one failed (evidence printed).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
# outboxkit comes from the install; chaos/.path serves `chaos` and `support` (tests/support).
export PYTHONPATH="$REPO_ROOT/chaos/.path${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$REPO_ROOT/chaos/.path"
ln -sfn "$REPO_ROOT/chaos" "$REPO_ROOT/chaos/.path/chaos"
ln -sfn "$REPO_ROOT/tests/support" "$REPO_ROOT/chaos/.path/support"
ln -sfn "$REPO_ROOT/bench" "$REPO_ROOT/chaos/.path/bench"  # dblog: what the database logs
# Not the checkout root: its outboxkit/ folder would shadow the installed package.
cd "$REPO_ROOT/chaos/.path"
exec "$PYTHON" -m chaos "$@"
