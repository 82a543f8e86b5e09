"""The first-run demo: an order service, two relays and a consumer, end to end.

``outboxkit demo`` runs it (see ``docs/demo.md``); :class:`OrderConsumer` is the
example consumer the compose file and the Kubernetes manifests run as
``outboxkit consume outboxkit.demo:OrderConsumer``.
"""

from outboxkit.demo.consumer import OrderConsumer
from outboxkit.demo.service import place_order

__all__ = ["OrderConsumer", "place_order"]
