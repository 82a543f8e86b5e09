"""``outboxkit topics ensure|check``: the Kafka topics the outbox writes, as
docs/operations.md recommends them.

``ensure`` creates each missing topic with ``--partitions``,
``--replication-factor`` and ``min.insync.replicas`` (``--min-insync-replicas``)
and checks each existing one against them; ``check`` only checks (a missing
topic is a difference). Running either again changes nothing. An existing
topic is never altered: a difference is printed with the command that fixes it,
and the exit code is 1, so a deploy step stops before the relay pauses the topic
or writes with weaker durability than intended.

What counts as a difference (more than asked is fine):

* fewer partitions than ``--partitions``;
* a partition with fewer replicas than ``--replication-factor``;
* ``min.insync.replicas`` below ``--min-insync-replicas``;
* ``unclean.leader.election.enable=true`` (a replica that missed writes may
  become leader and truncate acknowledged events away).

Exit codes: 0 every topic is as asked (created or found), 1 a topic differs,
2 bad settings or a topic Kafka refuses to create as asked (more replicas than
brokers), 3 Kafka unreachable.

The Kafka connection is the relay's: ``--kafka-bootstrap`` /
``OUTBOXKIT_KAFKA_BOOTSTRAP`` and ``--kafka-config`` / ``OUTBOXKIT_KAFKA_CONFIG``.
confluent-kafka is imported when the command runs, never when the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from outboxkit.runtime.exitcodes import EXIT_CONFIG, EXIT_DEPENDENCY, EXIT_OK
from outboxkit.runtime.logs import redact
from outboxkit.runtime.settings import (
    add_arguments,
    at_least_one,
    invalid,
    load,
    missing,
    positive,
    setting,
)

__all__ = ["EXIT_DIFFERS", "TopicSettings", "TopicState", "differences", "register"]

#: A topic is not as asked (``ensure`` and ``check``): each difference is printed.
EXIT_DIFFERS = 1

#: Kafka's answer when the topic exists already (``ensure`` racing another ``ensure``).
_ALREADY_EXISTS = "TOPIC_ALREADY_EXISTS"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopicSettings:
    """What the topics should be, and how to reach Kafka (the relay's settings)."""

    kafka_bootstrap: str | None = setting(None, help="Kafka bootstrap servers, host:port,...")
    kafka_config: dict[str, str] = setting(
        default_factory=dict,
        help="extra librdkafka property, one per flag, repeat it: --kafka-config "
        "security.protocol=SASL_SSL --kafka-config sasl.mechanism=PLAIN (the variable "
        "takes a comma list: security.protocol=SASL_SSL,sasl.mechanism=PLAIN)",
    )
    partitions: int = setting(
        6,
        help="partitions of a new topic, and the fewest an existing one may have",
        validate=at_least_one,
    )
    replication_factor: int = setting(
        3,
        help="replicas of each partition (3 in production; 1 on a single local broker)",
        validate=at_least_one,
    )
    min_insync_replicas: int = setting(
        2,
        help="min.insync.replicas of a new topic, and the lowest an existing one may have "
        "(2 in production; 1 on a single local broker)",
        validate=at_least_one,
    )
    request_timeout: float = setting(
        30.0, help="seconds to wait for each answer from Kafka", validate=positive
    )

    def validate(self) -> list[str]:
        problems = []
        if not (self.kafka_bootstrap or self.kafka_config.get("bootstrap.servers")):
            problems.append(missing("kafka_bootstrap"))
        if self.min_insync_replicas > self.replication_factor:
            problems.append(
                invalid(
                    "min_insync_replicas",
                    f"must be <= --replication-factor ({self.min_insync_replicas} > "
                    f"{self.replication_factor}): no acks=all write could ever succeed",
                )
            )
        return problems


@dataclasses.dataclass(frozen=True)
class TopicState:
    """What Kafka says of an existing topic."""

    partitions: int
    replication_factor: int  # the fewest replicas of any partition
    min_insync_replicas: int
    unclean_leader_election: bool


def differences(name: str, found: TopicState, want: TopicSettings) -> list[str]:
    """How ``found`` falls short of ``want``, one line each with its fix; empty if as asked."""
    out = []
    if found.partitions < want.partitions:
        out.append(
            f"{found.partitions} partitions, fewer than --partitions {want.partitions}: "
            f"kafka-topics.sh --alter --topic {name} --partitions {want.partitions} "
            "(keys move to other partitions: per-key order holds only for events "
            "written after the change; consumers should be caught up first)"
        )
    if found.replication_factor < want.replication_factor:
        out.append(
            f"replication factor {found.replication_factor}, below --replication-factor "
            f"{want.replication_factor}: add replicas with kafka-reassign-partitions.sh"
        )
    if found.min_insync_replicas < want.min_insync_replicas:
        out.append(
            f"min.insync.replicas={found.min_insync_replicas}, below --min-insync-replicas "
            f"{want.min_insync_replicas}: kafka-configs.sh --alter --entity-type topics "
            f"--entity-name {name} --add-config min.insync.replicas={want.min_insync_replicas}"
        )
    if found.unclean_leader_election:
        out.append(
            "unclean.leader.election.enable=true: an acknowledged event can be lost; "
            f"kafka-configs.sh --alter --entity-type topics --entity-name {name} "
            "--delete-config unclean.leader.election.enable"
        )
    return out


def _summary(state: TopicState | TopicSettings) -> str:
    return (
        f"{state.partitions} partitions, replication factor {state.replication_factor}, "
        f"min.insync.replicas={state.min_insync_replicas}"
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "topics",
        help="create the Kafka topics with the recommended settings, or check them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = p.add_subparsers(dest="topics_command", metavar="ACTION", required=True)
    for action, help_ in (
        ("ensure", "create missing topics, check existing ones (idempotent)"),
        ("check", "check topics, create nothing (a missing topic is a difference)"),
    ):
        ap = tsub.add_parser(action, help=help_, description=help_)
        ap.add_argument("topics", nargs="+", metavar="TOPIC", help="topic name")
        add_arguments(ap, TopicSettings)
        ap.set_defaults(func=_run, create=action == "ensure")


def _run(args: argparse.Namespace) -> int:
    from outboxkit.schema.codec import topic_problem

    settings = load(TopicSettings, args=args)
    names: list[str] = list(dict.fromkeys(args.topics))
    bad = [p for p in (topic_problem(n) for n in names) if p]
    if bad:
        for problem in bad:
            print(f"outboxkit topics: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    return _ensure(names, settings, create=bool(args.create))


def _admin(settings: TopicSettings) -> Any:
    from confluent_kafka.admin import AdminClient

    quiet = logging.getLogger("outboxkit.topics.librdkafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    config: dict[str, Any] = {"logger": quiet}
    if settings.kafka_bootstrap:
        config["bootstrap.servers"] = settings.kafka_bootstrap
    config.update(settings.kafka_config)
    return AdminClient(config)


def _ensure(names: Sequence[str], settings: TopicSettings, *, create: bool) -> int:
    from confluent_kafka import KafkaException

    where = settings.kafka_bootstrap or settings.kafka_config.get("bootstrap.servers", "")
    try:
        admin = _admin(settings)
        found = _describe(admin, names, settings.request_timeout)
        code = EXIT_OK
        for name in names:
            result = _one(admin, name, found.get(name), settings, create=create)
            if result not in (EXIT_OK, EXIT_DIFFERS):
                return result
            code = max(code, result)
    except KafkaException as exc:
        print(f"outboxkit topics: cannot reach Kafka at {where}: {_text(exc)}", file=sys.stderr)
        return EXIT_DEPENDENCY
    except ValueError as exc:  # a property librdkafka refuses
        print(f"outboxkit topics: {invalid('kafka_config', str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    return code


def _one(
    admin: Any, name: str, state: TopicState | None, settings: TopicSettings, *, create: bool
) -> int:
    """Create or check one topic, printing its line(s); its exit code."""
    if state is None and not create:
        print(f"{name}: missing (outboxkit topics ensure creates it)")
        return EXIT_DIFFERS
    if state is None:
        problem = _create(admin, name, settings)
        if problem is None:
            print(f"{name}: created: {_summary(settings)}")
            return EXIT_OK
        if "INVALID_REPLICATION_FACTOR" in problem:  # more replicas than brokers
            print(f"outboxkit topics: {invalid('replication_factor', problem)}", file=sys.stderr)
            return EXIT_CONFIG
        if _ALREADY_EXISTS not in problem:
            print(f"outboxkit topics: cannot create {name}: {problem}", file=sys.stderr)
            return EXIT_CONFIG
        # Created meanwhile by someone else: check it like any existing topic.
        state = _describe(admin, [name], settings.request_timeout).get(name)
        if state is None:
            print(f"outboxkit topics: {name} was created elsewhere and is gone again")
            return EXIT_DEPENDENCY
    wrong = differences(name, state, settings)
    for line in wrong:
        print(f"{name}: differs: {line}")
    if wrong:
        return EXIT_DIFFERS
    print(f"{name}: ok: {_summary(state)}")
    return EXIT_OK


def _describe(admin: Any, names: Sequence[str], timeout: float) -> dict[str, TopicState]:
    """The existing topics among ``names``, as Kafka describes them."""
    from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]

    metadata = admin.list_topics(timeout=timeout)
    present = [n for n in names if n in metadata.topics and metadata.topics[n].error is None]
    if not present:
        return {}
    resources = [ConfigResource("topic", n) for n in present]
    configs = admin.describe_configs(resources, request_timeout=timeout)
    out: dict[str, TopicState] = {}
    for resource, future in configs.items():
        entries = future.result(timeout=timeout)
        topic = metadata.topics[resource.name]
        out[resource.name] = TopicState(
            partitions=len(topic.partitions),
            replication_factor=min(len(p.replicas) for p in topic.partitions.values()),
            min_insync_replicas=int(entries["min.insync.replicas"].value),
            unclean_leader_election=str(entries["unclean.leader.election.enable"].value).lower()
            == "true",
        )
    return out


def _create(admin: Any, name: str, settings: TopicSettings) -> str | None:
    """Create ``name`` as asked; None when done, else Kafka's reason."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    topic = NewTopic(
        name,
        num_partitions=settings.partitions,
        replication_factor=settings.replication_factor,
        config={"min.insync.replicas": str(settings.min_insync_replicas)},
    )
    futures = admin.create_topics(
        [topic],
        operation_timeout=settings.request_timeout,
        request_timeout=settings.request_timeout,
    )
    try:
        futures[name].result(timeout=settings.request_timeout + 5)
    except KafkaException as exc:
        return _text(exc)
    return None


def _text(exc: Exception) -> str:
    """A Kafka exception as ``NAME: message`` (the error's own words), secrets masked."""
    err = exc.args[0] if exc.args else exc
    if hasattr(err, "name") and hasattr(err, "str"):
        return redact(f"{err.name()}: {err.str()}")
    return redact(str(exc))
