#!/usr/bin/env bash
# Start the default local services (installing what is missing) and print the
# test environment on stdout:   eval "$(deploy/local/up.sh)"
# Everything else goes to stderr: one line per service and a total, unless
# --verbose (or VERBOSE=1). Safe to run again: running services are kept.
set -euo pipefail
SERVICE=up
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

for arg in "$@"; do
    case "$arg" in
        -v | --verbose) export VERBOSE=1 ;;
        *) die "usage: $(basename "$0") [--verbose]" ;;
    esac
done

# The default instances listen on fixed ports, shared by every checkout on this
# machine (worktrees, CI clones). Two up.sh at once, with nothing running yet,
# both started each service and one of them failed on a port the other had just
# bound; apt-get and the jar fetch would collide too. So one up.sh at a time per
# machine: the rest of this script runs under a lock held by flock(1) itself
# (-o: the services started below do not inherit it), and the next up.sh waits,
# then finds the services up ("started outside this checkout"). Quiet for the
# first OUTBOXKIT_LOCAL_UP_QUIET_WAIT seconds (10), so a wait behind a quick run
# prints nothing; bounded by OUTBOXKIT_LOCAL_UP_TIMEOUT (1800).
if [[ -z "${OUTBOXKIT_LOCAL_UP_LOCKED:-}" ]]; then
    export OUTBOXKIT_LOCAL_UP_LOCKED=1
    up_lock="${OUTBOXKIT_LOCAL_UP_LOCK:-/tmp/outboxkit-local-up.lock}"
    (umask 000 && : >>"$up_lock")
    busy=75 # flock's exit code when the wait ran out; up.sh itself never exits with it
    rerun=("$up_lock" "$BASH" "$0" "$@")
    rc=0
    flock -o -E "$busy" -w "${OUTBOXKIT_LOCAL_UP_QUIET_WAIT:-10}" "${rerun[@]}" || rc=$?
    if [[ $rc -eq $busy ]]; then
        log "waiting for another up.sh on this machine (lock $up_lock)"
        rc=0
        flock -o -E "$busy" -w "${OUTBOXKIT_LOCAL_UP_TIMEOUT:-1800}" "${rerun[@]}" || rc=$?
        [[ $rc -ne $busy ]] || die "another up.sh still holds $up_lock"
    fi
    exit "$rc"
fi

started=$(date +%s)

# One apt-get update + install for everything missing, so the per-service
# scripts below find their packages already there.
ensure_packages mariadb-server mariadb-client postgresql-15 redis-server redis-tools \
    prometheus-pushgateway prometheus
command -v java >/dev/null || ensure_packages openjdk-17-jre-headless
command -v mvn >/dev/null || ensure_packages maven

# Kafka's JVM start is the slowest part: run it alongside the others.
"$LOCAL_DIR/kafka.sh" start >&2 &
kafka_pid=$!

rc=0
"$LOCAL_DIR/mariadb.sh" start >&2 || rc=1
"$LOCAL_DIR/postgres.sh" start >&2 || rc=1
"$LOCAL_DIR/redis.sh" start >&2 || rc=1
"$LOCAL_DIR/pushgateway.sh" start >&2 || rc=1
wait "$kafka_pid" || rc=1
command -v promtool >/dev/null || { log "promtool missing after install"; rc=1; }
# The manifest tests render deploy/k8s with it; a failed install is reported
# here and fails those tests under CI, but leaves the services usable.
"$LOCAL_DIR/kustomize.sh" >&2 || log "kustomize could not be installed (deploy/local/kustomize.sh)"

if [[ $rc -ne 0 ]]; then
    die "some services failed to start (see above); logs are under $STATE_DIR"
fi
log "all services up in $(($(date +%s) - started))s"

cat <<'EOF'
export OUTBOXKIT_TEST_DB_URL=mysql+pymysql://outboxkit:outboxkit@127.0.0.1:3306/outboxkit_test
export OUTBOXKIT_TEST_PG_URL=postgresql+psycopg://outboxkit:outboxkit@127.0.0.1:5432/outboxkit_test
export OUTBOXKIT_TEST_KAFKA_BOOTSTRAP=127.0.0.1:9092
export OUTBOXKIT_TEST_REDIS_URL=redis://127.0.0.1:6379/0
export OUTBOXKIT_TEST_PUSHGATEWAY_URL=http://127.0.0.1:9091
EOF
