#!/usr/bin/env bash
# Stop every local service instance, default and named, that has state in .state/.
# Data stays on disk; delete deploy/local/.state for a clean slate.
# One line per stopped instance, unless --verbose (or VERBOSE=1).
set -euo pipefail
SERVICE=down
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

for arg in "$@"; do
    case "$arg" in
        -v | --verbose) export VERBOSE=1 ;;
        *) die "usage: $(basename "$0") [--verbose]" ;;
    esac
done

[[ -d "$STATE_DIR" ]] || exit 0

pids=()
for dir in "$STATE_DIR"/*-*/; do
    [[ -d "$dir" ]] || continue
    base="$(basename "$dir")"
    svc="${base%%-*}"
    name="${base#*-}"
    case "$svc" in
        mariadb | postgres | redis | kafka | pushgateway) ;;
        *) continue ;;
    esac
    # stop in parallel: Kafka and MariaDB each take a few seconds
    "$LOCAL_DIR/$svc.sh" stop --name "$name" >&2 &
    pids+=($!)
done

rc=0
for p in "${pids[@]}"; do
    wait "$p" || rc=1
done
exit $rc
