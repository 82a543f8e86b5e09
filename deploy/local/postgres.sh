#!/usr/bin/env bash
# Local PostgreSQL for tests: postgres.sh start|stop|status|kill [--name N] [--port P]
#                                   [--wal-level replica|logical] [--full-page-writes on|off]
#
# Debian's PostgreSQL 15 server binaries, run directly (no pg_ctlcluster, no
# systemd). Every instance has its own data directory, config and unix socket
# under .state/postgres-<name>/, listens on 127.0.0.1 only and is tuned for test
# speed, not durability. After start: database outboxkit_test owned by user
# outboxkit/outboxkit (CREATEDB, so tests can make their own databases).
#
# --wal-level: what the WAL records (replica, the server's default, or logical, as
# for logical decoding). --full-page-writes: off by default here (speed); on,
# as production runs it, the first change of a page after a checkpoint logs the
# whole page. Both are remembered; changing them takes a stop and a start.
#
# PostgreSQL refuses to run as root: as root, the server runs as the `postgres`
# system user (created by the Debian package) and owns the data directory.
set -euo pipefail
SERVICE=postgres
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PG_VERSION=15
PG_BIN="/usr/lib/postgresql/$PG_VERSION/bin"

EXTRA_FLAGS=(wal-level full-page-writes)
parse_args "$@"
load_settings
PORT="${PORT:-5432}"
WAL_LEVEL="${WAL_LEVEL:-replica}"
FULL_PAGE_WRITES="${FULL_PAGE_WRITES:-off}"
[[ "$WAL_LEVEL" == replica || "$WAL_LEVEL" == logical ]] ||
    die "bad --wal-level '$WAL_LEVEL' (replica or logical)"
[[ "$FULL_PAGE_WRITES" == on || "$FULL_PAGE_WRITES" == off ]] ||
    die "bad --full-page-writes '$FULL_PAGE_WRITES' (on or off)"

DATA_DIR="$INSTANCE_DIR/data"
# The socket directory must be writable by the server's user.
RUN_DIR="$INSTANCE_DIR/run"
CONF="$INSTANCE_DIR/postgresql.conf"
HBA="$INSTANCE_DIR/pg_hba.conf"
LOG_FILE="$INSTANCE_DIR/postgres.log"
PROC_MATCH="config_file=$CONF"

# The prefix that runs a command as the server's user. setpriv execs without
# forking, so the pid spawn_daemon records is the postmaster's.
AS_SERVER=()
if [[ $EUID -eq 0 ]]; then
    AS_SERVER=(setpriv --reuid=postgres --regid=postgres --init-groups --)
fi
as_server() { "${AS_SERVER[@]}" "$@"; }

# The superuser through the instance's own socket (mode 0700: only the server's
# user and root can reach it, so it trusts them without a password).
super_sql() {
    "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$RUN_DIR" -p "$PORT" -U postgres -d postgres "$@"
}

tcp_login_ok() {
    PGPASSWORD=outboxkit PGCONNECT_TIMEOUT=3 "$PG_BIN/psql" -X -q -w -h 127.0.0.1 -p "$PORT" \
        -U outboxkit -d outboxkit_test -c 'SELECT 1'
}

write_config() {
    cat >"$CONF" <<EOF
data_directory = '$DATA_DIR'
hba_file = '$HBA'
ident_file = '$DATA_DIR/pg_ident.conf'
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$RUN_DIR'
unix_socket_permissions = 0700
max_connections = 300
shared_buffers = 128MB
password_encryption = scram-sha-256
log_destination = 'stderr'
log_min_messages = warning
# tests: speed over durability, but a commit survives a crash of the server
# (not of the machine): COMMIT returns once the WAL is written to the OS, like
# MariaDB's innodb_flush_log_at_trx_commit = 2. With synchronous_commit = off
# a killed server forgot commits it had acknowledged, and fault tests that
# restart it saw consumers' effects vanish after their offsets were committed.
fsync = off
synchronous_commit = on
full_page_writes = $FULL_PAGE_WRITES
wal_level = $WAL_LEVEL
# The outbox is a queue: every status change leaves a dead row version and dead
# entries in the status indexes that the claim's scans step over until VACUUM
# removes them. The table asks to be vacuumed once 20,000 versions are dead
# (schema apply), but autovacuum looks at it only once per naptime: with the
# default of 1 minute a 1,000,000-row drain piled up 0.8-1 million of them and
# the claim slowed as they did; with 10 s they peaked at 138,000-187,000 and the
# claim's cost stayed flat (docs/postgresql.md, server settings).
autovacuum_naptime = 10s
EOF
    cat >"$HBA" <<'EOF'
# TYPE  DATABASE  USER  ADDRESS       METHOD
local   all       all                 trust
host    all       all   127.0.0.1/32  scram-sha-256
EOF
}

