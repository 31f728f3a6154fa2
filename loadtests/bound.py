"""What a concurrency cap can get out of the simulated engine on one finite burst, with no HTTP in between.

The closed-loop sweep measures the engine in steady state. A finite burst also has a start (every request
prefilling, nothing decoded yet) and a drain (the last requests decode at falling concurrency) that no
admission policy can avoid. To see how much of the gap to the steady-state figure is the burst's own
shape, this runs the scenario's exact request plan through the simulator's engine in-process (``Engine``,
virtual time, no sockets, no gateway) with a FIFO cap of ``c`` requests inside the engine, for each ``c``,
and reports the whole-run output throughput (output tokens / makespan, as ``compare`` computes it for an
arm), preemptions, OOM steps and peak KV usage. Pure and deterministic.
"""

from __future__ import annotations

import collections
from typing import Any

from gateway.sim.cli import build_parser, config_from_args
from gateway.sim.engine import Engine, SimRequest
from loadtests.scenario import Scenario


def capped_run(scenario: Scenario, cap: int) -> dict[str, Any]:
    cfg = config_from_args(build_parser().parse_args(list(scenario.sim_args)))
    eng = Engine(cfg)
    pending = collections.deque(scenario.arrivals())
    now, in_engine, oom_steps, peak, n = 0.0, 0, 0, 0.0, 0
    while pending or eng.has_work():
        while pending and in_engine < cap and pending[0].at <= now:
            a = pending.popleft()
            n += 1
            eng.add(SimRequest(str(n), a.prompt_tokens, a.max_tokens, now))
            in_engine += 1
        if not eng.has_work():
            now = pending[0].at
            continue
        step = eng.schedule(now)
        oom_steps += step.oom  # counted, not enacted: the run goes on as if the card were larger
        peak = max(peak, eng.usage())
        now += step.duration
        in_engine -= sum(1 for ev in eng.complete(step, now) if ev.finished)
    return {
        "cap": cap,
        "makespan_s": now,
        "output_tok_per_s": eng.stats.generation_tokens / now if now else float("nan"),
        "preemptions": eng.stats.num_preemptions,
        "oom_steps": oom_steps,
        "peak_kv_usage": peak,
        "stable": eng.stats.num_preemptions == 0 and oom_steps == 0,
    }


def burst_bound(scenario: Scenario, caps: tuple[int, ...]) -> dict[str, Any]:
    rows = [capped_run(scenario, c) for c in caps]
    stable = [r for r in rows if r["stable"]]
    return {"rows": rows, "best_stable": max(stable, key=lambda r: r["output_tok_per_s"]) if stable else None}
