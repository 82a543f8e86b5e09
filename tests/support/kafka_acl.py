"""A dedicated Kafka broker with an authorizer, and ACL helpers for fault tests.

Principals on its SASL listener (see ``deploy/local/kafka.sh --sasl-port``):
``limited`` starts with no ACLs; ``admin`` and anyone on the plain port are
super users, so tests set up topics and grants through :attr:`KafkaInstance.bootstrap`.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from support.services import KafkaInstance, free_ports


@contextmanager
def authz_kafka() -> Iterator[KafkaInstance]:
    """Start a fresh broker with an authorizer; stop and delete it afterwards."""
    port, controller, sasl = free_ports(3)
    kafka = KafkaInstance(f"authz-{uuid.uuid4().hex[:6]}", port, controller, sasl_port=sasl)
    kafka.start(fresh=True)
    try:
        yield kafka
    finally:
        kafka.stop()
        shutil.rmtree(kafka.state_dir, ignore_errors=True)


def create_topic(kafka: KafkaInstance, topic: str, partitions: int = 1) -> None:
    """Create ``topic`` on ``kafka``. A broker that a test froze or restarted just
    before may still be fenced by its controller (its session expired meanwhile):
    the creation fails with INVALID_REPLICATION_FACTOR ("All brokers are currently
    fenced") and is tried again until the broker is back (30 s at most)."""
    import tenacity
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    def fenced(exc: BaseException) -> bool:
        return (
            isinstance(exc, KafkaException)
            and exc.args[0].code() == KafkaError.INVALID_REPLICATION_FACTOR
        )

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for attempt in tenacity.Retrying(
        retry=tenacity.retry_if_exception(fenced),
        wait=tenacity.wait_fixed(0.5),
        stop=tenacity.stop_after_delay(30),
        reraise=True,
    ):
        with attempt:
            admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)


def grant(
    kafka: KafkaInstance, resource: str, name: str, operation: str, user: str = "limited"
) -> None:
    """ALLOW ``operation`` (``WRITE``, ``READ``...) on a ``TOPIC`` or ``GROUP`` named ``name``."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AclBinding,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    binding = AclBinding(
        ResourceType[resource],
        name,
        ResourcePatternType.LITERAL,
        f"User:{user}",
        "*",
        AclOperation[operation],
        AclPermissionType.ALLOW,
    )
    for fut in admin.create_acls([binding]).values():
        fut.result(timeout=30)
