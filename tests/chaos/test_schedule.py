"""The fault schedule is a pure function of the seed and the run size: a seed
replays the same faults, and every requested fault is in it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.config import CLUSTER_KINDS, ISR_SHORTAGE, KINDS, parse_args
from chaos.fleet import Fleet
from chaos.schedule import make_schedule

pytestmark = pytest.mark.unit

_CLUSTER = SimpleNamespace(relay_db_url="db", relay_bootstrap="kafka", relay_redis_url="r")


@settings(max_examples=50, derandomize=True, deadline=None)
@given(seed=st.integers(1, 10**6), size=st.sampled_from(["--smoke", "--medium"]))
def test_a_seed_replays_the_same_schedule_with_every_fault_in_the_run(seed: int, size: str) -> None:
    cfg = parse_args([size, "--seed", str(seed)])
    schedule = make_schedule(cfg)
    assert schedule == make_schedule(parse_args([size, "--seed", str(seed)]))
    assert len(schedule) == cfg.total_faults
    assert {f.kind for f in schedule} == set(KINDS)
    times = [f.at_s for f in schedule]
    assert times == sorted(times)
    assert times[0] > 0 and times[-1] < cfg.duration_s
    # rolling redeploys run on their own track beside the other faults
    assert {f.track for f in schedule if f.kind == "relay-redeploy"} == {"deploys"}
    assert {f.track for f in schedule if f.kind != "relay-redeploy"} == {"faults"}
    t = cfg.timings
    for f in schedule:
        if f.kind == "relay-stall":
            assert f.hold_s > max(t.lease_ttl_s, t.shard_lease_ttl_s)
        if f.kind == "kafka-freeze":
            assert f.hold_s > t.message_timeout_s


def test_the_full_run_has_the_faults_the_issue_asks_for() -> None:
    cfg = parse_args(["--seed", "1"])
    assert cfg.events >= 1_000_000 and cfg.keys >= 10_000
    assert (cfg.relays, cfg.consumers) == (3, 2)
    assert cfg.total_faults >= 200 and cfg.faults["relay-redeploy"] >= 100
    assert set(cfg.faults) == set(KINDS)


@pytest.mark.parametrize("size", ["--smoke", "--medium", None])
def test_a_cluster_run_adds_the_cluster_fault_kinds_to_every_other(size: str | None) -> None:
    """``--kafka-brokers 3``: the single-broker schedule's kinds and the five of
    the cluster; a follower is frozen for longer than the replica lag (else the
    ISR never shrinks); the full run has the volume and broker faults it must."""
    cfg = parse_args([*filter(None, [size]), "--seed", "7", "--kafka-brokers", "3"])
    schedule = make_schedule(cfg)
    assert cfg.kafka_brokers == 3
    # every node at once, and the minute-long ISR shortage: not in the cluster smoke
    outages = {"kafka-kill", "kafka-freeze", ISR_SHORTAGE}
    expected = set(KINDS) | set(CLUSTER_KINDS)
    assert {f.kind for f in schedule} == (expected - outages if size == "--smoke" else expected)
    t = cfg.timings
    for f in schedule:
        if f.kind == "kafka-follower-freeze":
            assert f.hold_s > t.replica_lag_s
        if f.kind in CLUSTER_KINDS:
            assert f.target == "kafka" and f.track == "faults"
    if size is None:
        assert cfg.events >= 500_000
        assert sum(cfg.faults[k] for k in CLUSTER_KINDS) >= 100


@pytest.mark.parametrize(
    "argv",
    [
        ["--medium"],
        [],
        ["--smoke", "--only", ISR_SHORTAGE],
        ["--smoke", "--faults", f"{ISR_SHORTAGE}=2"],
    ],
)
def test_an_isr_shortage_outlasts_max_attempts_message_timeouts(argv: list[str]) -> None:
    """The medium and full cluster runs (and a smoke asked for it) hold a
    partition below min.insync.replicas for longer than ``max_attempts`` message
    timeouts of the run's own relays, and longer than those attempts take with
    their backoff: were the attempts not refunded, its rows would fail. Such a
    run gives its relays the shipped ``--max-attempts`` (10), so that this takes
    about a minute, not the 100 x 3 s of the other runs' budget."""
    for seed in range(1, 40):
        cfg = parse_args([*argv, "--seed", str(seed), "--kafka-brokers", "3"])
        shortages = [f for f in make_schedule(cfg) if f.kind == ISR_SHORTAGE]
        assert len(shortages) == cfg.faults[ISR_SHORTAGE] >= 1
        t = cfg.timings
        assert t.relay_max_attempts == 10
        assert t.attempts_budget_s == t.relay_max_attempts * t.message_timeout_s
        for f in shortages:
            assert f.target == "kafka" and f.track == "faults"
            assert f.hold_s > t.attempts_wall_s > t.attempts_budget_s
            assert f.hold_s < t.attempts_wall_s + 15  # bounded: about a minute
        fleet = Fleet(cfg, _CLUSTER, "t", Path("."))  # type: ignore[arg-type]
        env = fleet.relay_env("relay-1")
        assert env["OUTBOXKIT_MAX_ATTEMPTS"] == str(t.relay_max_attempts)
        assert f"message.timeout.ms={int(t.message_timeout_s * 1000)}" in env[
            "OUTBOXKIT_KAFKA_CONFIG"
        ].split(",")
        assert float(env["OUTBOXKIT_RETRY_BACKOFF_CAP"]) == t.retry_backoff_cap_s


