"""Ambiguity about who shares an outbox's shards: detected and reported, never
silently accepted.

Ownership is named by the outbox's identity (:mod:`outboxkit.runtime.identity`),
so two outboxes never meet by accident. What naming cannot rule out is found by
looking, and reported here, one kind at a time:

* ``server``: a member of this outbox's Redis ownership is connected to another
  database server (its fingerprint differs). Two servers whose outboxes have the
  same database and table names share one Redis and prefix: each relay claims
  only its share of its own table, and the rest stalls. Or a failover is under
  way, and the episode ends by itself once every relay has reconnected.
* ``outsider``: a relay keeps claiming rows of this outbox but is not among the
  relays that share its shards: another ownership mode (one relay with
  ``--redis-url`` and one without, ``--shard-ownership`` set differently, another
  ``--redis-prefix``), or a relay of an older version with other key names. The
  two do not split shards: per-key order across them is no longer guaranteed.

Each kind is one log episode (``ownership-conflict`` at ERROR when it starts,
``ownership-conflict-resolved`` when it ends), the gauge
``outbox_ownership_conflicts{kind=...}`` (1 while it lasts), and an entry under
``ownership_conflicts`` in the readiness details. Readiness stays 200: the
relay still delivers what it owns, and taking every relay of the outbox out of
service would deliver nothing at all.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Gauge

from outboxkit.runtime.logs import Episode

__all__ = ["KINDS", "OwnershipConflicts"]

KINDS = ("server", "outsider")


class OwnershipConflicts:
    """The relay's record of ownership conflicts; thread-safe."""

    def __init__(self, registry: CollectorRegistry, logger: logging.Logger, *, outbox: str) -> None:
        self.outbox = outbox
        self.gauge = Gauge(
            "outbox_ownership_conflicts",
            "1 while this relay sees an ambiguity in who shares its outbox's shards "
            "(kind=server: a member on another database server; kind=outsider: a relay "
            "claiming rows outside this relay's ownership)",
            ["kind"],
            registry=registry,
        )
        self._lock = threading.Lock()
        self._episodes = {
            kind: Episode(
                logger, "ownership-conflict", "ownership-conflict-resolved", level=logging.ERROR
            )
            for kind in KINDS
        }
        self._details: dict[str, dict[str, object]] = {}
        for kind in KINDS:
            self.gauge.labels(kind=kind).set(0)

    def report(self, kind: str, key: object, **fields: object) -> None:
        """``kind`` is seen now; ``key`` tells one situation from another (a new key
        logs again, the same key does not)."""
        with self._lock:
            self._details[kind] = dict(fields)
            self._episodes[kind].begin(key, kind=kind, outbox=self.outbox, **fields)
        self.gauge.labels(kind=kind).set(1)

    def clear(self, kind: str) -> None:
        """``kind`` is no longer seen."""
        with self._lock:
            self._details.pop(kind, None)
            self._episodes[kind].end(kind=kind, outbox=self.outbox)
        self.gauge.labels(kind=kind).set(0)

    def details(self) -> dict[str, dict[str, object]]:
        """What is open now, by kind (for the readiness details)."""
        with self._lock:
            return {k: dict(v) for k, v in self._details.items()}
