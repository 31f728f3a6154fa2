"""The in-process burst bound and the sweep's windowed rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests import scenario
from loadtests.bound import capped_run, closed_loop_capacity
from loadtests.stats import Sample
from loadtests.sweep import window_rates

SCENARIOS = Path(__file__).resolve().parents[2] / "loadtests" / "scenarios"


def test_capped_burst_is_stable_under_a_small_cap_and_ooms_without_one() -> None:
    sc = scenario.load(SCENARIOS / "ci-burst-mini.yaml")
    n = len(sc.arrivals())
    small, unlimited = capped_run(sc, 4), capped_run(sc, n)
    assert small["stable"] and small["peak_kv_usage"] < 0.9
    assert not unlimited["stable"] and unlimited["peak_kv_usage"] > 0.9
    # Every output token is produced either way; the smaller cap takes longer.
    tokens = sum(a.max_tokens for a in sc.arrivals())
    for r in (small, unlimited):
        assert r["output_tok_per_s"] * r["makespan_s"] == pytest.approx(tokens)
    assert small["makespan_s"] > unlimited["makespan_s"]


def test_closed_loop_capacity_grows_with_concurrency_until_unstable() -> None:
    sc = scenario.load(SCENARIOS / "overload-2x.yaml")
    lo, hi = closed_loop_capacity(sc, 4, duration_s=60), closed_loop_capacity(sc, 12, duration_s=60)
    assert hi["req_per_s"] > lo["req_per_s"] and hi["mean_kv_usage"] > lo["mean_kv_usage"]
    assert closed_loop_capacity(sc, 40, duration_s=60)["oom_steps"] > 0


def test_window_rates_split_the_window_and_survive_a_counter_reset() -> None:
    # 10 tok/s for 0..10 s, then the counter resets at 10 s (restart) and runs at 30 tok/s to 20 s.
    samples = [Sample(float(t), True, generation_tokens=10.0 * t) for t in range(11)]
    samples += [Sample(float(t), True, generation_tokens=30.0 * (t - 10.5)) for t in range(11, 21)]
    mean, blocks = window_rates(samples, 0.0, 10.0, 2)
    assert mean == pytest.approx(10.0) and blocks == [pytest.approx(10.0), pytest.approx(10.0)]
    _, blocks = window_rates(samples, 12.0, 20.0, 2)
    assert blocks == [pytest.approx(30.0), pytest.approx(30.0)]
