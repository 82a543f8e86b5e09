#!/usr/bin/env bash
# Local Prometheus Pushgateway: pushgateway.sh start|stop|status|kill [--name N] [--port P]
#
# Debian's prometheus-pushgateway on 127.0.0.1 (default 9091), in-memory only,
# pid and log under .state/pushgateway-<name>/.
set -euo pipefail
SERVICE=pushgateway
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

EXTRA_FLAGS=()
parse_args "$@"
load_settings
PORT="${PORT:-9091}"
LOG_FILE="$INSTANCE_DIR/pushgateway.log"
PROC_MATCH="--web.listen-address=127.0.0.1:$PORT"

ready() {
    # plain HTTP over /dev/tcp so curl is not required
    local reply
    reply="$(
        exec 3<>"/dev/tcp/127.0.0.1/$PORT" || exit 1
        printf 'GET /-/ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
        timeout 2 head -n1 <&3
    )" 2>/dev/null || return 1
    [[ "$reply" == *" 200 "* ]]
}

start() {
    if already_served ready; then
        return 0
    fi
    ensure_packages prometheus-pushgateway
    if ! instance_pid_alive; then
        require_free_port "$PORT"
        mkdir -p "$INSTANCE_DIR"
        remember_settings PORT
        detail "$NAME: starting pushgateway on 127.0.0.1:$PORT"
        # Debian's build defaults --persistence.file to
        # /var/lib/prometheus/pushgateway.data, one file for every instance on
        # the machine: a restarted instance would load groups pushed long ago.
        # An empty value keeps everything in memory.
        spawn_daemon "$LOG_FILE" prometheus-pushgateway \
            --web.listen-address="127.0.0.1:$PORT" --persistence.file= --log.level=warn
    fi
    if ! wait_for 20 "pushgateway $NAME" ready; then
        show_log_tail "$LOG_FILE"
        die "pushgateway $NAME did not come up"
    fi
    log "$NAME ready on 127.0.0.1:$PORT (pid $(read_pid))"
}

run_command 10 ready
