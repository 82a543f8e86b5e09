#!/usr/bin/env bash
# Local Kafka broker for tests (KRaft, single node, broker+controller combined):
#   kafka.sh start|stop|status|kill [--name N] [--port P] [--controller-port C]
#                                   [--message-max-bytes B] [--heap H] [--sasl-port S]
#                                   [--proxied-port Q --proxied-advertised-port X]
#                                   [--node-id K --voters V --replication R --min-isr M
#                                    --replica-lag-ms L]
#
# --node-id and --voters make the instance one node of a cluster (see
# kafka-cluster.sh, which starts three): V is the static controller quorum,
# "1@127.0.0.1:C1,2@127.0.0.1:C2,3@127.0.0.1:C3", and every node of a cluster
# gets the same V. --replication R is the default replication factor of new
# topics and of the internal ones (offsets, transactions), --min-isr M their
# min.insync.replicas; unclean leader election stays off. --replica-lag-ms L is
# replica.lag.time.max.ms (Kafka's default 30 s), how long a silent follower
# stays in the ISR.
#
# --proxied-port adds a second listener (PROXIED) on Q that advertises port X:
# clients that bootstrap through a TCP proxy listening on X (forwarding to Q)
# then keep talking through the proxy, while PLAINTEXT on --port stays direct.
#
# --sasl-port S adds a SASL_PLAINTEXT (PLAIN) listener on S with an authorizer
# (StandardAuthorizer, deny when no ACL matches). Principals there: User:admin
# (password admin-secret, super user) and User:limited (password limited-secret,
# no ACLs until a test grants some). The PLAINTEXT port stays open to everyone
# as super user (User:ANONYMOUS), for the readiness check and test set-up. Test
# brokers only: the passwords are fixed and public.
#
# Jars come from Maven Central (kafka/pom.xml) into .kafka/lib on first use.
# Each instance has its own config, data dir, pid and log under .state/kafka-<name>/.
set -euo pipefail
SERVICE=kafka
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

EXTRA_FLAGS=(controller-port message-max-bytes heap sasl-port proxied-port proxied-advertised-port
    node-id voters replication min-isr replica-lag-ms)
parse_args "$@"
load_settings
PORT="${PORT:-9092}"
CONTROLLER_PORT="${CONTROLLER_PORT:-$((PORT + 1))}"
MESSAGE_MAX_BYTES="${MESSAGE_MAX_BYTES:-}"
HEAP="${HEAP:-512m}"
PROXIED_PORT="${PROXIED_PORT:-}"
PROXIED_ADVERTISED_PORT="${PROXIED_ADVERTISED_PORT:-$PROXIED_PORT}"
SASL_PORT="${SASL_PORT:-}"
NODE_ID="${NODE_ID:-1}"
VOTERS="${VOTERS:-}"
REPLICATION="${REPLICATION:-1}"
MIN_ISR="${MIN_ISR:-1}"
REPLICA_LAG_MS="${REPLICA_LAG_MS:-}"
[[ "$NODE_ID" =~ ^[0-9]+$ ]] || die "bad --node-id '$NODE_ID'"
[[ "$REPLICATION" =~ ^[1-9]$ ]] || die "bad --replication '$REPLICATION'"
[[ "$MIN_ISR" =~ ^[1-9]$ && "$MIN_ISR" -le "$REPLICATION" ]] ||
    die "bad --min-isr '$MIN_ISR' (1 to --replication)"

KAFKA_HOME="$LOCAL_DIR/.kafka"
LIB_DIR="$KAFKA_HOME/lib"
# Fixed cluster id (base64 of a UUID): no JVM start needed to generate one.
CLUSTER_ID="FOo1NcQuWAeQl6fJJtSeNA"
PROPS="$INSTANCE_DIR/server.properties"
LOG4J="$INSTANCE_DIR/log4j2.xml"
LOG_FILE="$INSTANCE_DIR/kafka.log"
DATA_DIR="$INSTANCE_DIR/data"
PROC_MATCH="kafka.Kafka $PROPS"

