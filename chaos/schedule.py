"""The fault schedule: a pure function of the seed and the run's size.

Faults run on two tracks, each one fault at a time, at planned offsets from the
start of writing, spread over the middle of the run so that the first and the
last stretch are fault-free:

- ``faults``: every kind but rolling redeploys, one at a time (two at once would
  blur which one caused what);
- ``deploys``: the rolling redeploys, evenly spaced, running *beside* the other
  faults, as a deployment does in production: a relay is drained while the
  broker is down or the database is frozen. A redeploy exits cleanly or the
  drain check fails, so it adds no cause to blur, and a slot is never hit by
  two faults at once (the injector holds a lock per slot).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chaos.config import RunConfig

#: Network faults hit the link between the relays and one service.
NET_TARGETS = ("db", "kafka", "redis")


@dataclass(frozen=True)
class Fault:
    seq: int
    at_s: float
    kind: str
    #: relay or consumer slot, or the proxied service of a network fault
    target: str
    #: how long the fault lasts (freeze, stall, outage), seconds
    hold_s: float
    #: ``faults`` or ``deploys`` (see the module's docstring)
    track: str = "faults"

    def __str__(self) -> str:
        when = f"t+{self.at_s:7.1f}s"
        return (
            f"#{self.seq:03d} {when} {self.kind:<20} {self.target:<10} {self.hold_s:.1f}s"
            f" [{self.track}]"
        )


DEPLOY_KINDS = frozenset({"relay-redeploy"})


def make_schedule(cfg: RunConfig) -> list[Fault]:
    rng = random.Random(cfg.seed)
    t = cfg.timings
    lo, hi = 0.08 * cfg.duration_s, 0.9 * cfg.duration_s
    planned: list[tuple[float, str, str]] = []
    for track, chosen in (
        ("faults", {k: n for k, n in cfg.faults.items() if k not in DEPLOY_KINDS}),
        ("deploys", {k: n for k, n in cfg.faults.items() if k in DEPLOY_KINDS}),
    ):
        kinds = [k for k, n in sorted(chosen.items()) for _ in range(n)]
        rng.shuffle(kinds)
        step = (hi - lo) / max(1, len(kinds))
        planned += [
            (round(lo + i * step + rng.uniform(0, step * 0.5), 1), kind, track)
            for i, kind in enumerate(kinds)
        ]
    planned.sort(key=lambda p: (p[0], p[2]))
    faults = []
    for i, (at, kind, track) in enumerate(planned):
        if kind.startswith("relay-"):
            target = f"relay-{rng.randrange(cfg.relays)}"
        elif kind.startswith("consumer-"):
            target = f"consumer-{rng.randrange(cfg.consumers)}"
        elif kind.startswith("net-"):
            # Relays owning shards by advisory locks reach no Redis: nothing to cut.
            targets = NET_TARGETS if cfg.ownership == "redis" else NET_TARGETS[:2]
            target = rng.choice(targets)
        else:
            target = kind.split("-")[0]
        faults.append(Fault(i, at, kind, target, round(_hold(kind, t, rng), 1), track))
    return faults


def _hold(kind: str, t: object, rng: random.Random) -> float:
    from chaos.config import Timings

    assert isinstance(t, Timings)
    if kind == "relay-stall":  # longer than the row lease and the shard lease
        return max(t.lease_ttl_s, t.shard_lease_ttl_s) + rng.uniform(1.0, 4.0)
    if kind in ("kafka-freeze", "relay-bounded-queue"):  # longer than message.timeout.ms
        return t.message_timeout_s + rng.uniform(1.0, 3.0)
    if kind in (
        "kafka-kill",
        "kafka-leader-kill",
        "kafka-controller-kill",
        "kafka-coordinator-kill",
    ):
        return rng.uniform(0.5, 3.0)
    if kind == "kafka-isr-shortage":
        # Longer than max_attempts message timeouts, and than the time those
        # attempts take with their backoff: without the refund, rows would fail.
        return t.attempts_wall_s + rng.uniform(5.0, 10.0)
    if kind == "kafka-follower-freeze":  # longer than the replica lag: the ISR shrinks
        return t.replica_lag_s + rng.uniform(2.0, 5.0)
    if kind == "redis-freeze":
        return rng.uniform(2.0, t.shard_lease_ttl_s + 2.0)
    if kind in ("relay-kill", "consumer-kill"):  # pause before the replacement starts
        return rng.uniform(0.5, 3.0)
    if kind == "consumer-drain":  # slow handlers running before the SIGTERM
        return rng.uniform(0.5, 2.0)
    if kind.startswith("net-"):
        return rng.uniform(2.0, 6.0)
    return 0.0
