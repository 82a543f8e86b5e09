#!/usr/bin/env bash
# Local MariaDB for tests: mariadb.sh start|stop|status|kill [--name N] [--port P]
#                                            [--binlog on|off] [--buffer-pool-mb N]
#
# Every instance has its own datadir, socket and pid under .state/mariadb-<name>/,
# listens on 127.0.0.1 only and is tuned for test speed, not durability.
# After start: database outboxkit_test, user outboxkit/outboxkit with ALL on *.*.
#
# --binlog on: the binary log as production runs it (replication, backups,
# point-in-time recovery): log-bin, binlog_format=ROW, binlog_row_image=FULL.
# Default off.
# --buffer-pool-mb: InnoDB's buffer pool (default 256, enough for the tests; a
# benchmark's backlog and its copies need their working set in memory, as a
# production server is sized to hold it).
# The settings are remembered; changing them on an existing instance takes a
# stop and a start.
set -euo pipefail
SERVICE=mariadb
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

EXTRA_FLAGS=(binlog buffer-pool-mb)
parse_args "$@"
load_settings
PORT="${PORT:-3306}"
BINLOG="${BINLOG:-off}"
[[ "$BINLOG" == on || "$BINLOG" == off ]] || die "bad --binlog '$BINLOG' (on or off)"
BUFFER_POOL_MB="${BUFFER_POOL_MB:-256}"
[[ "$BUFFER_POOL_MB" =~ ^[0-9]+$ && "$BUFFER_POOL_MB" -ge 64 ]] ||
    die "bad --buffer-pool-mb '$BUFFER_POOL_MB' (64 or more)"

DATA_DIR="$INSTANCE_DIR/data"
SOCKET="$INSTANCE_DIR/mysqld.sock"
CNF="$INSTANCE_DIR/my.cnf"
LOG_FILE="$INSTANCE_DIR/mariadb.log"
PROC_MATCH="--defaults-file=$CNF"

root_sql() { mariadb --no-defaults --protocol=socket --socket="$SOCKET" -uroot "$@"; }

tcp_login_ok() {
    mariadb --no-defaults --protocol=tcp -h127.0.0.1 -P"$PORT" -uoutboxkit -poutboxkit \
        -e 'SELECT 1' outboxkit_test
}

binlog_config() {
    if [[ "$BINLOG" == on ]]; then
        printf '%s\n' "server_id = 1" "log-bin = $INSTANCE_DIR/binlog" \
            "binlog_format = ROW" "binlog_row_image = FULL"
    else
        echo "skip-log-bin"
    fi
}

write_config() {
    cat >"$CNF" <<EOF
[mysqld]
user = root
datadir = $DATA_DIR
socket = $SOCKET
pid-file = $INSTANCE_DIR/mariadbd.pid
port = $PORT
bind-address = 127.0.0.1
skip-name-resolve
$(binlog_config)
log-error = $LOG_FILE
character-set-server = utf8mb4
collation-server = utf8mb4_unicode_ci
max_connections = 500
performance_schema = OFF
# tests: speed over durability
innodb_flush_log_at_trx_commit = 2
innodb_doublewrite = 0
sync_binlog = 0
innodb_buffer_pool_size = ${BUFFER_POOL_MB}M
innodb_log_file_size = 64M
innodb_flush_method = O_DIRECT_NO_FSYNC
EOF
}

start() {
    if already_served tcp_login_ok; then
        return 0
    fi
    ensure_packages mariadb-server mariadb-client
    if instance_pid_alive; then
        detail "$NAME: process is up but not answering yet; waiting"
    else
        require_free_port "$PORT"
        mkdir -p "$INSTANCE_DIR"
        remember_settings PORT BINLOG BUFFER_POOL_MB
        write_config
        if [[ ! -d "$DATA_DIR/mysql" ]]; then
            detail "$NAME: initialising datadir $DATA_DIR"
            rm -rf "$DATA_DIR"
            mariadb-install-db --defaults-file="$CNF" --auth-root-authentication-method=socket \
                --skip-test-db >>"$INSTANCE_DIR/install-db.log" 2>&1 ||
                {
                    show_log_tail "$INSTANCE_DIR/install-db.log"
                    die "mariadb-install-db failed"
                }
        fi
        detail "$NAME: starting mariadbd on 127.0.0.1:$PORT"
        spawn_daemon "$INSTANCE_DIR/stdout.log" mariadbd --defaults-file="$CNF"
    fi
    if ! wait_for 60 "mariadb $NAME socket" root_sql -e 'SELECT 1'; then
        show_log_tail "$LOG_FILE"
        die "mariadb $NAME did not come up"
    fi
    root_sql <<'SQL'
CREATE DATABASE IF NOT EXISTS outboxkit_test CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci;
CREATE USER IF NOT EXISTS 'outboxkit'@'127.0.0.1' IDENTIFIED BY 'outboxkit';
CREATE USER IF NOT EXISTS 'outboxkit'@'localhost' IDENTIFIED BY 'outboxkit';
GRANT ALL PRIVILEGES ON *.* TO 'outboxkit'@'127.0.0.1' WITH GRANT OPTION;
GRANT ALL PRIVILEGES ON *.* TO 'outboxkit'@'localhost' WITH GRANT OPTION;
SQL
    wait_for 20 "mariadb $NAME TCP login" tcp_login_ok || die "TCP login as outboxkit failed"
    log "$NAME ready on 127.0.0.1:$PORT (pid $(read_pid))"
}

run_command 60 tcp_login_ok
