#!/usr/bin/env bash
# Local Redis for tests: redis.sh start|stop|status|kill [--name N] [--port P]
#
# redis-server daemonized on 127.0.0.1 (default 6379), no persistence, own dir,
# pid file and log under .state/redis-<name>/.
set -euo pipefail
SERVICE=redis
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

EXTRA_FLAGS=()
parse_args "$@"
load_settings
PORT="${PORT:-6379}"
LOG_FILE="$INSTANCE_DIR/redis.log"
# redis-server rewrites its process title to "redis-server <bind>:<port>"
PROC_MATCH="redis-server 127.0.0.1:$PORT"

ping() { [[ "$(redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null)" == "PONG" ]]; }

start() {
    if already_served ping; then
        return 0
    fi
    ensure_packages redis-server redis-tools
    if ! instance_pid_alive; then
        require_free_port "$PORT"
        mkdir -p "$INSTANCE_DIR"
        remember_settings PORT
        rm -f "$PID_FILE"
        detail "$NAME: starting redis-server on 127.0.0.1:$PORT"
        # redis-server daemonizes itself (and calls setsid) and writes the pid file.
        setsid redis-server --bind 127.0.0.1 --port "$PORT" --daemonize yes \
            --pidfile "$PID_FILE" --dir "$INSTANCE_DIR" --logfile "$LOG_FILE" \
            --save '' --appendonly no --protected-mode no --databases 16 \
            --maxclients 1000 </dev/null >&2
    fi
    if ! wait_for 20 "redis $NAME" ping; then
        show_log_tail "$LOG_FILE"
        die "redis $NAME did not come up"
    fi
    log "$NAME ready on 127.0.0.1:$PORT (pid $(read_pid))"
}

run_command 20 ping