def test_runs_without_an_isr_shortage_keep_their_retry_budget() -> None:
    for argv in (["--smoke", "--kafka-brokers", "3"], ["--medium"], []):
        cfg = parse_args([*argv, "--seed", "3"])
        assert ISR_SHORTAGE not in cfg.faults
        assert cfg.timings.relay_max_attempts == 100


def test_cluster_fault_kinds_need_the_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--only", "kafka-leader-kill"])
    assert "unknown fault kinds ['kafka-leader-kill']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--kafka-brokers", "2"])
    cfg = parse_args(["--smoke", "--kafka-brokers", "3", "--only", "kafka-leader-kill"])
    assert cfg.faults == {"kafka-leader-kill": 1}
    # a kind the size leaves out runs once when asked for by --only
    cfg = parse_args(["--smoke", "--kafka-brokers", "3", "--only", f"{ISR_SHORTAGE},kafka-kill"])
    assert cfg.faults == {ISR_SHORTAGE: 1, "kafka-kill": 1}
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--only", ISR_SHORTAGE])


@pytest.mark.parametrize(
    ("argv", "setting"), [([], None), (["--pipeline"], "true"), (["--no-pipeline"], "false")]
)
def test_the_relays_run_pipelined_as_asked(argv: list[str], setting: str | None) -> None:
    """``--pipeline`` / ``--no-pipeline`` reach every relay of the run as
    ``OUTBOXKIT_PIPELINE`` (the fleet passes no ``OUTBOXKIT_`` variable of its own
    environment on); neither leaves the relay's own default."""
    cfg = parse_args(["--smoke", "--seed", "1", "--database", "postgresql", *argv])
    cluster = SimpleNamespace(relay_db_url="db", relay_bootstrap="kafka", relay_redis_url="r")
    fleet = Fleet(cfg, cluster, "t", Path("."))  # type: ignore[arg-type]
    env = fleet.relay_env("relay-0")
    assert env.get("OUTBOXKIT_PIPELINE") == setting
    assert cfg.describe()["pipeline"] is (None if setting is None else setting == "true")


def test_one_relay_slot_always_runs_with_a_bounded_producer_queue() -> None:
    """Every Kafka fault of a run meets a relay whose producer queue holds a
    twentieth of a batch; the other slots keep librdkafka's default."""
    cfg = parse_args(["--smoke", "--seed", "1"])
    cluster = SimpleNamespace(relay_db_url="db", relay_bootstrap="kafka", relay_redis_url="r")
    fleet = Fleet(cfg, cluster, "t", Path("."))  # type: ignore[arg-type]
    bounded = f"queue.buffering.max.messages={cfg.timings.bounded_queue_messages}"
    assert fleet.bounded_queue() == bounded
    assert bounded in fleet.relay_env("relay-0-g0", fleet.bounded_queue())[
        "OUTBOXKIT_KAFKA_CONFIG"
    ].split(",")
    assert "queue.buffering" not in fleet.relay_env("relay-1-g0")["OUTBOXKIT_KAFKA_CONFIG"]
