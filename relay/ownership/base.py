"""What every shard-ownership backend shares: held and target shards, claims, hand-over.

A backend (Redis leases, PostgreSQL advisory locks) knows how to take, keep and
give back a shard and how to see the live members. Everything between that and
the relay's claims is here, once, so a fix to the hand-over is made once:

* **State** under one lock: the shards held (one :class:`Held` record each, its
  ``surplus_since`` set while it waits to be handed over), the target shards of
  the current split, and the shards open ``claiming()`` blocks hold.
* **Claiming.** :meth:`ShardOwnershipBase.claiming` yields the held shards that
  are still targets and that the backend can prove (:meth:`_proof_locked`), and
  counts them as held by the block until it ends.
* **Rebalance.** :meth:`_follow` adopts a new live member set. Every relay
  computes the same split over it (:func:`assign_shards`: rendezvous hashing
  with quotas), so nobody coordinates; a change of this relay's targets is
  counted and logged (``rebalance``).
* **Hand-over.** A shard that is no longer a target stops being given to new
  blocks at once: the decision and the mark are made under the lock, with the
  clock read inside it, so a block either started before the mark (and holds
  the shard until it ends) or sees it. :meth:`_surplus_ready` offers it for
  release only once no open block holds it and ``inflight_shards()`` (where a
  block registers its rows before it ends) no longer contains it.
* **Metrics and log events**, under the same names for every backend; each
  backend adds its clock to the ``shard-*`` events (``redis_epoch_ms``, or
  ``db_epoch_ms``: the database server's clock, ms since the epoch). Shards
  taken or given back together are one line (``shard-acquired`` /
  ``shard-released`` with ``count`` and ``shards``, their ranges such as
  ``0-31,40``): a relay that starts or stops alone logs one line, not one
  per shard. ``shard-lost`` stays one line per shard (a warning, and rare).
* **The background thread** that drives the backend: its start and stop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from outboxkit.relay.assignment import assign_shards
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.logs import log_event
from outboxkit.schema.table import validate_identifier

__all__ = ["Held", "ShardOwnershipBase", "ShardOwnershipMetrics", "shard_ranges"]

#: Every backend logs under the name the first one did: log filters and
#: dashboards select the ownership events by it.
_log = logging.getLogger("outboxkit.relay.leases")


def shard_ranges(shards: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8`` (sorted, without repeats)."""
    parts: list[str] = []
    ordered = sorted(set(shards))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


class ShardOwnershipMetrics:
    """The shard-ownership metrics. The names are one contract for every backend
    (alert rules use them); a backend's subclass says in :attr:`HELP` what it
    counts."""

    #: The help of ``owned``, ``acquired`` and ``lost``, and of ``fenced`` for a
    #: backend that can be fenced (without it, no such gauge).
    HELP: ClassVar[Mapping[str, str]]

    def __init__(self, registry: CollectorRegistry, *, owned_gauge: bool = True) -> None:
        """``owned_gauge``: the relay keeps its own ``outbox_shards_owned`` (shards it
        may claim from) and passes False; standalone, the ownership keeps it."""
        help_ = self.HELP

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=registry)

        self.owned: Gauge | None = None
        if owned_gauge:
            self.owned = Gauge("outbox_shards_owned", help_["owned"], registry=registry)
        self.acquired = counter("outbox_shard_lease_acquired", help_["acquired"])
        self.lost = counter("outbox_shard_lease_lost", help_["lost"])
        self.handovers = counter(
            "outbox_shard_handovers",
            "Shards released to another relay after their in-flight rows were finished",
        )
        self.fenced: Gauge | None = None
        if "fenced" in help_:
            self.fenced = Gauge("outbox_shard_grants_fenced", help_["fenced"], registry=registry)
        self.rebalances = counter(
            "outbox_rebalances",
            "Changes of the live relay set that changed this relay's target shards",
        )


@dataclass(slots=True, kw_only=True)
class Held:
    """A shard this relay holds; a backend extends it with what it keeps per shard."""

    surplus_since: float | None = None  # monotonic; set when no longer a target


HeldT = TypeVar("HeldT", bound=Held)
#: How a backend names a live member (a node id, a server pid).
MemberT = TypeVar("MemberT")


def _always_proven(_held: Held) -> bool:
    return True


