"""Sizes and settings of one benchmark run.

Defaults are the real-run sizes of the benchmark issue; ``smoke()`` shrinks
everything so a run takes seconds and only proves the harness still works.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one run measures with.  Every field is also a ``--flag`` of ``python -m bench``."""

    #: Backlog drained by the DB ceiling, the producer ceiling and each relay run.
    rows: int = 200_000
    #: Backlog of the scaling scenario (first vs last 10%).
    backlog_rows: int = 1_000_000
    #: Peak memory is also measured at 1/memory_scale of the scaling backlog (relay)
    #: and of ``consumer_messages`` (consumer with the inbox): does it grow with the backlog?
    memory_scale: int = 4
    keys: int = 10_000
    payload_bytes: int = 512
    #: Shards of the outbox table (the table default).
    shards: int = 64
    #: Partitions of every benchmark topic.
    partitions: int = 6
    #: Relay claim batch size; None: the relay's own default.
    batch_size: int | None = None
    #: Relay counts of the throughput (scale-out) scenario.
    relay_counts: tuple[int, ...] = (1, 2, 3, 4)
    #: More claim batch sizes the throughput scenario drains with one relay.
    batch_sizes: tuple[int, ...] = ()
    #: The throughput scenario's drains with the relay's pipeline on (1) and off (0),
    #: alternating in this order, so both share the run's conditions: one relay at
    #: each batch size, and each larger relay count at the default batch size.
    pipeline_modes: tuple[int, ...] = (1, 0)
    #: Steady writer rates (events/s) of the latency scenario, and how long each lasts.
    latency_rates: tuple[int, ...] = (200, 1_000, 5_000)
    latency_seconds: float = 10.0
    #: Before those seconds the writer runs at the same rate for this long; its
    #: events are the warm-up (a relay's first batches on a new topic and table),
    #: reported apart from the steady-state percentiles (see latency.py).
    latency_warmup_seconds: float = 2.0
    #: The latency scenario's runs with wake-ups, with the relay's pipeline off (0)
    #: and on (1), in this order.
    latency_pipeline_modes: tuple[int, ...] = (0, 1)
    #: How long the writer's own insert rate is measured, with and without a relay.
    writer_seconds: float = 5.0
    #: Messages read by each consumer variant.
    consumer_messages: int = 200_000
    consumer_concurrency: int = 8
    consumer_sleep_ms: float = 1.0
    #: The raw poll loop and the base class read the topic this many times each,
    #: in turns (raw, base, raw, base, ...): the goal's ratio is the median of
    #: the rounds' ratios, so one slow read of either side does not decide it.
    consumer_rounds: int = 3
    #: SIGTERM -> exit runs per component, and the load each run drains under.
    drain_runs: int = 20
    drain_rows: int = 20_000
    #: Before each measured drain of a copied backlog, wait up to this many
    #: seconds for the database server to go quiet (``procs.wait_database_quiet``);
    #: 0: no wait.
    quiet_timeout: float = 30.0
    #: Fresh processes per command of the start-up scenario (the median is shown).
    startup_runs: int = 21
    #: Fresh relays (to their first claim) and consumers (to their first poll) of
    #: the start-up scenario (the median is shown).
    startup_service_runs: int = 5
    #: Give up on any single drain/consume after this long.
    timeout_seconds: float = 600.0

    @classmethod
    def smoke(cls, **overrides: object) -> BenchConfig:
        """Tiny sizes: seconds per scenario, figures meaningless, fields all present."""
        small: dict[str, object] = {
            # Drains long enough for the 100 ms progress samples to see most of
            # them (the relays' CPU is counted from the first sample that saw a
            # message): a 2,000-row drain took 0.1 s on PostgreSQL.
            "rows": 10_000,
            "backlog_rows": 12_000,
            "keys": 100,
            "partitions": 3,
            "shards": 8,
            "relay_counts": (1, 2),
            "latency_rates": (100,),
            "latency_seconds": 1.0,
            "latency_warmup_seconds": 0.5,
            "writer_seconds": 1.0,
            "consumer_messages": 2_000,
            "consumer_concurrency": 4,
            "consumer_rounds": 2,
            "drain_runs": 2,
            "drain_rows": 2_000,
            "startup_runs": 3,
            "startup_service_runs": 1,
            "timeout_seconds": 120.0,
            "quiet_timeout": 0.0,  # figures meaningless anyway; keeps the smoke run short
        }
        small.update(overrides)
        return cls(**small)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> BenchConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
