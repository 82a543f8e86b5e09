"""Shard leases in Redis: each shard served by one relay at a time, shared fairly.

Per-key order across relays rests on one rule: a shard (and so every key hashed
to it) is claimed from by at most one relay at a time. :class:`RedisShardLeases`
implements :class:`~outboxkit.relay.shards.ShardOwnership` with Redis, on
:class:`~outboxkit.relay.ownership.base.ShardOwnershipBase` (the held and target
shards, ``claiming()``, the rebalance and the hand-over); this module adds the
leases themselves:

* **Names** carry the outbox's identity, read from the database
  (:mod:`outboxkit.runtime.identity`: ``orders.outbox_events`` on MySQL,
  ``orders.public.outbox_events`` on PostgreSQL), so two outboxes sharing one
  Redis and prefix never share a member set or a lease, whatever their tables
  are called. The database server is not in the name (a failover must not
  split ownership); each member records its server's fingerprint in
  ``{prefix}outboxkit:{outbox}:servers``, and a relay that finds a member on
  another server reports it (:mod:`outboxkit.relay.conflicts`).
* **Lease** per shard: key ``{prefix}outboxkit:{outbox}:shard:{n}`` holding
  ``node_id:token`` with a PX TTL, taken with ``SET NX PX``. Renewal (PEXPIRE)
  and release (DEL) run as Lua compare-and-set on the exact value, so a relay
  never extends or deletes a lease it cannot prove is its own.
* **Proof of ownership** is local: a shard is claimable only while
  ``now < t + ttl - safety_margin``, where ``t`` is the moment the last
  successful acquire or renew command was *sent* (Redis starts the TTL later,
  so the local deadline always falls first). The margin is one renew period
  plus the relay's batch budget: a relay that cannot renew stops claiming early
  enough for its last batch to finish before the lease can expire. The
  deadline is kept twice, on the monotonic clock and on the wall clock, and
  both must hold. The monotonic clock alone misses a pause of the whole
  virtual machine (a snapshot, a live migration) where it stands still while
  Redis's TTLs, on Redis's clock, run out: on resume the wall clock has been
  set forward and ends the proof, before another relay that took the shard
  meanwhile and this one could both claim from it. A wall clock set back
  changes nothing (the monotonic deadline still holds); one set forward by
  more than what is left of a proof only stops claims until the next renewal
  proves the lease again.
* **Membership**: a sorted set ``{prefix}outboxkit:{outbox}:members`` scored with
  each relay's heartbeat expiry (Redis server time). Every relay computes the
  same deterministic split of shards over the live members
  (:func:`~outboxkit.relay.assignment.assign_shards`: rendezvous hashing with
  quotas, every member gets ``floor`` or ``ceil`` of ``shards / members``), so
  nobody coordinates.
* **Handover**: the loop claims inside ``with leases.claiming() as shards:``;
  a shard that is no longer this relay's target is released (CAS) once the
  base offers it (no open block holds it and ``inflight_shards()`` no longer
  contains it). A shard whose renewal failed is forgotten under the same
  condition.
* **Dead relay**: its heartbeat expires just after its leases (both carry the
  same TTL, the renewals are sent first), so a survivor that sees it gone finds
  the leases free and takes the shards within one renew period after the TTL.
* **Redis down**: renewals fail, deadlines pass, :meth:`claimable` shrinks to
  nothing; the renewal thread keeps trying and everything resumes on its own.
  A lease that still carries our value after the outage is renewed (nobody else
  can have held it); one that is gone or taken is dropped and re-acquired.

* **Upgrade from names without the identity.** Older relays name everything
  by the bare table (``{prefix}outboxkit:{table}:...``). While that legacy
  member set has live members, every lease this relay takes also takes the
  legacy lease key of the shard (same value and TTL, in one script; see
  :mod:`outboxkit.relay.lease_scripts`) and keeps it until released: an older
  relay and this one never hold a shard at once. Once no older relay is live,
  new leases are taken without it.

Without Redis one relay owns every shard (:class:`~outboxkit.relay.shards.AllShards`);
:class:`~outboxkit.relay.foreign.ForeignRelayMonitor` notices a second relay on
the same table and says loudly that per-key order is no longer guaranteed.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import redis
import tenacity
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from outboxkit.relay.conflicts import OwnershipConflicts
from outboxkit.relay.lease_scripts import ACQUIRE_LUA, HEARTBEAT_LUA, RELEASE_LUA, RENEW_LUA
from outboxkit.relay.ownership.base import Held, ShardOwnershipBase, ShardOwnershipMetrics
from outboxkit.runtime.errors import ConfigError, DependencyError
from outboxkit.runtime.logs import Episode, log_event, redact
from outboxkit.runtime.rediskeys import lease_key, members_key, servers_key

__all__ = ["LeaseSettings", "RedisShardLeases", "ShardLeaseMetrics"]

# Tick faster than the renew period while a handover or an acquisition is
# pending, so shards change hands in a fraction of a second, not a period.
_FAST_TICK_S = 0.25


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseSettings:
    """Timing of shard leases.

    ``batch_budget`` is the longest a claimed batch may take until it is
    finalized or released (the relay's batch deadline plus finalize time). A
    shard stops being claimable ``renew_interval + batch_budget`` before the
    lease could expire, so ``ttl`` must exceed ``2 * renew_interval + batch_budget``.
    """

    ttl: float = 15.0
    renew_interval: float = 2.5
    batch_budget: float = 5.0
    prefix: str = ""
    redis_timeout: float | None = None

    @property
    def safety_margin(self) -> float:
        return self.renew_interval + self.batch_budget

    @property
    def command_timeout(self) -> float:
        if self.redis_timeout is not None:
            return self.redis_timeout
        return max(0.2, min(2.0, self.renew_interval / 2))

    def validate(self) -> None:
        errors: list[str] = []
        for name in ("ttl", "renew_interval", "batch_budget"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                errors.append(f"shard lease {name} must be a finite number > 0 (got {value!r})")
        if not errors and self.ttl - self.safety_margin <= self.renew_interval:
            errors.append(
                f"shard lease ttl ({self.ttl:g} s) must exceed 2 x renew interval "
                f"({self.renew_interval:g} s) + batch budget ({self.batch_budget:g} s), "
                "or a relay would stop claiming between two renewals"
            )
        if errors:
            raise ConfigError("; ".join(errors), errors=errors)


class ShardLeaseMetrics(ShardOwnershipMetrics):
    """The shard-ownership metrics of Redis leases, registered on the relay's registry."""

    HELP: ClassVar[Mapping[str, str]] = {
        "owned": "Shards whose lease this relay holds and can prove (renewed in time)",
        "acquired": "Shard leases acquired (SET NX succeeded)",
        "lost": "Shard leases lost: taken or expired in Redis, or unproven past the safety "
        "deadline",
        "fenced": "1 while no shard lease is taken because Redis has been up for less than "
        "the lease TTL (a restart may have forgotten leases others still believe in)",
    }


@dataclass(slots=True, kw_only=True)
class _Lease(Held):
    value: str
    valid_until: float  # monotonic; claimable before this
    wall_until: float  # wall clock (time.time()); and before this
    unproven: bool = False  # the deadline passed without a successful renew
    companion: bool = False  # the legacy lease key is held too (older relays live)


def _proven(h: _Lease, now: float, wall: float) -> bool:
    """Whether ``h`` is proven ours at monotonic ``now`` and wall clock ``wall``."""
    return now < h.valid_until and wall < h.wall_until


@dataclass(slots=True)
class _Lost:
    since: float  # monotonic; not claimable from this moment on


class RedisShardLeases(ShardOwnershipBase[_Lease, str]):
    """Shard ownership through Redis leases; see the module docstring.

    The caller claims inside :meth:`claiming` and registers the claimed rows in
    ``inflight_shards()`` before the block ends; that is the whole handshake.
    """

    _thread_kind = "leases"

    def __init__(
        self,
        redis_client: str | redis.Redis[bytes],
        *,
        table: str,
        node_id: str,
        shard_count: int,
        settings: LeaseSettings | None = None,
        registry: CollectorRegistry | None = None,
        owned_gauge: bool = True,
        logger: logging.Logger | None = None,
        outbox: str | None = None,
        fingerprint: str | None = None,
        conflicts: OwnershipConflicts | None = None,
    ) -> None:
        """``outbox``: the identity key the names carry (the relay passes the one it
        read from the database; without it, the bare ``table``, as older
        versions named it). ``fingerprint``: the database server this relay
        is connected to, recorded beside its membership (None: unknown, never
        compared). ``conflicts``: where a member on another server is
        reported."""
        super().__init__(
            table=table, node_id=node_id, shard_count=shard_count, logger=logger, outbox=outbox
        )
        #: The names older relays of this outbox use, when they differ from ours.
        self._legacy = self.table if self.outbox != self.table else None
        self._legacy_members: frozenset[str] = frozenset()
        self.fingerprint = fingerprint
        self.conflicts = conflicts
        self.settings = settings or LeaseSettings()
        self.settings.validate()
        self.metrics = ShardLeaseMetrics(registry or CollectorRegistry(), owned_gauge=owned_gauge)
        timeout = self.settings.command_timeout
        if isinstance(redis_client, str):
            # No client-side retries: the tick loop is the retry, and a tick must
            # stay short so deadlines are checked on time.
            self._redis = redis.Redis.from_url(
                redis_client,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(backoff=NoBackoff(), retries=0),
            )
            self._own_client = True
        else:
            self._redis = redis_client
            self._own_client = False
        self._renew = self._redis.register_script(RENEW_LUA)
        self._release = self._redis.register_script(RELEASE_LUA)
        self._acquire = self._redis.register_script(ACQUIRE_LUA)
        self._heartbeat = self._redis.register_script(HEARTBEAT_LUA)
        self._members_key = members_key(self.settings.prefix, self.outbox)
        self._heartbeat_keys = [self._members_key, servers_key(self.settings.prefix, self.outbox)]
        if self._legacy is not None:
            self._heartbeat_keys.append(members_key(self.settings.prefix, self._legacy))
        self._ttl_ms = max(1, round(self.settings.ttl * 1000))

        self._lost: dict[int, _Lost] = {}
        self._redis_ok: bool | None = None
        self._run_id: str | None = None
        self._fence = Episode(self.log, "shard-grants-fenced", "shard-grants-unfenced")
        self._kick = threading.Event()

    def check_reachable(self, timeout: float) -> None:
        """Raise DependencyError (and close) unless Redis answers within ``timeout`` s;
        the relay calls it at start, like its database and Kafka checks."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(redis.RedisError),
            stop=tenacity.stop_after_delay(timeout),
            wait=tenacity.wait_fixed(0.5),
            reraise=True,
        )
        try:
            retrying(self._redis.ping)
        except redis.RedisError as exc:
            self.close()
            error = redact(f"{type(exc).__name__}: {exc}")
            raise DependencyError(f"Redis unreachable for shard leases: {error}") from None

    # -- ShardOwnership ------------------------------------------------------

    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        """Join, take a first share synchronously (if Redis answers), then keep
        renewing and rebalancing in a background thread."""
        self._inflight = inflight_shards
        self._tick()
        self._start_thread(self._run)

    def release_all(self) -> None:
        """Leave: stop claiming, release every lease by CAS and drop out of the
        member set, so the others rebalance at their next tick instead of after
        the TTL. Leases that cannot be released (Redis down) simply expire."""
        self._stop_ticking()
        with self._lock:
            held = {s: h.value for s, h in self._held.items()}
            companions = {s for s, h in self._held.items() if h.companion}
        try:
            self._beat(join=False)
            results, redis_epoch_ms = (
                self._call_cas(self._release, held, companions) if held else ({}, 0)
            )
        except redis.RedisError as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._release_failed(sorted(held), error, "the leases expire after their TTL")
            return
        with self._lock:
            released = []
            for shard, result in results.items():
                self._held.pop(shard, None)
                if result == 1:
                    released.append(shard)
            self._lost.clear()
            if released:
                self._shards_event(
                    "shard-released", released, reason="drain", redis_epoch_ms=redis_epoch_ms
                )
        self._set_owned_gauge()

    def close(self) -> None:
        self._stop_ticking()
        if self._own_client:
            self._redis.close()

    # -- introspection (tests, health details) ---------------------------------

    def is_member(self, node_id: str) -> bool | None:
        """Whether ``node_id`` shares this outbox's shards with this relay: a live
        member, or a live relay of an older version (it respects the legacy lease
        keys this relay takes beside its own). None while Redis does not answer."""
        if not self._redis_ok:
            return None
        return node_id in self._members or node_id in self._legacy_members

    # -- what the base asks of a backend ---------------------------------------

    def _proof_locked(self) -> Callable[[_Lease], bool]:
        now, wall = time.monotonic(), time.time()
        return lambda h: _proven(h, now, wall)

    def _busy_locked(self) -> bool:
        return bool(self._lost) or super()._busy_locked()

    def _tick_seconds(self, busy: bool) -> float:
        interval = self.settings.renew_interval
        return min(interval, _FAST_TICK_S) if busy else interval

    def _owned_locked(self) -> int:
        return sum(1 for h in self._held.values() if not h.unproven)

    def _join_timeout(self) -> float:
        return self.settings.command_timeout * 4 + 1

    def _wake(self) -> None:
        self._kick.set()

    # -- the renewal thread ----------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(self._next_delay())
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                self._tick()
            except Exception as exc:  # a bug here must not end the renewals silently
                log_event(
                    self.log,
                    "shard-lease-tick-failed",
                    level=logging.ERROR,
                    table=self.table,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=True,
                )

    def _tick(self) -> None:
        with self._lock:
            if self._leaving:
                return
        # First, with no round trip: after a pause the proofs that ran out meanwhile
        # are marked before Redis says who holds the shards now.
        self._check_deadlines()
        try:
            # Renew before the heartbeat: our heartbeat then expires a moment after
            # our leases, so whoever sees us gone finds the leases free already.
            self._renew_held()
            self._join()
            self._hand_over()
            self._forget_lost()
            self._acquire_targets()
        except redis.RedisError as exc:
            self._redis_state(False, exc)
        else:
            self._redis_state(True)
        self._check_deadlines()
        self._set_owned_gauge()

    def _beat(self, *, join: bool) -> tuple[list[object], list[object], list[object]]:
        """One heartbeat (join or leave): the live members, their servers' fingerprints,
        and the relays live under the legacy names."""
        args = [self.node_id, self._ttl_ms, "1" if join else "0", self.fingerprint or ""]
        raw, servers, legacy = self._heartbeat(keys=self._heartbeat_keys, args=args)
        return list(raw), list(servers), list(legacy)

    def _join(self) -> None:
        raw, servers, legacy = self._beat(join=True)
        live = [_text(m) for m in raw]
        self._check_servers(
            dict(zip(live, (_text(f) if f else None for f in servers), strict=True))
        )
        self._legacy_members = frozenset(_text(m) for m in legacy)
        self._follow(tuple(sorted(live)), self.node_id)

    def _check_servers(self, servers: dict[str, str | None]) -> None:
        """Report members connected to another database server than this relay."""
        if self.conflicts is None:
            return
        mine = self.fingerprint
        others = {m: fp for m, fp in servers.items() if mine and fp and fp != mine}
        if not others:
            self.conflicts.clear("server")
            return
        self.conflicts.report(
            "server",
            frozenset(others.items()),
            fingerprint=mine,
            others=dict(sorted(others.items())),
            detail=(
                "relays connected to another database server share this outbox's shard "
                "leases (same database and table names, same Redis and prefix): each claims "
                "only its share of its own table and the rest stalls; give each outbox its "
                "own --redis-prefix. During a failover this shows until every relay has "
                "reconnected"
            ),
        )

    def _renew_held(self) -> None:
        with self._lock:
            held = {s: h.value for s, h in self._held.items()}
            companions = {s for s, h in self._held.items() if h.companion}
        if not held:
            return
        sent, sent_wall = time.monotonic(), time.time()
        results, redis_epoch_ms = self._call_cas(self._renew, held, companions)
        with self._lock:
            proven_again = []
            for shard, result in results.items():
                h = self._held.get(shard)
                if h is None or h.value != held[shard]:
                    continue
                if result == 1:
                    h.valid_until = self._deadline(sent)
                    h.wall_until = self._deadline(sent_wall)
                    if h.unproven:
                        h.unproven = False
                        proven_again.append(shard)
                else:
                    self._lose(shard, h, "taken" if result == -1 else "expired", redis_epoch_ms)
            if proven_again:
                self._shards_event(
                    "shard-acquired",
                    proven_again,
                    reason="renewed-after-outage",
                    redis_epoch_ms=redis_epoch_ms,
                )

    def _lose(self, shard: int, h: _Lease, reason: str, redis_epoch_ms: int) -> None:
        # Caller holds the lock.
        del self._held[shard]
        self._lost[shard] = _Lost(since=time.monotonic())
        if not h.unproven:  # already counted and logged when its deadline passed
            self.metrics.lost.inc()
        self._event(
            "shard-lost", shard, level=logging.WARNING, reason=reason, redis_epoch_ms=redis_epoch_ms
        )

    def _hand_over(self) -> None:
        ready = self._surplus_ready()
        if not ready:
            return
        values = {s: h.value for s, h in ready.items()}
        companions = {s for s, h in ready.items() if h.companion}
        results, redis_epoch_ms = self._call_cas(self._release, values, companions)
        with self._lock:
            handed = []
            for shard, result in results.items():
                h2 = self._held.pop(shard, None)
                if result == 1:
                    handed.append(shard)
                elif h2 is not None:
                    self.metrics.lost.inc()
                    self._event(
                        "shard-lost", shard, level=logging.WARNING,
                        reason="taken" if result == -1 else "expired",
                        redis_epoch_ms=redis_epoch_ms,
                    )  # fmt: skip
            self._handed_over(handed, redis_epoch_ms=redis_epoch_ms)

    def _forget_lost(self) -> None:
        with self._lock:
            lost = dict(self._lost)
        if not lost:
            return
        inflight = self._inflight()
        with self._lock:
            for shard in lost:
                if shard not in inflight and shard not in self._claiming:
                    self._lost.pop(shard, None)

    def _acquire_targets(self) -> None:
        with self._lock:
            if self._leaving:
                return
            wanted = sorted(self._targets - self._held.keys() - self._lost.keys())
        if not wanted or self._fenced():
            return
        values = {s: f"{self.node_id}:{secrets.token_hex(8)}" for s in wanted}
        # While older relays are live, take their name of the lease too: they can
        # neither hold a shard we hold nor be given one they hold.
        companions = set(values) if self._legacy_members else set()
        sent, sent_wall = time.monotonic(), time.time()
        results, redis_epoch_ms = self._call_cas(self._acquire, values, companions)
        with self._lock:
            got = []
            for shard, result in results.items():
                if result != 1:
                    continue
                self._held[shard] = _Lease(
                    value=values[shard],
                    valid_until=self._deadline(sent),
                    wall_until=self._deadline(sent_wall),
                    companion=shard in companions,
                )
                got.append(shard)
            self._acquired(got, redis_epoch_ms=redis_epoch_ms)

    def _fenced(self) -> bool:
        """No shard is taken while Redis has been up for less than the lease TTL.

        A Redis restarted without persistence has forgotten every lease, but the
        previous owners still believe in theirs until their local deadline, which
        falls within one TTL of their last renewal, so within one TTL of the
        restart. Waiting out the TTL of the new server's uptime keeps one owner
        per shard. (A fresh Redis is fenced the same way: nothing tells a first
        start from a restart.)
        """
        info = self._redis.info("server")
        run_id = str(info.get("run_id", ""))
        uptime = float(info.get("uptime_in_seconds", 0))
        fenced = uptime < math.ceil(self.settings.ttl)
        if fenced:
            self._fence.begin(  # once per Redis run
                run_id,
                table=self.table,
                redis_run_id=run_id,
                previous_run_id=self._run_id,
                redis_uptime_s=uptime,
                wait_s=math.ceil(self.settings.ttl) - uptime,
                reason="Redis has been up for less than the shard lease TTL: leases it "
                "forgot in a restart may still be believed in by their previous owners",
            )
        else:
            self._fence.end(table=self.table, redis_run_id=run_id)
        if self.metrics.fenced is not None:
            self.metrics.fenced.set(1 if fenced else 0)
        self._run_id = run_id
        return fenced

    def _call_cas(
        self, script: Script, values: dict[int, str], companions: set[int] | None = None
    ) -> tuple[dict[int, int], int]:
        """Run a per-shard script on each shard's lease key, and on its legacy
        companion for the shards in ``companions``; returns each shard's result
        and Redis's clock (ms)."""
        shards = sorted(values)
        prefix = self.settings.prefix
        keys: list[str] = []
        args: list[str | int] = [self._ttl_ms]
        for s in shards:
            own = [lease_key(prefix, self.outbox, s)]
            if companions and s in companions and self._legacy is not None:
                own.append(lease_key(prefix, self._legacy, s))
            keys += own
            args += [values[s], len(own)]
        *raw, redis_epoch_ms = script(keys=keys, args=args)
        return {s: int(r) for s, r in zip(shards, raw, strict=True)}, int(redis_epoch_ms)

    def _deadline(self, sent: float) -> float:
        """Until when a lease whose acquire or renew was sent at ``sent`` is proven."""
        return sent + self.settings.ttl - self.settings.safety_margin

    def _check_deadlines(self) -> None:
        """Log each lease whose proof ran out, once. ``trusted_until_ms`` is when it
        did, on the wall clock: after a pause of the machine that is long past, and
        no claim began after it."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            for shard, h in self._held.items():
                if not h.unproven and not _proven(h, now, wall):
                    h.unproven = True
                    self.metrics.lost.inc()
                    until = min(h.wall_until, wall - (now - h.valid_until))
                    self._event(
                        "shard-lost", shard, level=logging.WARNING, reason="lease-unproven",
                        trusted_until_ms=int(until * 1000),
                    )  # fmt: skip

    def _redis_state(self, ok: bool, exc: Exception | None = None) -> None:
        if ok == self._redis_ok:
            return
        first = self._redis_ok is None
        self._redis_ok = ok
        if ok and first:
            return
        if ok:
            log_event(self.log, "redis-reachable", table=self.table, component="shard-leases")
        else:
            log_event(
                self.log,
                "redis-unreachable",
                level=logging.WARNING,
                table=self.table,
                component="shard-leases",
                error=f"{type(exc).__name__}: {exc}",
                note="claiming stops for each shard once its lease can no longer be proven",
            )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
