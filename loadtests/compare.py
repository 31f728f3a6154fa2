"""``compare``: one scenario, three arms, each on a fresh simulator:

* ``direct``: clients talk to the simulated vLLM;
* ``kvgate``: clients talk to ``kvgate serve`` in front of it;
* ``vllm-queue``: clients talk to the simulator started with vLLM's own ``--max-num-queued-reqs``.

The simulator runs in OOM ``restart`` mode so a crash is counted (from its log, as an operator would) and the
run goes on. Everything is measured in simulated seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtests import runner
from loadtests.scenario import Scenario
from loadtests.stats import RequestRecord, Sample, summarize, to_engine_time
from tests.support.procs import Proc, start_gateway, start_sim

ARMS = ("direct", "kvgate", "vllm-queue")
OOM_LINE = re.compile(r"CUDA out of memory")


@dataclass
class ArmResult:
    arm: str
    records: list[RequestRecord]
    samples: list[Sample]
    summary: dict[str, Any]


def model_name(scenario: Scenario) -> str:
    args = list(scenario.sim_args)
    if "--served-model-name" in args:
        return args[args.index("--served-model-name") + 1]
    from gateway.sim.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(args)).served_model_name


def sim_args(scenario: Scenario, arm: str) -> list[str]:
    args = [*scenario.sim_args, "--time-scale", str(scenario.time_scale), "--oom-mode", "restart"]
    if arm == "vllm-queue":
        if scenario.vllm_queue_max is None:
            raise ValueError(f"scenario {scenario.name} has no vllm_queue.max_num_queued_reqs")
        args += ["--max-num-queued-reqs", str(scenario.vllm_queue_max)]
    return args


def gateway_config(scenario: Scenario, upstream: str) -> dict[str, Any]:
    """The scenario's gateway section, with every duration converted from simulated to real seconds."""
    g = scenario.gateway
    ts = scenario.time_scale
    admission = dict(g.get("admission", {}))
    for key in ("queue_max_wait_s",):
        if key in admission:
            admission[key] = admission[key] * ts
    telemetry = dict(g.get("telemetry", {}))
    cfg: dict[str, Any] = {"upstream": {"url": upstream}, "admission": admission, "telemetry": telemetry}
    if "tenants" in g:
        cfg["tenants"] = g["tenants"]
    return cfg


def api_keys(scenario: Scenario) -> dict[str, str]:
    return {t["name"]: t["api_keys"][0] for t in scenario.gateway.get("tenants", []) if t.get("api_keys")}


@contextlib.contextmanager
def targets(scenario: Scenario, arm: str, out: Path) -> Iterator[tuple[Proc, Proc | None]]:
    with start_sim(sim_args(scenario, arm), out / "sim.log") as sim:
        if arm != "kvgate":
            yield sim, None
            return
        cfg_path = out / "kvgate.yaml"
        cfg_path.write_text(yaml.safe_dump(gateway_config(scenario, sim.url), sort_keys=False))
        with start_gateway(sim.url, cfg_path, tokenizer="heuristic", log_path=out / "kvgate.log") as gw:
            yield sim, gw


def run_arm(scenario: Scenario, arm: str, out_dir: Path) -> ArmResult:
    out = out_dir / arm
    out.mkdir(parents=True, exist_ok=True)
    with targets(scenario, arm, out) as (sim, gw):
        target = gw.url if gw else sim.url
        records, samples = asyncio.run(
            runner.run(
                scenario.arrivals(),
                target,
                sim.url,
                model=model_name(scenario),
                time_scale=scenario.time_scale,
                gateway_metrics=gw.url if gw else None,
                api_keys=api_keys(scenario),
            )
        )
        ooms = len(OOM_LINE.findall(sim.log()))
    real_t = [s.t * scenario.time_scale for s in samples]  # still on the harness clock here
    real_span = real_t[-1] - real_t[0] if len(real_t) > 1 else math.nan
    max_gap = max((b - a for a, b in itertools.pairwise(real_t)), default=math.nan)
    records, samples = to_engine_time(records, samples)
    summary = summarize(records, samples, scenario.ttft_slo_s, ooms)
    summary["arm"] = arm
    summary["sample_hz_real"] = (len(samples) - 1) / real_span if real_span else math.nan
    summary["sample_max_gap_real_s"] = max_gap
    runner.save(out, records, samples, summary)
    return ArmResult(arm, records, samples, summary)


def compare(scenario: Scenario, arms: tuple[str, ...], out_dir: Path) -> list[ArmResult]:
    results = [run_arm(scenario, arm, out_dir) for arm in arms]
    (out_dir / "compare.json").write_text(json.dumps([r.summary for r in results], indent=2, default=str) + "\n")
    return results
