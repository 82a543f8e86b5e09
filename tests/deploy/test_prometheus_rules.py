"""promtool accepts the alert rules and their unit tests prove every alert.

The unit tests themselves live in deploy/prometheus/tests/*.test.yml; this
module runs them, checks that each alert has both a firing and a quiet case,
and proves that promtool (and the unit tests) can fail on a broken rule.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = REPO_ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.rules.yml"))
TEST_FILES = sorted((PROM_DIR / "tests").glob("*.test.yml"))
OPERATIONS_DOC = REPO_ROOT / "docs" / "operations.md"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def alert_rules(yaml: ModuleType) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(rule for rule in group["rules"] if "alert" in rule)
    return rules


def github_anchors(markdown: str) -> set[str]:
    """Heading anchors as GitHub renders them: lower case, punctuation dropped."""
    anchors = set()
    for line in markdown.splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            text = match.group(1).strip().lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_rule_and_test_files_exist() -> None:
    assert RULE_FILES, "no deploy/prometheus/rules/*.rules.yml"
    assert TEST_FILES, "no deploy/prometheus/tests/*.test.yml"


def test_promtool_check_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config_with_rules(promtool: str) -> None:
    # Also loads rule_files, relative to prometheus.yml.
    result = run(promtool, "check", "config", str(PROM_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rules found" in result.stdout, "prometheus.yml loaded no rule file"


def test_promtool_unit_tests_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", *map(str, TEST_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case(yaml_module: ModuleType) -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in TEST_FILES:
        for case in yaml_module.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules(yaml_module)}
    assert names - fires == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"


def test_required_alerts_exist(yaml_module: ModuleType) -> None:
    names = {rule["alert"] for rule in alert_rules(yaml_module)}
    required = {
        "OutboxShutdownPending",
        "OutboxBacklogOld",
        "OutboxFailedRows",
        "OutboxKeysHeldByFailedRows",
        "OutboxTopicPaused",
        "OutboxRelayAbsent",
        "ConsumerLagHigh",
        "OutboxForcedShutdown",
    }
    assert required - names == set()


def test_alerts_carry_severity_summary_and_a_runbook_that_exists(
    yaml_module: ModuleType,
) -> None:
    anchors = github_anchors(OPERATIONS_DOC.read_text())
    for rule in alert_rules(yaml_module):
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in {"warning", "critical"}, name
        annotations = rule.get("annotations", {})
        assert annotations.get("summary"), f"{name}: no summary"
        doc, _, anchor = annotations.get("runbook", "").partition("#")
        assert doc == "docs/operations.md", f"{name}: runbook must point at docs/operations.md"
        assert anchor == name.lower(), f"{name}: runbook anchor {anchor!r}"
        assert anchor in anchors, f"{name}: docs/operations.md has no section #{anchor}"


# --- the checks above can fail ---------------------------------------------

SHUTDOWN_EXPR = 'expr: outbox_shutdown_pending{job="outboxkit_relay"} > 0'


def copy_rules_and_tests(tmp_path: Path, old: str, new: str) -> tuple[Path, Path]:
    """A copy of rules/ and tests/ with one rule edited; returns (rules, tests) dirs."""
    rules_dir, tests_dir = tmp_path / "rules", tmp_path / "tests"
    shutil.copytree(PROM_DIR / "rules", rules_dir)
    shutil.copytree(PROM_DIR / "tests", tests_dir)
    rules_file = rules_dir / "outboxkit.rules.yml"
    text = rules_file.read_text()
    assert old in text, f"mutation target {old!r} not found; update this test"
    rules_file.write_text(text.replace(old, new, 1))
    return rules_dir, tests_dir


def test_broken_rule_syntax_fails_promtool_check(promtool: str, tmp_path: Path) -> None:
    rules_dir, _ = copy_rules_and_tests(
        tmp_path, SHUTDOWN_EXPR, 'expr: outbox_shutdown_pending{job="outboxkit_relay" > 0'
    )
    result = run(promtool, "check", "rules", str(rules_dir / "outboxkit.rules.yml"))
    assert result.returncode != 0, result.stdout


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # Would page on every normal drain (live gauge), and never resolve.
        (SHUTDOWN_EXPR, "expr: outbox_shutdown_pending > 0"),
        # Would never fire on a small number of stranded rows.
        (SHUTDOWN_EXPR, 'expr: outbox_shutdown_pending{job="outboxkit_relay"} > 100'),
        # Would stay quiet while up == 0 series exist.
        (
            'absent(up{job="outboxkit-relay"} == 1)',
            'absent(up{job="outboxkit-relay"})',
        ),
        # Would keep a pushed forced shutdown firing forever.
        ("time() - push_time_seconds < 3600", "time() - push_time_seconds < 1e9"),
        # Would double-count a partition reported by two instances.
        (
            "max without (instance, pod) (worker_consumer_lag",
            "sum without (instance, pod) (worker_consumer_lag",
        ),
        # Would never fire for a consumer's pushed forced exit.
        (
            'service_forced_shutdowns_total{job=~"outboxkit_.+"}',
            'service_forced_shutdowns_total{job="outboxkit_relay"}',
        ),
        # Would keep firing on a lag value pushed by a consumer long gone.
        (
            'worker_consumer_lag{job="outboxkit-consumer"}',
            'worker_consumer_lag{job=~"outboxkit.+"}',
        ),
    ],
    ids=[
        "shutdown-live-gauge",
        "shutdown-threshold",
        "absent",
        "push-age",
        "lag-sum",
        "forced-relay-only",
        "lag-any-job",
    ],
)
def test_wrong_rule_fails_the_unit_tests(promtool: str, tmp_path: Path, old: str, new: str) -> None:
    rules_dir, tests_dir = copy_rules_and_tests(tmp_path, old, new)
    check = run(promtool, "check", "rules", str(rules_dir / "outboxkit.rules.yml"))
    assert check.returncode == 0, "the mutation should stay valid syntax: " + check.stdout
    result = run(promtool, "test", "rules", *map(str, sorted(tests_dir.glob("*.test.yml"))))
    assert result.returncode != 0, "unit tests did not notice: " + result.stdout
