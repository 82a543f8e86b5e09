"""The relay: moves outbox rows to Kafka at least once, in per-key order.

See ``docs/relay.md``. Run it with ``outboxkit relay`` or embed it::

    relay = Relay(load(RelaySettings))
    threading.Thread(target=relay.run).start()
    ...
    relay.stop()
"""

from typing import TYPE_CHECKING

# Imported on first use (outboxkit._lazy): ``outboxkit relay --help`` and the
# other commands need the settings, not the relay with Kafka and Redis.
if TYPE_CHECKING:
    from outboxkit.relay.relay import PUSH_JOB, Relay
    from outboxkit.relay.rows import Batch, ClaimedRow
    from outboxkit.relay.settings import RelaySettings
    from outboxkit.relay.shards import AllShards, ShardOwnership
    from outboxkit.relay.wakeup import PollWaker, Waker
else:
    from outboxkit._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "outboxkit.relay.relay": ("PUSH_JOB", "Relay"),
            "outboxkit.relay.rows": ("Batch", "ClaimedRow"),
            "outboxkit.relay.settings": ("RelaySettings",),
            "outboxkit.relay.shards": ("AllShards", "ShardOwnership"),
            "outboxkit.relay.wakeup": ("PollWaker", "Waker"),
        },
    )

__all__ = [
    "PUSH_JOB",
    "AllShards",
    "Batch",
    "ClaimedRow",
    "PollWaker",
    "Relay",
    "RelaySettings",
    "ShardOwnership",
    "Waker",
]
