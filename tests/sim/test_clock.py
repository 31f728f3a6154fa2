"""The virtual clock charges a step exactly its modelled duration, however slow the simulator's own work is."""

from __future__ import annotations

import asyncio
import time

from gateway.sim.config import preset
from gateway.sim.engine import Engine, SimRequest, TokenEvent
from gateway.sim.server import SimServer
from gateway.tokens.tokenizers import load_tokenizer

SCALE = 0.01
OVERHEAD_REAL_S = 0.004  # real seconds burnt after every step: 0.4 simulated seconds at SCALE


def modelled_span(prompt: int, max_tokens: int) -> tuple[float, int]:
    """First schedule to finish, in simulated seconds, and the number of steps, from the pure engine."""
    eng = Engine(preset("llama3-8b-h100").scaled(0.02))
    eng.add(SimRequest("a", prompt, max_tokens, 0.0))
    now, steps = 0.0, 0
    while eng.has_work():
        step = eng.schedule(now)
        now += step.duration
        steps += 1
        eng.complete(step, now)
    return now, steps


def test_simulator_overhead_between_steps_is_lag_not_engine_time() -> None:
    expected, steps = modelled_span(300, 12)

    async def main() -> tuple[SimRequest, float]:
        server = SimServer(preset("llama3-8b-h100").scaled(0.02), load_tokenizer("heuristic"), time_scale=SCALE)
        dispatch = server._dispatch
        finished = asyncio.Event()

        def slow_dispatch(events: list[TokenEvent]) -> None:
            time.sleep(OVERHEAD_REAL_S)  # a CPU-starved simulator waking hundreds of streams
            dispatch(events)
            if any(ev.finished for ev in events):
                finished.set()

        server._dispatch = slow_dispatch  # type: ignore[method-assign]
        runner = asyncio.create_task(server.run_engine())
        req = SimRequest("a", 300, 12, server.now())
        server.engine.add(req)
        server.wake.set()
        await asyncio.wait_for(finished.wait(), 60)
        server.shutdown.set()
        server.wake.set()
        await runner
        return req, server.supervisor.lag_s

    req, lag = asyncio.run(main())
    assert req.first_scheduled is not None and req.finished_at is not None
    injected = steps * OVERHEAD_REAL_S / SCALE  # what the overhead would add if it passed on the clock
    leaked = (req.finished_at - req.first_scheduled) - expected
    assert leaked >= -1e-9
    assert leaked < 0.1 * injected, (leaked, injected)
    assert lag >= steps * OVERHEAD_REAL_S * 0.9  # the overhead is accounted for as lag instead