# Several starts at once (tests that start brokers of their own in parallel, on
# a checkout whose jars are not fetched yet) fetch once: the first takes the
# lock and fetches, the others wait for it and find the jars there. Without the
# lock each one emptied the folder and copied into it beside the others.
ensure_jars() {
    if [[ -f "$LIB_DIR/.complete" ]]; then
        return 0
    fi
    mkdir -p "$KAFKA_HOME"
    local lock_fd
    exec {lock_fd}>"$KAFKA_HOME/fetch.lock"
    flock -w "${KAFKA_FETCH_TIMEOUT:-900}" "$lock_fd" ||
        die "another kafka.sh still fetches the Kafka jars (lock $KAFKA_HOME/fetch.lock)"
    if [[ ! -f "$LIB_DIR/.complete" ]]; then
        fetch_jars
    fi
    exec {lock_fd}>&-
}

# Only under ensure_jars' lock: an unfinished folder (a fetch that died) is emptied first.
fetch_jars() {
    command -v java >/dev/null || ensure_packages openjdk-17-jre-headless
    command -v mvn >/dev/null || ensure_packages maven
    log "fetching Kafka jars with Maven (once; log: $KAFKA_HOME/mvn.log)"
    rm -rf "$LIB_DIR"
    mkdir -p "$LIB_DIR"
    if ! mvn -B -Dstyle.color=never -f "$LOCAL_DIR/kafka/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$LIB_DIR" </dev/null >"$KAFKA_HOME/mvn.log" 2>&1; then
        show_log_tail "$KAFKA_HOME/mvn.log" 60
        die "mvn could not fetch the Kafka jars (full log: $KAFKA_HOME/mvn.log)"
    fi
    touch "$LIB_DIR/.complete"
}

java_cmd() {
    command -v java >/dev/null || ensure_packages openjdk-17-jre-headless
    # shellcheck disable=SC2206
    JAVA=(java "-Xms${HEAP}" "-Xmx${HEAP}" -XX:+UseG1GC -XX:MaxGCPauseMillis=20
        -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
        "-Dlog4j2.configurationFile=$LOG4J" "-Dkafka.logs.dir=$INSTANCE_DIR"
        -cp "$LIB_DIR/*")
}

write_config() {
    local listeners="PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT"
    local advertised="PLAINTEXT://127.0.0.1:$PORT"
    local protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    if [[ -n "$PROXIED_PORT" ]]; then
        listeners+=",PROXIED://127.0.0.1:$PROXIED_PORT"
        advertised+=",PROXIED://127.0.0.1:$PROXIED_ADVERTISED_PORT"
        protocols+=",PROXIED:PLAINTEXT"
    fi
    if [[ -n "$SASL_PORT" ]]; then
        listeners+=",SASL_PLAINTEXT://127.0.0.1:$SASL_PORT"
        advertised+=",SASL_PLAINTEXT://127.0.0.1:$SASL_PORT"
        protocols+=",SASL_PLAINTEXT:SASL_PLAINTEXT"
    fi
    local quorum="controller.quorum.bootstrap.servers=127.0.0.1:$CONTROLLER_PORT"
    if [[ -n "$VOTERS" ]]; then
        quorum="controller.quorum.voters=$VOTERS"
    fi
    cat >"$PROPS" <<EOF
process.roles=broker,controller
node.id=$NODE_ID
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
listener.security.protocol.map=$protocols
inter.broker.listener.name=PLAINTEXT
$quorum
log.dirs=$DATA_DIR
num.partitions=3
default.replication.factor=$REPLICATION
auto.create.topics.enable=false
group.initial.rebalance.delay.ms=0
offsets.topic.replication.factor=$REPLICATION
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=$REPLICATION
transaction.state.log.min.isr=$MIN_ISR
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=$REPLICATION
share.coordinator.state.topic.min.isr=$MIN_ISR
min.insync.replicas=$MIN_ISR
unclean.leader.election.enable=false
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=24
log.segment.bytes=67108864
delete.topic.enable=true
# After a hard kill the restarted controller waits for the old broker session to
# expire before unfencing (default 9s); fault tests restart brokers often.
broker.heartbeat.interval.ms=500
broker.session.timeout.ms=4000
EOF
    if [[ -n "$REPLICA_LAG_MS" ]]; then
        echo "replica.lag.time.max.ms=$REPLICA_LAG_MS" >>"$PROPS"
    fi
    if [[ -n "$MESSAGE_MAX_BYTES" ]]; then
        echo "message.max.bytes=$MESSAGE_MAX_BYTES" >>"$PROPS"
    fi
    if [[ -n "$SASL_PORT" ]]; then
        cat >>"$PROPS" <<EOF
sasl.enabled.mechanisms=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_admin="admin-secret" user_limited="limited-secret";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:ANONYMOUS;User:admin
EOF
    fi
    cat >"$LOG4J" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <File name="file" fileName="$LOG_FILE" append="true">
      <PatternLayout pattern="[%d] %p %m (%c{1})%n"/>
    </File>
  </Appenders>
  <Loggers>
    <Logger name="kafka.server.KafkaRaftServer" level="INFO"/>
    <Logger name="kafka.server.BrokerServer" level="INFO"/>
    <Logger name="kafka.Kafka" level="INFO"/>
    <Root level="WARN"><AppenderRef ref="file"/></Root>
  </Loggers>
</Configuration>
EOF
}

