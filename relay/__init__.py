"""The relay: moves outbox rows to Kafka at least once, in per-key order.

See ``docs/relay.md``. Run it with ``outboxkit relay`` or embed it::

    relay = Relay(load(RelaySettings))
    threading.Thread(target=relay.run).start()
    ...
    relay.stop()
"""

from outboxkit.relay.relay import PUSH_JOB, Relay
from outboxkit.relay.rows import Batch, ClaimedRow
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import AllShards, ShardOwnership
from outboxkit.relay.wakeup import PollWaker, Waker

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
