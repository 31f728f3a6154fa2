"""The pool harness (loadtests/pool.py, pool_bound.py, pool_report.py): the in-process pool model, the pool's
clock, and a miniature run of every arm plus one with an engine killed and restarted mid-burst."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from loadtests import pool, pool_bound, pool_report
from loadtests.scenario import Range, TrafficClass
from loadtests.stats import Sample

SCENARIO = Path(__file__).resolve().parents[2] / "loadtests" / "scenarios" / "ci-pool-mini.yaml"
MINI = ["--preset", "llama3-8b-h100", "--kv-scale", "0.02"]


def test_spec_parses_and_rejects_what_it_cannot_run() -> None:
    sc, spec = pool.load(SCENARIO)
    assert spec.engines == 2 and spec.arms == pool.POOL_ARMS and spec.fault is None
    assert spec.args_of(sc, 1)[-4:] == ["--time-scale", "0.1", "--oom-mode", "restart"]
    het = pool.parse_spec({"engines": 2, "engine_args": [[], ["--num-gpu-blocks-override", "400"]], "checks": "hetero"})
    assert het.engine_args_of(0) == [] and het.engine_args_of(1) == ["--num-gpu-blocks-override", "400"]
    fault = pool.parse_spec({"engines": 2, "fault": {"engine": 1, "kill_at": 3, "down_s": 2}})
    assert fault.checks == "fault" and fault.fault == pool.Fault(1, 3.0, 2.0)
    for bad in (
        {"engines": 2, "arms": ["direct"]},
        {"engines": 2, "checks": "fault"},
        {"engines": 1, "engine_args": [[], []]},
    ):
        with pytest.raises(ValueError):
            pool.parse_spec(bad)


def test_pool_bound_shared_queue_uses_the_larger_engines_round_robin_does_not() -> None:
    sc, _ = pool.load(SCENARIO)
    cls = TrafficClass("long", Range(300, 300), Range(100, 100), burst_count=90)
    arrivals = dataclasses.replace(sc, classes=(cls,)).arrivals()
    configs = pool_bound.engine_configs([MINI, MINI, [*MINI[:2], "--num-gpu-blocks-override", "15872", *MINI[2:]]])
    shared = pool_bound.pool_run(arrivals, configs, "shared", 0.90)
    rr = pool_bound.pool_run(arrivals, configs, "round-robin", 0.90)
    for r in (shared, rr):
        assert r["served"] == 90 and r["refused"] == 0
        assert all(e["peak_kv_usage"] <= 0.90 and e["preemptions"] == 0 and e["oom_steps"] == 0 for e in r["engines"])
    assert [e["placed"] for e in rr["engines"]] == [30, 30, 30]
    assert shared["engines"][2]["placed"] < 30  # the half-size engine takes less of a shared queue
    assert shared["makespan_s"] < rr["makespan_s"]
    waited = pool_bound.pool_run(arrivals, configs, "round-robin", 0.90, max_wait_s=0.5)
    assert waited["refused"] > 0 and waited["served"] + waited["refused"] == 90


def test_pool_clock_is_the_mean_of_the_engines_clocks_leaving_out_a_restarted_one() -> None:
    def engine(rate: float) -> list[Sample]:
        return [Sample(t, True, clock=100.0 + rate * t) for t in (0.0, 1.0, 2.0)]

    f = pool.pool_clock([engine(1.0), engine(0.5), engine(9.0)], exclude=(2,))
    assert f(0.0) == 0.0 and math.isclose(f(2.0), (2.0 + 1.0) / 2)
    assert pool.pool_clock([[Sample(0.0, False)]])(3.0) == 3.0


@pytest.mark.e2e
def test_mini_pool_every_arm_and_a_killed_engine(tmp_path: Path) -> None:
    sc, spec = pool.load(SCENARIO)
    res = pool.compare_pool(sc, spec, tmp_path)
    by = {r.arm: r for r in res}
    assert by["direct-rr"].summary["oom_crashes"] >= 1  # 40 prompts at once crash a miniature engine
    for arm in ("sidecar", "pool-kvgate"):
        s = by[arm].summary
        assert s["oom_crashes"] == 0 and s["preemptions"] == 0 and s["hung"] == 0
        assert all(p <= 0.90 for p in s["peak_kv_usage_per_engine"])
        assert s["served"] == s["requests"] == 80
        assert s["sample_hz_real"] >= 10
        assert [e["placements"] for e in s["engines"]] != [0, 0]
        assert sum(e["placements"] for e in s["engines"]) >= 80
    assert [e["requests_routed"] for e in by["sidecar"].summary["engines"]] == [40, 40]
    back = pool.load_arm(tmp_path, "pool-kvgate")
    assert {k: back.summary[k] for k in ("served", "requests", "refusals")} == {
        k: by["pool-kvgate"].summary[k] for k in ("served", "requests", "refusals")
    }
    assert len(back.engines[1]) == len(by["pool-kvgate"].engines[1]) and back.routes == by["pool-kvgate"].routes
    assert "| OOM crashes (all engines) |" in pool_report.table(res)
    assert "pool-kvgate e1" in pool_report.engine_table(res)
    for png in pool_report.plots(res, tmp_path, sc.name):
        assert png.stat().st_size > 1000
    lines = pool_report.pool_checks(res, {"output_tok_per_s": 1.0, "concurrency": 1, "source": "test"}, None, False)
    assert any("strictly better than the sidecar" in line for line in lines)

    # Engine e0 killed 2 s into a burst with a steady tail, started again 3 s later.
    tail = TrafficClass("tail", Range(300, 300), Range(100, 100), rate=6.0, start=0.0, stop=60.0)
    sc = dataclasses.replace(sc, classes=(*sc.classes, tail))
    spec = dataclasses.replace(spec, fault=pool.Fault(0, 2.0, 3.0), checks="fault", request_deadline_s=60.0)
    (faulted,) = pool.compare_pool(sc, spec, tmp_path / "fault", arms=("pool-kvgate",))
    s = faulted.summary
    assert s["hung"] == 0 and s["unfinished"] == 0
    st = pool_report.fault_stats(faulted, 0)
    assert st["ejected_at"] is not None and st["back_at"] is not None and st["back_at"] > st["ready_at"]
    assert st["reserved_samples_while_dead"] > 0 and st["reserved_max_while_dead"] == 0
    assert st["placements_after_rejoin"] > 0
    assert s["engines"][1]["oom_crashes"] == 0 and s["engines"][1]["peak_kv_usage"] <= 0.90
    text = "\n".join(pool_report.fault_checks([faulted], 0))
    assert "**FAIL**" not in text, text
    assert (tmp_path / "fault" / "pool-kvgate" / "sim-e0.restart.log").exists()
