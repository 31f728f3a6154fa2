"""Concurrency sweep: the engine's best *stable* throughput (no preemption, no OOM) for one request mix.

Closed loop at each concurrency on a fresh simulator; the best stable level is the reference the
``compare`` throughput is judged against.

Method (documented in loadtests/README.md):

* every request's prompt and output length are drawn from the scenario's largest traffic class (the burst's
  own size distribution, seeded), or, when the scenario has natural output lengths, from its whole mix
  (classes in proportion to their rates, each request running to its natural length: the offered work),
  and client ``i`` starts at ``stagger_s * i / c``: with one fixed shape
  and simultaneous starts the clients prefill, decode and finish in lockstep, and a window then holds a
  fractional number of those cycles, which made the old sweep swing by +-15% between neighbouring levels;
* throughput is the engine's generation-token counter over ``[first send + warmup_s, last send]`` in
  simulated time, i.e. only while all ``c`` clients have a request in flight (the old window ran on into the
  drain after the last send, when concurrency falls);
* the window is cut into ``blocks`` equal parts and the lowest and highest block rates are reported next to
  the mean as its spread; ``repeats`` runs per level (different seeds) are averaged;
* each level is also run in-process through the simulator's engine (``bound.closed_loop_capacity``: same
  sizes, stagger and window, no HTTP), which is deterministic and free of the clients' round trips.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

from loadtests import runner
from loadtests.bound import closed_loop_capacity
from loadtests.compare import model_name
from loadtests.scenario import Arrival, Scenario
from loadtests.stats import Sample, counter_increase, to_engine_time
from tests.support.procs import start_sim


def window_rates(samples: list[Sample], t0: float, t1: float, blocks: int) -> tuple[float, list[float]]:
    """Generation tok/s over ``[t0, t1]`` and over each of ``blocks`` equal parts of it (reset-aware)."""
    up = [s for s in samples if s.up]

    def rate(a: float, b: float) -> float:
        w = [s for s in up if a <= s.t <= b]
        if len(w) < 2 or w[-1].t <= w[0].t:
            return float("nan")
        return counter_increase([s.generation_tokens for s in w]) / (w[-1].t - w[0].t)

    edges = [t0 + (t1 - t0) * k / blocks for k in range(blocks + 1)]
    return rate(t0, t1), [rate(a, b) for a, b in itertools.pairwise(edges)]


def sweep(scenario: Scenario, out_dir: Path) -> dict[str, Any]:
    cls = max(scenario.classes, key=lambda c: c.prompt_tokens.max)
    cfg = scenario.sweep
    rows = []
    for c in scenario.sweep_concurrency:
        runs = []
        for rep in range(cfg.repeats):
            rng = random.Random(f"{scenario.seed}/{c}/{rep}")

            natural_rng = random.Random(f"{scenario.seed}/{c}/{rep}/output_tokens")

            def draw(_n: int, rng: random.Random = rng, natural_rng: random.Random = natural_rng) -> Arrival:
                if scenario.natural:  # the offered work is the mix's natural lengths
                    return scenario.draw_mixed(rng, natural_rng)
                return Arrival(0.0, cls.name, cls.prompt_tokens.draw(rng), cls.max_tokens.draw(rng), cls.api, None)

            args = [*scenario.sim_args, "--time-scale", str(scenario.time_scale), "--oom-mode", "restart"]
            suffix = f"-r{rep}" if cfg.repeats > 1 else ""
            with start_sim(args, out_dir / f"sweep-c{c}{suffix}.log") as sim:
                records, samples = asyncio.run(
                    runner.closed_loop(
                        sim.url,
                        sim.url,
                        draw,
                        c,
                        cfg.duration_s,
                        model=model_name(scenario),
                        time_scale=scenario.time_scale,
                        stagger_s=cfg.stagger_s,
                    )
                )
                ooms = len(re.findall("CUDA out of memory", sim.log()))
            records, samples = to_engine_time(records, samples)
            t0 = min(r.sent for r in records) + cfg.warmup_s
            t_end = max(r.sent for r in records)
            mean, per_block = window_rates(samples, t0, t_end, cfg.blocks)
            runs.append(
                {
                    "output_tok_per_s": mean,
                    "block_tok_per_s": per_block,
                    "window_s": [t0, t_end],
                    "preemptions": counter_increase([s.preemptions for s in samples]),
                    "oom_crashes": ooms,
                    "peak_kv_usage": max((s.kv for s in samples if s.up), default=0.0),
                    "mean_kv_usage_in_window": _mean_kv(samples, t0, t_end),
                    "requests": len(records),
                    "sim_lag_real_s": max((s.lag for s in samples if s.lag == s.lag), default=float("nan")),
                }
            )
        blocks = [b for r in runs for b in r["block_tok_per_s"] if b == b]
        row = {
            "concurrency": c,
            "output_tok_per_s": sum(r["output_tok_per_s"] for r in runs) / len(runs),
            "min_block_tok_per_s": min(blocks, default=float("nan")),
            "max_block_tok_per_s": max(blocks, default=float("nan")),
            "preemptions": sum(r["preemptions"] for r in runs),
            "oom_crashes": sum(r["oom_crashes"] for r in runs),
            "peak_kv_usage": max(r["peak_kv_usage"] for r in runs),
            "mean_kv_usage_in_window": sum(r["mean_kv_usage_in_window"] for r in runs) / len(runs),
            "runs": runs,
        }
        row["stable"] = row["preemptions"] == 0 and row["oom_crashes"] == 0
        # The same closed loop through the engine in-process: no HTTP, no machine load, deterministic.
        ip = closed_loop_capacity(
            scenario,
            c,
            cfg.duration_s,
            cfg.warmup_s,
            stagger_s=cfg.stagger_s,
            largest_class=True,
            mixed=scenario.natural,
        )
        row["in_process"] = ip
        rows.append(row)
        print(
            f"  sweep c={c}: {row['output_tok_per_s']:,.0f} tok/s (blocks {row['min_block_tok_per_s']:,.0f}"
            f"-{row['max_block_tok_per_s']:,.0f}), preemptions {row['preemptions']:.0f}, "
            f"OOM {row['oom_crashes']}, peak KV {row['peak_kv_usage']:.3f}",
            flush=True,
        )
    stable = [r for r in rows if r["stable"]]
    best = max(stable, key=lambda r: r["output_tok_per_s"]) if stable else None
    ip_stable = [r for r in rows if r["in_process"]["stable"]]
    best_ip = max(ip_stable, key=lambda r: r["in_process"]["output_tok_per_s"]) if ip_stable else None
    result = {
        "shape": {
            "prompt_tokens": [cls.prompt_tokens.min, cls.prompt_tokens.max],
            "max_tokens": None if cls.max_tokens is None else [cls.max_tokens.min, cls.max_tokens.max],
            "mixed_natural": scenario.natural,
        },
        "method": {
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "stagger_s": cfg.stagger_s,
            "blocks": cfg.blocks,
            "repeats": cfg.repeats,
        },
        "rows": rows,
        "best_stable": best,
        "best_stable_in_process": (
            {"concurrency": best_ip["concurrency"], **best_ip["in_process"]} if best_ip is not None else None
        ),
    }
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _mean_kv(samples: list[Sample], t0: float, t1: float) -> float:
    vals = [s.kv for s in samples if s.up and t0 <= s.t <= t1 and s.kv == s.kv]
    return sum(vals) / len(vals) if vals else float("nan")
