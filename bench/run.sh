#!/usr/bin/env bash
# The benchmark's one command:   ./bench/run.sh [--smoke] [--database postgresql] [--binlog on|off]
#                                               [--scenario NAME] [--write-docs] [size flags]
#
# Starts the local services (deploy/local/up.sh; running ones are kept), then runs
# `python -m bench` with their addresses. `./bench/run.sh --help` lists the flags.
# Results: bench/results/<run id>.json and bench/results/latest.json.
#
# MariaDB as production runs it by default: a named instance "bench-binlog" on
# 127.0.0.1:3317 with the binary log on, row format, full row images
# (deploy/local/mariadb.sh --binlog on), started here when not running.
# --binlog off runs on the tests' instance (binary log off), as every figure
# before round three was measured. Neither applies with --db-url or PostgreSQL.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
needs_services=1
binlog=on
own_db=0
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help | --list) needs_services=0 ;;
        --db-url | --db-url=* | postgresql | --database=postgresql) own_db=1 ;;
    esac
    if [[ "$1" == --binlog ]]; then
        [[ $# -ge 2 && ("$2" == on || "$2" == off) ]] || {
            echo "bench/run.sh: --binlog takes on or off" >&2
            exit 2
        }
        binlog="$2"
        shift 2
        continue
    fi
    args+=("$1")
    shift
done
set -- "${args[@]}"
if [[ $needs_services -eq 1 && (-z "${OUTBOXKIT_TEST_DB_URL:-}" || -z "${OUTBOXKIT_TEST_PG_URL:-}" || -z "${OUTBOXKIT_TEST_KAFKA_BOOTSTRAP:-}") ]]; then
    eval "$(deploy/local/up.sh)"
fi
if [[ $needs_services -eq 1 && $own_db -eq 0 && "$binlog" == on ]]; then
    deploy/local/mariadb.sh start --name bench-binlog --port 3317 --binlog on >&2
    OUTBOXKIT_TEST_DB_URL="mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3317/outboxkit_test"
fi
export OUTBOXKIT_TEST_DB_URL OUTBOXKIT_TEST_PG_URL OUTBOXKIT_TEST_KAFKA_BOOTSTRAP OUTBOXKIT_TEST_REDIS_URL
# outboxkit comes from the install (pip install -e .); the root only serves `bench`.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO_ROOT"
exec "${PYTHON:-python3}" -m bench "$@"
