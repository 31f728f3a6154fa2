"""What a concurrency cap can get out of the simulated engine on one finite burst, with no HTTP in between.

The closed-loop sweep measures the engine in steady state. A finite burst also has a start (every request
prefilling, nothing decoded yet) and a drain (the last requests decode at falling concurrency) that no
admission policy can avoid. To see how much of the gap to the steady-state figure is the burst's own
shape, this runs the scenario's exact request plan through the simulator's engine in-process (``Engine``,
virtual time, no sockets, no gateway) with a FIFO cap of ``c`` requests inside the engine, for each ``c``,
and reports the whole-run output throughput (output tokens / makespan, as ``compare`` computes it for an
arm), the throughput while requests were waiting (in the engine or behind the cap), preemptions, OOM steps
and peak KV usage. Pure and deterministic.
"""

from __future__ import annotations

import collections
import random
import sys
from typing import Any

from gateway.sim.cli import build_parser, config_from_args
from gateway.sim.engine import Engine, SimRequest
from loadtests.scenario import Scenario, load


def capped_run(scenario: Scenario, cap: int) -> dict[str, Any]:
    cfg = config_from_args(build_parser().parse_args(list(scenario.sim_args)))
    eng = Engine(cfg)
    pending = collections.deque(scenario.arrivals())
    now, in_engine, oom_steps, peak, n = 0.0, 0, 0, 0.0, 0
    queued_s, queued_tokens = 0.0, 0
    while pending or eng.has_work():
        while pending and in_engine < cap and pending[0].at <= now:
            a = pending.popleft()
            n += 1
            eng.add(SimRequest(str(n), a.prompt_tokens, a.max_tokens, now))
            in_engine += 1
        if not eng.has_work():
            now = pending[0].at
            continue
        queued = bool(pending or eng.waiting)
        step = eng.schedule(now)
        oom_steps += step.oom  # counted, not enacted: the run goes on as if the card were larger
        peak = max(peak, eng.usage())
        now += step.duration
        before = eng.stats.generation_tokens
        in_engine -= sum(1 for ev in eng.complete(step, now) if ev.finished)
        if queued:  # as ``stats.saturated_throughput``: output while requests were waiting somewhere
            queued_s += step.duration
            queued_tokens += eng.stats.generation_tokens - before
    return {
        "cap": cap,
        "makespan_s": now,
        "output_tok_per_s": eng.stats.generation_tokens / now if now else float("nan"),
        "saturated_tok_per_s": queued_tokens / queued_s if queued_s else float("nan"),
        "preemptions": eng.stats.num_preemptions,
        "oom_steps": oom_steps,
        "peak_kv_usage": peak,
        "stable": eng.stats.num_preemptions == 0 and oom_steps == 0,
    }


def burst_bound(scenario: Scenario, caps: tuple[int, ...]) -> dict[str, Any]:
    rows = [capped_run(scenario, c) for c in caps]
    stable = [r for r in rows if r["stable"]]
    return {"rows": rows, "best_stable": max(stable, key=lambda r: r["output_tok_per_s"]) if stable else None}


def closed_loop_capacity(
    scenario: Scenario,
    concurrency: int,
    duration_s: float = 200.0,
    warmup_s: float = 30.0,
    stagger_s: float = 0.0,
    largest_class: bool = False,
    mixed: bool = False,
) -> dict[str, Any]:
    """The engine's own closed-loop throughput: ``concurrency`` clients, each replacing its request the moment
    it finishes, in-process (no HTTP), sizes drawn from the scenario's first class (or its largest one, or,
    ``mixed``, from the whole mix in proportion to the classes' rates); a request runs to its natural length
    when its class has one, else to its cap; client ``i`` starts at ``stagger_s * i / concurrency``; rates
    over ``[warmup_s, duration_s]``. Steps that would OOM are counted, not enacted."""
    cfg = config_from_args(build_parser().parse_args(list(scenario.sim_args)))
    cls = max(scenario.classes, key=lambda c: c.prompt_tokens.max) if largest_class else scenario.classes[0]
    rng = random.Random(scenario.seed)
    natural_rng = random.Random(f"{scenario.seed}/output_tokens")
    eng = Engine(cfg)
    n = done = 0

    def add(now: float) -> None:
        nonlocal n
        n += 1
        a = scenario.draw_mixed(rng, natural_rng) if mixed else scenario.draw(cls, rng, natural_rng)
        eng.add(SimRequest(str(n), a.prompt_tokens, a.max_tokens, now))

    starts = collections.deque(stagger_s * i / concurrency for i in range(concurrency))
    now, oom_steps, kv_time, t0, done0, gen0 = 0.0, 0, 0.0, None, 0, 0
    while now < duration_s:
        while starts and starts[0] <= now:
            starts.popleft()
            add(now)
        if not eng.has_work():
            now = starts[0]
            continue
        step = eng.schedule(now)
        oom_steps += step.oom
        now += step.duration
        if now >= warmup_s:
            if t0 is None:
                t0, done0, gen0 = now, done, eng.stats.generation_tokens
            kv_time += step.duration * eng.usage()
        for ev in eng.complete(step, now):
            if ev.finished:
                done += 1
                add(now)
    assert t0 is not None
    span = now - t0
    return {
        "concurrency": concurrency,
        "req_per_s": (done - done0) / span,
        "output_tok_per_s": (eng.stats.generation_tokens - gen0) / span,
        "mean_kv_usage": kv_time / span,
        "preemptions": eng.stats.num_preemptions,
        "oom_steps": oom_steps,
        "stable": eng.stats.num_preemptions == 0 and oom_steps == 0,
    }


if __name__ == "__main__":
    # python3 -m loadtests.bound SCENARIO C1,C2,...: the engine's closed-loop capacity for that scenario
    sc = load(sys.argv[1])
    for c in (int(x) for x in sys.argv[2].split(",")):
        print(closed_loop_capacity(sc, c))
