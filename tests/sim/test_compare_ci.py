"""The scaled-down burst through ``compare``: direct crashes the simulated engine, kvgate does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import compare, scenario
from loadtests.report import plots, table

SCENARIO = Path(__file__).resolve().parents[2] / "loadtests" / "scenarios" / "ci-burst-mini.yaml"


@pytest.mark.e2e
def test_ci_burst_direct_crashes_and_kvgate_protects(tmp_path: Path) -> None:
    sc = scenario.load(SCENARIO)
    direct, gated = compare.compare(sc, ("direct", "kvgate"), tmp_path)

    assert direct.summary["oom_crashes"] >= 1
    assert direct.summary["served"] < direct.summary["requests"]

    s = gated.summary
    assert s["oom_crashes"] == 0
    assert s["preemptions"] == 0
    assert s["peak_kv_usage"] <= 0.90
    assert s["sample_hz_real"] >= 10
    for r in gated.records:
        # Every request is served, or rejected with 429/503 carrying Retry-After.
        assert r.ok or (r.status in (429, 503) and r.retry_after is not None), r
    assert s["served"] > 0

    md = table([direct, gated])
    assert "| OOM crashes | " in md
    for png in plots([direct, gated], tmp_path, sc.name):
        assert png.stat().st_size > 1000
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [a["arm"] for a in saved] == ["direct", "kvgate"]
