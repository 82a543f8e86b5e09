#!/usr/bin/env bash
# The benchmark's one command:   ./bench/run.sh [--smoke] [--database postgresql] [--scenario NAME] [--write-docs] [size flags]
#
# Starts the local services (deploy/local/up.sh; running ones are kept), then runs
# `python -m bench` with their addresses. `./bench/run.sh --help` lists the flags.
# Results: bench/results/<run id>.json and bench/results/latest.json.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
needs_services=1
for arg in "$@"; do
    case "$arg" in -h | --help | --list) needs_services=0 ;; esac
done
if [[ $needs_services -eq 1 && (-z "${OUTBOXKIT_TEST_DB_URL:-}" || -z "${OUTBOXKIT_TEST_PG_URL:-}" || -z "${OUTBOXKIT_TEST_KAFKA_BOOTSTRAP:-}") ]]; then
    eval "$(deploy/local/up.sh)"
fi
export OUTBOXKIT_TEST_DB_URL OUTBOXKIT_TEST_PG_URL OUTBOXKIT_TEST_KAFKA_BOOTSTRAP OUTBOXKIT_TEST_REDIS_URL
# outboxkit comes from the install (pip install -e .); the root only serves `bench`.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO_ROOT"
exec "${PYTHON:-python3}" -m bench "$@"
