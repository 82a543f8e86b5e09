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
        log "$NAME: starting redis-server on 127.0.0.1:$PORT"
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

stop() {
    local pid
    if pid="$(read_pid)" && pid_alive "$pid"; then
        log "$NAME: stopping pid $pid"
        stop_pid "$pid" 20
    fi
    rm -f "$PID_FILE"
}

status() {
    if instance_pid_alive && ping; then
        echo "redis $NAME running: pid $(read_pid), 127.0.0.1:$PORT"
        return 0
    fi
    if [[ "$NAME" == default ]] && port_open "$PORT" && ping >/dev/null 2>&1; then
        echo "redis $NAME running (started outside this checkout), 127.0.0.1:$PORT"
        return 0
    fi
    echo "redis $NAME not running"
    return 3
}

case "$CMD" in
    start) start ;;
    stop) stop ;;
    kill) kill_instance ;;
    status) status ;;
    *) die "unknown command $CMD (start|stop|status|kill)" ;;
esac
