"""``compare``: one scenario, three arms, each on a fresh simulator:

* ``direct``: clients talk to the simulated vLLM;
* ``kvgate``: clients talk to ``kvgate serve`` in front of it;
* ``kvgate-worst``: the same, with ``admission.output_estimate.enabled: false``: every request reserved at its
  worst case (``max_tokens``, or the context's rest), as before the output estimate;
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

ARMS = ("direct", "kvgate", "kvgate-worst", "vllm-queue")
GATEWAY_ARMS = ("kvgate", "kvgate-worst")
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


def gateway_config(scenario: Scenario, upstream: str, arm: str = "kvgate") -> dict[str, Any]:
    """The scenario's gateway section, with every duration converted from simulated to real seconds;
    ``kvgate-worst`` turns the output estimate off (worst-case reservations)."""
    if arm not in GATEWAY_ARMS:
        raise ValueError(f"arm {arm} has no gateway")
    g = scenario.gateway
    ts = scenario.time_scale
    admission = dict(g.get("admission", {}))
    for key in ("queue_max_wait_s",):
        if key in admission:
            admission[key] = admission[key] * ts
    if arm == "kvgate-worst":
        admission["output_estimate"] = {**admission.get("output_estimate", {}), "enabled": False}
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
        if arm not in GATEWAY_ARMS:
            yield sim, None
            return
        cfg_path = out / "kvgate.yaml"
        cfg_path.write_text(yaml.safe_dump(gateway_config(scenario, sim.url, arm), sort_keys=False))
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


def load_arm(out_dir: Path, arm: str) -> ArmResult:
    """An arm saved by ``run_arm`` (``runner.save``), read back for a report without running it again."""
    out = out_dir / arm
    records = [RequestRecord(**json.loads(line)) for line in (out / "requests.jsonl").read_text().splitlines()]
    samples = []
    lines = (out / "samples.csv").read_text().splitlines()
    names = lines[0].split(",")
    for line in lines[1:]:
        row = dict(zip(names, line.split(","), strict=True))
        samples.append(
            Sample(
                **{
                    k: (bool(int(v)) if k == "up" else float(v))
                    for k, v in row.items()
                    if k in Sample.__dataclass_fields__
                }
            )
        )
    return ArmResult(arm, records, samples, json.loads((out / "summary.json").read_text()))


def compare(scenario: Scenario, arms: tuple[str, ...], out_dir: Path, reuse: bool = False) -> list[ArmResult]:
    """Run every arm (``reuse``: read back the arms already saved under ``out_dir``, run only the missing)."""
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    results = [
        load_arm(out_dir, arm)
        if reuse and (out_dir / arm / "summary.json").exists()
        else run_arm(scenario, arm, out_dir)
        for arm in arms
    ]
    (out_dir / "compare.json").write_text(json.dumps([r.summary for r in results], indent=2, default=str) + "\n")
    return results
