#!/usr/bin/env bash
# The benchmark's one command:   ./bench/run.sh [--smoke] [--database postgresql] [--binlog on|off]
#                                               [--wal-level replica|logical|tests]
#                                               [--scenario NAME] [--write-docs] [size flags]
#
# Starts the local services (deploy/local/up.sh; running ones are kept), then runs
# `python -m bench` with their addresses. `./bench/run.sh --help` lists the flags.
# Results: bench/results/<run id>.json and bench/results/latest.json.
#
# MariaDB as production runs it by default: a named instance "bench-binlog" on
# 127.0.0.1:3317 with the binary log on, row format, full row images, and a
# 2 GiB buffer pool that holds the run's backlog and its copies (a production
# server is sized to its working set; the tests' 256 MiB made the drains read
# from disk) (deploy/local/mariadb.sh --binlog on --buffer-pool-mb 2048),
# started here when not running.
# --binlog off runs on the tests' instance (binary log off), as every figure
# before round three was measured.
#
# PostgreSQL likewise: a named instance "bench-wal" on 127.0.0.1:5433 with
# wal_level replica (the server's default; --wal-level logical for logical
# decoding) and full_page_writes on (deploy/local/postgres.sh). --wal-level
# tests runs on the tests' instance (full_page_writes off), as every PostgreSQL
# figure before round three was measured. None of this applies with --db-url.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
needs_services=1
binlog=on
wal_level=replica
own_db=0
postgresql=0
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help | --list) needs_services=0 ;;
        --db-url | --db-url=*) own_db=1 ;;
        postgresql | --database=postgresql) postgresql=1 ;;
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
    if [[ "$1" == --wal-level ]]; then
        [[ $# -ge 2 && ("$2" == replica || "$2" == logical || "$2" == tests) ]] || {
            echo "bench/run.sh: --wal-level takes replica, logical or tests" >&2
            exit 2
        }
        wal_level="$2"
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
if [[ $needs_services -eq 1 && $own_db -eq 0 && $postgresql -eq 0 && "$binlog" == on ]]; then
    deploy/local/mariadb.sh start --name bench-binlog --port 3317 --binlog on \
        --buffer-pool-mb 2048 >&2
    OUTBOXKIT_TEST_DB_URL="mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3317/outboxkit_test"
fi
if [[ $needs_services -eq 1 && $own_db -eq 0 && $postgresql -eq 1 && "$wal_level" != tests ]]; then
    deploy/local/postgres.sh start --name bench-wal --port 5433 --wal-level "$wal_level" \
        --full-page-writes on >&2
    OUTBOXKIT_TEST_PG_URL="postgresql+psycopg://outboxkit:outboxkit@127.0.0.1:5433/outboxkit_test"
fi
export OUTBOXKIT_TEST_DB_URL OUTBOXKIT_TEST_PG_URL OUTBOXKIT_TEST_KAFKA_BOOTSTRAP OUTBOXKIT_TEST_REDIS_URL
# outboxkit comes from the install (pip install -e .); the root only serves `bench`.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO_ROOT"
exec "${PYTHON:-python3}" -m bench "$@"
