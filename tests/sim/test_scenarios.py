"""Every committed scenario loads, and its request plan is deterministic and fits the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sim.cli import build_parser, config_from_args
from loadtests import scenario

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "loadtests" / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_plan_is_deterministic_and_fits(path: Path) -> None:
    sc = scenario.load(path)
    plan = sc.arrivals()
    assert plan and plan == sc.arrivals()
    assert [a.at for a in plan] == sorted(a.at for a in plan)
    cfg = config_from_args(build_parser().parse_args(list(sc.sim_args)))
    for a in plan:
        assert a.prompt_tokens + a.max_tokens <= cfg.max_model_len
        assert a.prompt_tokens + (a.sent_max_tokens or 0) <= cfg.max_model_len  # else the engine answers 400
    for c in sc.classes:
        n = sum(1 for a in plan if a.cls == c.name)
        if c.rate:  # Poisson: the count is near rate x duration (5 sigma)
            mean = c.rate * (c.stop - c.start)
            assert abs(n - mean) < 5 * mean**0.5
        else:
            assert n == c.burst_count
