"""Concurrency sweep: the engine's best *stable* throughput (no preemption, no OOM) for one request shape.

Closed loop at each concurrency on a fresh simulator; the best stable level is the reference the
``compare`` throughput is judged against.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from loadtests import runner
from loadtests.compare import model_name
from loadtests.procs import start_sim
from loadtests.scenario import Arrival, Scenario
from loadtests.stats import counter_increase, to_engine_time


def sweep(scenario: Scenario, out_dir: Path) -> dict[str, Any]:
    cls = max(scenario.classes, key=lambda c: c.prompt_tokens.max)
    shape = Arrival(
        0.0,
        cls.name,
        (cls.prompt_tokens.min + cls.prompt_tokens.max) // 2,
        (cls.max_tokens.min + cls.max_tokens.max) // 2,
        cls.api,
        None,
    )
    rows = []
    for c in scenario.sweep_concurrency:
        args = [*scenario.sim_args, "--time-scale", str(scenario.time_scale), "--oom-mode", "restart"]
        with start_sim(args, out_dir / f"sweep-c{c}.log") as sim:
            records, samples = asyncio.run(
                runner.closed_loop(
                    sim.url,
                    sim.url,
                    shape,
                    c,
                    scenario.sweep_duration_s,
                    model=model_name(scenario),
                    time_scale=scenario.time_scale,
                )
            )
            ooms = len(re.findall("CUDA out of memory", sim.log()))
        records, samples = to_engine_time(records, samples)
        # Steady state: skip the first 30% (staggered ramp-up), measure generation tokens per simulated second.
        t_end = max(s.t for s in samples)
        steady = [s for s in samples if s.up and s.t >= t_end * 0.3]
        tput = counter_increase([s.generation_tokens for s in steady]) / (steady[-1].t - steady[0].t)
        row = {
            "concurrency": c,
            "output_tok_per_s": tput,
            "preemptions": counter_increase([s.preemptions for s in samples]),
            "oom_crashes": ooms,
            "peak_kv_usage": max((s.kv for s in samples if s.up), default=0.0),
            "requests": len(records),
        }
        row["stable"] = row["preemptions"] == 0 and ooms == 0
        rows.append(row)
        print(
            f"  sweep c={c}: {tput:,.0f} tok/s, preemptions {row['preemptions']:.0f}, OOM {ooms}, "
            f"peak KV {row['peak_kv_usage']:.3f}",
            flush=True,
        )
    stable = [r for r in rows if r["stable"]]
    best = max(stable, key=lambda r: r["output_tok_per_s"]) if stable else None
    result = {
        "shape": {"prompt_tokens": shape.prompt_tokens, "max_tokens": shape.max_tokens},
        "rows": rows,
        "best_stable": best,
    }
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