init_datadir() {
    detail "$NAME: initialising data directory $DATA_DIR"
    rm -rf "$DATA_DIR"
    mkdir -p "$DATA_DIR"
    chmod 700 "$DATA_DIR"
    [[ $EUID -ne 0 ]] || chown postgres:postgres "$DATA_DIR"
    as_server "$PG_BIN/initdb" -D "$DATA_DIR" -U postgres --auth=trust -E UTF8 \
        --locale=C.UTF-8 --no-sync >>"$INSTANCE_DIR/initdb.log" 2>&1 ||
        {
            show_log_tail "$INSTANCE_DIR/initdb.log"
            die "initdb failed"
        }
}

start() {
    if already_served tcp_login_ok; then
        return 0
    fi
    ensure_packages "postgresql-$PG_VERSION"
    if instance_pid_alive; then
        detail "$NAME: process is up but not answering yet; waiting"
    else
        require_free_port "$PORT"
        mkdir -p "$INSTANCE_DIR" "$RUN_DIR"
        if [[ $EUID -eq 0 ]]; then
            chown postgres:postgres "$RUN_DIR"
            as_server test -x "$INSTANCE_DIR" ||
                die "user postgres cannot enter $INSTANCE_DIR: every parent directory needs o+x"
        fi
        chmod 700 "$RUN_DIR"
        remember_settings PORT WAL_LEVEL FULL_PAGE_WRITES
        write_config
        [[ -f "$DATA_DIR/PG_VERSION" ]] || init_datadir
        detail "$NAME: starting postgres on 127.0.0.1:$PORT"
        spawn_daemon "$LOG_FILE" "${AS_SERVER[@]}" "$PG_BIN/postgres" -c "config_file=$CONF"
    fi
    if ! wait_for 60 "postgres $NAME socket" super_sql -c 'SELECT 1'; then
        show_log_tail "$LOG_FILE"
        die "postgres $NAME did not come up"
    fi
    super_sql <<'SQL'
SELECT 'CREATE ROLE outboxkit LOGIN CREATEDB' WHERE NOT EXISTS
    (SELECT FROM pg_roles WHERE rolname = 'outboxkit')\gexec
ALTER ROLE outboxkit WITH LOGIN CREATEDB PASSWORD 'outboxkit';
-- Lets the benchmark see autovacuum workers and the checkpointer in
-- pg_stat_activity (bench/activity.py); read-only statistics, nothing else.
GRANT pg_read_all_stats TO outboxkit;
SELECT 'CREATE DATABASE outboxkit_test OWNER outboxkit' WHERE NOT EXISTS
    (SELECT FROM pg_database WHERE datname = 'outboxkit_test')\gexec
SQL
    wait_for 20 "postgres $NAME TCP login" tcp_login_ok || die "TCP login as outboxkit failed"
    log "$NAME ready on 127.0.0.1:$PORT (pid $(read_pid))"
}

# A crash of the whole server: the postmaster and every backend (its process
# group), so a restart finds no backend still holding the shared memory.
crash() {
    local pid
    if pid="$(read_pid)" && pid_alive "$pid"; then
        log "$NAME: SIGKILL process group $pid"
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        while pid_alive "$pid"; do sleep 0.1; done
    fi
    rm -f "$PID_FILE"
}

case "$CMD" in
    # SIGTERM is PostgreSQL's "smart" shutdown, which waits for every client to
    # disconnect; SIGINT is the "fast" one (roll back, disconnect, checkpoint).
    stop) stop_instance 60 INT ;;
    kill) crash ;;
    *) run_command 60 tcp_login_ok ;;
esac