class ShardOwnershipBase(Generic[HeldT, MemberT]):
    """Implements :class:`~outboxkit.relay.shards.ShardOwnership` but for taking,
    keeping and giving back shards, which a backend adds.

    The caller claims inside :meth:`claiming` and registers the claimed rows in
    ``inflight_shards()`` before the block ends; that is the whole handshake.
    """

    #: The background thread is ``outboxkit-shard-{_thread_kind}-{table}``.
    _thread_kind: ClassVar[str]
    metrics: ShardOwnershipMetrics

    def __init__(
        self,
        *,
        table: str,
        node_id: str,
        shard_count: int,
        logger: logging.Logger | None,
        outbox: str | None,
    ) -> None:
        """``outbox``: the identity key the backend names its keys or locks by
        (without it, the bare ``table``, as older versions did). The backend
        sets ``metrics`` once its own settings are valid."""
        self.table = validate_identifier(table)
        if shard_count < 1:
            raise ConfigError(f"shard_count must be >= 1 (got {shard_count})")
        if not node_id:
            raise ConfigError("node_id must not be empty")
        self.node_id = node_id
        self.shard_count = shard_count
        self.outbox = outbox or self.table
        self.log = logger or _log
        self._lock = threading.Lock()
        self._held: dict[int, HeldT] = {}
        #: Shards held by open claiming() blocks (one count per block).
        self._claiming: dict[int, int] = {}
        self._members: tuple[MemberT, ...] = ()
        self._targets: frozenset[int] = frozenset()
        self._leaving = False
        self._inflight: Callable[[], frozenset[int]] = lambda: frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- ShardOwnership ------------------------------------------------------

    def claimable(self) -> frozenset[int]:
        """Shards a claim could use now (introspection; claims use :meth:`claiming`)."""
        with self._lock:
            return self._claimable_locked()

    def _claimable_locked(self) -> frozenset[int]:
        if self._leaving or not self._holding_locked():
            return frozenset()
        proven = self._proof_locked()
        return frozenset(s for s, h in self._held.items() if h.surplus_since is None and proven(h))

    @contextlib.contextmanager
    def claiming(self) -> Iterator[frozenset[int]]:
        """Claim from the yielded shards inside this block; register the claimed
        rows in ``inflight_shards()`` before it ends. None of these shards is
        handed over (or forgotten) while the block is open; a backend that loses
        the shards outright (an expired lease, a dead session) loses them regardless."""
        with self._lock:
            shards = self._claimable_locked()
            for s in shards:
                self._claiming[s] = self._claiming.get(s, 0) + 1
        try:
            yield shards
        finally:
            with self._lock:
                for s in shards:
                    n = self._claiming.pop(s) - 1
                    if n:
                        self._claiming[s] = n

    def release_all(self) -> None:
        """Leave: stop claiming and stop the background thread; a backend then
        gives its shards back."""
        self._stop_ticking()

    def close(self) -> None:
        self.release_all()

    # -- introspection (tests, health details) ---------------------------------

    @property
    def members(self) -> tuple[MemberT, ...]:
        """The live members the split was computed over, sorted: node ids with
        Redis leases, the server pids of the ownership sessions with advisory locks."""
        return self._members

    @property
    def targets(self) -> frozenset[int]:
        """The shards this relay's share of the split names."""
        return self._targets

    def held(self) -> frozenset[int]:
        """Shards this relay holds (claimable or being handed over)."""
        with self._lock:
            return frozenset(self._held) if self._holding_locked() else frozenset()

    def is_member(self, node_id: str) -> bool | None:
        """Whether ``node_id``'s relay shares this outbox's shards with this one;
        None while the backend cannot tell."""
        raise NotImplementedError

    # -- what a backend adds ---------------------------------------------------

    def _holding_locked(self) -> bool:
        """Whether the held shards are held at all right now (a backend whose holds
        end together, with a session, says False once it ended)."""
        return True

    def _proof_locked(self) -> Callable[[HeldT], bool]:
        """Whether a held shard is proven this relay's at this moment; read under the
        lock, once per claim."""
        return _always_proven

    def _busy_locked(self) -> bool:
        """Whether shards are changing hands, so the thread should tick sooner."""
        return any(h.surplus_since is not None for h in self._held.values()) or not (
            self._targets <= self._held.keys()
        )

    def _tick_seconds(self, busy: bool) -> float:
        """The pause before the next tick."""
        raise NotImplementedError

    def _owned_locked(self) -> int:
        """The ``outbox_shards_owned`` gauge's value."""
        return len(self._held) if self._holding_locked() else 0

    def _join_timeout(self) -> float:
        """How long stopping waits for the background thread."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Make the background thread see the stop flag now rather than after its pause."""

    # -- rebalance and hand-over ---------------------------------------------

    def _follow(self, members: tuple[MemberT, ...], me: str) -> None:
        """Adopt ``members`` (sorted) as the live member set, in which this relay is
        named ``me``: take its share of the split as the targets, and count and
        log a change of them."""
        if members == self._members:
            return
        targets = assign_shards(self.shard_count, [str(m) for m in members]).get(me, frozenset())
        self._members = members
        with self._lock:
            before = self._targets
            self._targets = targets
            held = frozenset(self._held)
        if targets == before:
            return
        self.metrics.rebalances.inc()
        log_event(
            self.log,
            "rebalance",
            table=self.table,
            members=list(members),
            live=len(members),
            target=len(targets),
            held=len(held),
            to_acquire=len(targets - held),
            to_hand_over=len(held - targets),
        )

    def _surplus_ready(self) -> dict[int, HeldT]:
        """Mark the held shards that are no longer targets (and unmark those that are
        again), and return those of them that may be let go now, by shard."""
        with self._lock:
            # The clock is read under the lock: a claiming() block either started
            # before the mark (and holds the shard until it ends) or sees it.
            now = time.monotonic()
            for shard, h in self._held.items():
                if shard not in self._targets and h.surplus_since is None:
                    h.surplus_since = now
                elif shard in self._targets and h.surplus_since is not None:
                    h.surplus_since = None  # the split changed back before we let go
            candidates = {
                s
                for s, h in self._held.items()
                if h.surplus_since is not None and s not in self._claiming
            }
        if not candidates:
            return {}
        # A block that ended registered its rows here first; a block that opens
        # from now on cannot be given these shards (they are marked).
        inflight = self._inflight()
        ready: dict[int, HeldT] = {}
        with self._lock:
            for shard in sorted(candidates - inflight):
                held = self._held.get(shard)
                if held is None or held.surplus_since is None or shard in self._claiming:
                    continue  # gone, a target again, or held by an open block
                ready[shard] = held
        return ready

    def _acquired(self, shards: list[int], **clock: int) -> None:
        """Shards taken together: counted, and logged as one ``shard-acquired``."""
        if not shards:
            return
        self.metrics.acquired.inc(len(shards))
        self._shards_event("shard-acquired", shards, reason=None, **clock)

    def _handed_over(self, shards: list[int], **clock: int) -> None:
        """Shards given back together to their next owners: one ``shard-released``."""
        if not shards:
            return
        self.metrics.handovers.inc(len(shards))
        self._shards_event("shard-released", shards, reason="handover", **clock)

    def _shards_event(
        self, event: str, shards: list[int], *, reason: str | None = None, **clock: int
    ) -> None:
        """One line for shards that changed hands together: ``count`` and ``shards``
        (their ranges, ``0-31,40``); ``tests/support/ownership.py`` reads it back."""
        fields: dict[str, Any] = {"count": len(shards), "shards": shard_ranges(shards)}
        if reason is not None:
            fields["reason"] = reason
        log_event(self.log, event, table=self.table, **fields, **clock)

    def _release_failed(self, shards: list[int], error: str, note: str) -> None:
        """Log that leaving could not give ``shards`` back; ``note`` says how they end."""
        log_event(
            self.log,
            "shard-release-failed",
            level=logging.WARNING,
            table=self.table,
            shards=shards,
            error=error,
            note=note,
        )

    def _event(
        self, event: str, shard: int, *, level: int = logging.INFO, **fields: object
    ) -> None:
        """Log a ``shard-*`` event of ``shard``."""
        log_event(self.log, event, level=level, table=self.table, shard=shard, **fields)

    def _set_owned_gauge(self) -> None:
        if self.metrics.owned is None:
            return
        with self._lock:
            self.metrics.owned.set(self._owned_locked())

    # -- the background thread -------------------------------------------------

    def _next_delay(self) -> float:
        with self._lock:
            busy = self._busy_locked()
        return self._tick_seconds(busy)

    def _start_thread(self, run: Callable[[], None]) -> None:
        self._thread = threading.Thread(
            target=run, name=f"outboxkit-shard-{self._thread_kind}-{self.table}", daemon=True
        )
        self._thread.start()

    def _stop_ticking(self) -> None:
        """Stop claiming, then stop the background thread."""
        with self._lock:
            self._leaving = True
        self._stop_thread()

    def _stop_thread(self) -> None:
        self._stop.set()
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._join_timeout())
        self._thread = None
