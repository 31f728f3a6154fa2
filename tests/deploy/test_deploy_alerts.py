"""The PrometheusRule's groups pass ``promtool check rules`` and fire as intended in ``promtool test rules``.

The groups are taken from the rendered PrometheusRule, so the file promtool checks is exactly what the
Prometheus Operator would load.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import FIXTURES, Manifest, prometheus_rule_groups, require_tool

# The situations issues 6 and 12 (a pool of engines) ask alerts for, each with the alert that covers it.
REQUIRED_ALERTS = {
    "gate closed too long": "KvgateGateClosedTooLong",
    "high queue wait": "KvgateHighQueueWait",
    "rejection rate": "KvgateHighRejectionRate",
    "stale upstream metrics": "KvgateUpstreamMetricsStale",
    "KV usage above the high watermark": "KvgateKVUsageAboveHighWatermark",
    "preemptions observed": "KvgateVLLMPreemptions",
    "an engine ejected for more than 5 minutes": "KvgateEngineEjected",
    "fewer than 2 placeable engines in a pool of several": "KvgatePoolFewPlaceableEngines",
    "engine restarts": "KvgateEngineRestarted",
    "one engine's KV usage above 0.95 for 2 minutes": "KvgateEngineKVUsageHigh",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=120, check=False)


def write_rules(directory: Path, groups: list[Manifest], annotations: bool = True) -> Path:
    groups = copy.deepcopy(groups)
    if not annotations:
        for group in groups:
            for rule in group["rules"]:
                rule.pop("annotations", None)
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def unit_test(directory: Path, groups: list[Manifest]) -> subprocess.CompletedProcess[str]:
    write_rules(directory, groups, annotations=False)
    test_file = directory / "alerts_test.yaml"
    test_file.write_text((FIXTURES / "alerts_test.yaml").read_text())
    return promtool("test", "rules", str(test_file))


@pytest.fixture
def groups(rendered: dict[str, list[Manifest]]) -> list[Manifest]:
    # The monitoring component is shared: every overlay must carry the same rules.
    for overlay in ("standalone", "pool"):
        assert prometheus_rule_groups(rendered["sidecar"]) == prometheus_rule_groups(rendered[overlay]), overlay
    return prometheus_rule_groups(rendered["sidecar"])


def test_promtool_check_rules(groups: list[Manifest], tmp_path: Path) -> None:
    proc = promtool("check", "rules", str(write_rules(tmp_path, groups)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_check_rules_catches_a_bad_expression(groups: list[Manifest], tmp_path: Path) -> None:
    broken = copy.deepcopy(groups)
    broken[0]["rules"][0]["expr"] = "max by (namespace (kvgate_gate_open) == 0"
    proc = promtool("check", "rules", str(write_rules(tmp_path, broken)))
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout + proc.stderr


def test_alerts_fire_on_their_situation(groups: list[Manifest], tmp_path: Path) -> None:
    proc = unit_test(tmp_path, groups)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("alert", "threshold", "drifted_to"),
    [
        ("KvgateKVUsageAboveHighWatermark", "> 0.90", "> 0.99"),
        ("KvgateEngineKVUsageHigh", "> 0.95", "> 0.99"),
        ("KvgatePoolFewPlaceableEngines", "< 2", "< 1"),
        ("KvgatePoolFewPlaceableEngines", "> 1", "> 0"),
    ],
)
def test_alert_unit_tests_fail_when_a_threshold_drifts(
    groups: list[Manifest], tmp_path: Path, alert: str, threshold: str, drifted_to: str
) -> None:
    """Moving a threshold (the watermark alert to 0.99, the pool alert to pools of one) makes its unit test
    fail: the fixture pins behaviour."""
    drifted = copy.deepcopy(groups)
    rule = next(r for g in drifted for r in g["rules"] if r.get("alert") == alert)
    assert threshold in rule["expr"]
    rule["expr"] = rule["expr"].replace(threshold, drifted_to)
    proc = unit_test(tmp_path, drifted)
    assert proc.returncode != 0
    assert alert in proc.stdout + proc.stderr


def test_every_alert_is_required_or_tested(groups: list[Manifest]) -> None:
    """Each required situation has its alert, and every alert has a firing case in the unit tests."""
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert set(REQUIRED_ALERTS.values()) <= alerts
    tests: list[dict[str, Any]] = yaml.safe_load((FIXTURES / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert alerts <= fired, f"alerts without a firing test: {sorted(alerts - fired)}"
    for g in groups:
        for r in g["rules"]:
            if "alert" in r:
                assert r["labels"]["severity"] in {"warning", "critical"}
                assert r["annotations"]["summary"] and r["annotations"]["description"]