broker_answers() {
    port_open "$PORT" || return 1
    # A metadata round trip proves the broker (not just the socket) is up.
    if python3 -c 'import confluent_kafka' 2>/dev/null; then
        python3 - "$PORT" <<'PY'
import sys
from confluent_kafka.admin import AdminClient

admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{sys.argv[1]}", "log_level": 0})
md = admin.list_topics(timeout=3)
sys.exit(0 if md.brokers else 1)
PY
    fi
}

start() {
    if already_served broker_answers; then
        return 0
    fi
    ensure_jars
    if instance_pid_alive; then
        detail "$NAME: process is up but not answering yet; waiting"
    else
        require_free_port "$PORT"
        require_free_port "$CONTROLLER_PORT"
        [[ -z "$PROXIED_PORT" ]] || require_free_port "$PROXIED_PORT"
        if [[ -n "$SASL_PORT" ]]; then
            require_free_port "$SASL_PORT"
        fi
        mkdir -p "$INSTANCE_DIR"
        remember_settings PORT CONTROLLER_PORT MESSAGE_MAX_BYTES HEAP SASL_PORT PROXIED_PORT \
            PROXIED_ADVERTISED_PORT NODE_ID VOTERS REPLICATION MIN_ISR REPLICA_LAG_MS
        write_config
        java_cmd
        if [[ ! -f "$DATA_DIR/meta.properties" ]]; then
            detail "$NAME: formatting storage in $DATA_DIR"
            rm -rf "$DATA_DIR"
            # A static quorum (--voters) is in the config; a single node forms its own.
            local standalone=(--standalone)
            [[ -z "$VOTERS" ]] || standalone=()
            "${JAVA[@]}" kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$PROPS" \
                "${standalone[@]}" >>"$INSTANCE_DIR/format.log" 2>&1 || {
                show_log_tail "$INSTANCE_DIR/format.log"
                die "kafka storage format failed"
            }
        fi
        detail "$NAME: starting broker on 127.0.0.1:$PORT (controller $CONTROLLER_PORT)"
        spawn_daemon "$INSTANCE_DIR/stdout.log" "${JAVA[@]}" kafka.Kafka "$PROPS"
    fi
    local deadline=$(($(date +%s) + ${KAFKA_START_TIMEOUT:-120}))
    until broker_answers >/dev/null 2>&1; do
        if ! instance_pid_alive; then
            show_log_tail "$LOG_FILE"
            show_log_tail "$INSTANCE_DIR/stdout.log" 20
            die "kafka $NAME exited during startup"
        fi
        if [[ $(date +%s) -ge $deadline ]]; then
            show_log_tail "$LOG_FILE"
            show_log_tail "$INSTANCE_DIR/stdout.log" 20
            die "kafka $NAME did not answer on 127.0.0.1:$PORT in time"
        fi
        sleep 0.3
    done
    log "$NAME ready on 127.0.0.1:$PORT (pid $(read_pid))"
}

run_command 30 broker_answers
