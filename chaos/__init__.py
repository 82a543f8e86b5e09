"""Chaos harness: a writer, relays and inbox consumers as real processes on named
local MariaDB, Kafka and Redis instances, under a seeded, replayable fault
schedule, with end-of-run checks (nothing lost, per-key order, duplicates
accounted for, nothing stuck, clean drains, one shard owner at a time).

Run it with ``./chaos/run.sh`` (``--smoke``, ``--medium``, ``--seed N``);
see docs/reliability.md.
"""
