"""The consumer class of a run: ``outboxkit consume chaos.apps:EffectConsumer --inbox``.

Each message writes one row to the effect table through the inbox transaction
(``message.tx``), so the effect and the inbox row commit together. The effect
table has no unique key: an effect applied twice shows as two rows.

While the file named by ``CHAOS_SLOW_FILE`` exists, each message takes
``CHAOS_SLOW_S`` seconds (a slow handler for drain faults). While the file
named by ``CHAOS_TERM_AT_REVOKE_FILE`` exists, the consumer sends itself
SIGTERM as soon as partitions are revoked from it (and removes the file): the
``consumer-rebalance-drain`` fault, a drain that starts in the middle of a
cooperative rebalance, which a harness outside the process could not time.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import sqlalchemy as sa

from outboxkit.consumer import Consumer, Message

EFFECTS = "chaos_effects"

_INSERT = (
    f"INSERT INTO {EFFECTS} (event_id, msg_key, node_id, kafka_partition, kafka_offset, at)"
    " VALUES (:event_id, :key, :node, :partition, :offset, {now})"
)
#: The database's UTC clock, as the relay's records and the run's log lines use.
_NOW = {"postgresql": "(now() AT TIME ZONE 'utc')"}
_INSERTS = {
    "postgresql": sa.text(_INSERT.format(now=_NOW["postgresql"])),
    "mysql": sa.text(_INSERT.format(now="UTC_TIMESTAMP(6)")),
}


def create_effect_table(conn: sa.Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(
            sa.text(
                f"CREATE TABLE IF NOT EXISTS {EFFECTS} ("
                " id BIGSERIAL PRIMARY KEY,"
                " event_id VARCHAR(128) NOT NULL, msg_key VARCHAR(64) NULL,"
                " node_id VARCHAR(128) NOT NULL, kafka_partition INT NOT NULL,"
                " kafka_offset BIGINT NOT NULL,"
                " at TIMESTAMP(6) NOT NULL)"
            )
        )
        conn.execute(sa.text(f"CREATE INDEX IF NOT EXISTS effects_event ON {EFFECTS} (event_id)"))
        conn.execute(
            sa.text(
                f"CREATE INDEX IF NOT EXISTS effects_node ON {EFFECTS}"
                " (node_id, kafka_partition, at)"
            )
        )
        return
    conn.execute(
        sa.text(
            f"CREATE TABLE IF NOT EXISTS {EFFECTS} ("
            " id BIGINT AUTO_INCREMENT PRIMARY KEY,"
            " event_id VARCHAR(128) NOT NULL, msg_key VARCHAR(64) NULL,"
            " node_id VARCHAR(128) NOT NULL, kafka_partition INT NOT NULL,"
            " kafka_offset BIGINT NOT NULL,"
            " at DATETIME(6) NOT NULL,"
            " KEY (event_id), KEY (node_id, kafka_partition, at)) ENGINE=InnoDB"
        )
    )


class _TermAtRevoke(logging.Filter):
    def __init__(self, armed: str) -> None:
        super().__init__()
        self.armed = armed

    def filter(self, record: logging.LogRecord) -> bool:
        # The event name of outboxkit's structured records (outboxkit.runtime.logs).
        if getattr(record, "outboxkit_event", None) == "partitions-revoked":
            try:
                os.unlink(self.armed)
            except FileNotFoundError:
                return True
            os.kill(os.getpid(), signal.SIGTERM)
        return True


class EffectConsumer(Consumer):
    slow_file = os.environ.get("CHAOS_SLOW_FILE", "")
    slow_s = float(os.environ.get("CHAOS_SLOW_S", "0.3"))
    node = os.environ.get("OUTBOXKIT_NODE_ID", "consumer")

    def on_start(self) -> None:
        armed = os.environ.get("CHAOS_TERM_AT_REVOKE_FILE")
        if armed:
            logging.getLogger("outboxkit.consumer").addFilter(_TermAtRevoke(armed))

    def handle(self, message: Message) -> None:
        if self.slow_file and os.path.exists(self.slow_file):
            time.sleep(self.slow_s)
        tx = message.tx
        tx.execute(
            _INSERTS["postgresql" if tx.dialect.name == "postgresql" else "mysql"],
            {
                "event_id": message.event_id,
                "key": message.key.decode() if message.key else None,
                "node": self.node,
                "partition": message.partition,
                "offset": message.offset,
            },
        )
