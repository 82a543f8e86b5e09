#!/usr/bin/env bash
# Local three-node Kafka cluster (KRaft, each node broker+controller, one static
# quorum of the three), as production runs Kafka: replication factor 3,
# min.insync.replicas=2, unclean leader election off.
#
#   kafka-cluster.sh start|stop|status|kill --name N --port P [--heap H]
#                    [--replica-lag-ms L] [--proxied-port Q] [--node K]
#
# Node K (1..3) is the kafka.sh instance "N-K": broker on 127.0.0.1:P+K-1,
# controller on P+3+K-1 (six consecutive ports from P). Without --node the
# command goes to every node (start and stop in parallel); with --node K only
# to that node, so one node can be stopped (SIGTERM), killed (SIGKILL) and
# started again on its own: it keeps its data and rejoins. Freeze a node with
# SIGSTOP/SIGCONT to the pid in .state/kafka-N-K/pid. `status` exits 0 only if
# every node (or node K) answers.
#
# --proxied-port Q gives node K a second listener on Q+K-1 that advertises
# Q+3+K-1 (six ports from Q): a TCP proxy (Toxiproxy) on Q+3+K-1 in front of
# Q+K-1 keeps the clients that bootstrap through the proxies behind them, as
# kafka.sh's --proxied-port does for one broker.
#
# Defaults: heap 320m per node, replica.lag.time.max.ms 30000 (Kafka's).
set -euo pipefail
SERVICE=kafka-cluster
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

EXTRA_FLAGS=(heap replica-lag-ms proxied-port node)
parse_args "$@"
[[ "$NAME" != default ]] || die "a cluster needs its own --name (its nodes are N-1, N-2, N-3)"
NODES=3
load_settings
[[ -n "$PORT" ]] || die "--port P is needed the first time (the cluster uses P..P+5)"
HEAP="${HEAP:-320m}"
REPLICA_LAG_MS="${REPLICA_LAG_MS:-30000}"
PROXIED_PORT="${PROXIED_PORT:-}"
[[ -z "$NODE" || "$NODE" =~ ^[1-3]$ ]] || die "bad --node '$NODE' (1, 2 or 3)"
[[ -z "$PROXIED_PORT" || "$PROXIED_PORT" =~ ^[0-9]+$ ]] || die "bad --proxied-port '$PROXIED_PORT'"

voters=""
for ((k = 1; k <= NODES; k++)); do
    voters+="${voters:+,}$k@127.0.0.1:$((PORT + NODES + k - 1))"
done

node_cmd() {
    local k="$1" cmd="$2" proxied=()
    if [[ -n "$PROXIED_PORT" ]]; then
        proxied=(--proxied-port "$((PROXIED_PORT + k - 1))"
            --proxied-advertised-port "$((PROXIED_PORT + NODES + k - 1))")
    fi
    "$LOCAL_DIR/kafka.sh" "$cmd" --name "$NAME-$k" --port "$((PORT + k - 1))" \
        --controller-port "$((PORT + NODES + k - 1))" --node-id "$k" --voters "$voters" \
        --replication 3 --min-isr 2 --replica-lag-ms "$REPLICA_LAG_MS" --heap "$HEAP" \
        "${proxied[@]}"
}

nodes=()
if [[ -n "$NODE" ]]; then
    nodes=("$NODE")
else
    for ((k = 1; k <= NODES; k++)); do nodes+=("$k"); done
fi

case "$CMD" in
    start)
        remember_settings PORT HEAP REPLICA_LAG_MS PROXIED_PORT
        # In parallel: a node answers only once a quorum of controllers is up.
        pids=()
        for k in "${nodes[@]}"; do
            node_cmd "$k" start &
            pids+=($!)
        done
        rc=0
        for p in "${pids[@]}"; do wait "$p" || rc=1; done
        [[ $rc -eq 0 ]] || die "cluster $NAME: a node did not start"
        log "$NAME ready: 127.0.0.1:$PORT,127.0.0.1:$((PORT + 1)),127.0.0.1:$((PORT + 2))"
        ;;
    stop | kill)
        pids=()
        for k in "${nodes[@]}"; do
            node_cmd "$k" "$CMD" &
            pids+=($!)
        done
        rc=0
        for p in "${pids[@]}"; do wait "$p" || rc=1; done
        exit $rc
        ;;
    status)
        rc=0
        for k in "${nodes[@]}"; do node_cmd "$k" status || rc=3; done
        exit $rc
        ;;
    *) die "unknown command $CMD (start|stop|status|kill)" ;;
esac
