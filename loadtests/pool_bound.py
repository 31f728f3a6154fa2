"""What an ideal admission policy gets out of a pool of simulated engines on one request plan, in-process.

The pool analogue of ``bound.py``: the scenario's exact plan runs through ``N`` of the simulator's ``Engine``s
(virtual time, no sockets, no gateway), each stepping on its own clock. A request is placed on an engine only
while that engine's worst-case reservations (``prompt + max_tokens`` blocks of every request placed there and
not finished) stay within ``band`` of its pool, so no engine passes the band; requests wait in FIFO order:

* ``shared``: one queue for the pool, the head placed on the engine with the most headroom left after it (what
  ``kvgate serve --upstream A --upstream B ...`` does);
* ``round-robin``: request ``i`` belongs to engine ``i mod N`` and waits in that engine's own queue (one kvgate
  per engine behind a blind load balancer: the sidecar layout).

A request still queued ``max_wait_s`` after it arrived is refused. Steps that would OOM are counted, not
enacted. Pure and deterministic: a reference for the HTTP runs, not a measurement of them.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.sim.blocks import blocks_for
from gateway.sim.cli import build_parser, config_from_args
from gateway.sim.config import SimConfig
from gateway.sim.engine import Engine, SimRequest, Step
from loadtests.scenario import Arrival
from loadtests.stats import percentile

POLICIES = ("shared", "round-robin")


@dataclass
class _Slot:
    """One engine of the pool with its in-flight step and its reservations."""

    engine: Engine
    capacity: int  # allocatable blocks
    step: Step | None = None
    step_end: float = math.inf
    reserved: dict[str, int] = field(default_factory=dict)
    peak: float = 0.0
    oom_steps: int = 0
    placed: int = 0

    @property
    def reserved_blocks(self) -> int:
        return sum(self.reserved.values())


def engine_configs(sim_args: Sequence[Sequence[str]]) -> list[SimConfig]:
    return [config_from_args(build_parser().parse_args(list(args))) for args in sim_args]


def pool_run(
    arrivals: Sequence[Arrival],
    configs: Sequence[SimConfig],
    policy: str,
    band: float = 0.90,
    max_wait_s: float = math.inf,
) -> dict[str, Any]:
    """Run ``arrivals`` through one ``Engine`` per config under ``policy``; the pool's and each engine's numbers."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    slots = [_Slot(Engine(cfg), cfg.num_gpu_blocks - 1) for cfg in configs]
    n = len(slots)
    pending = collections.deque(enumerate(arrivals))
    queues: list[collections.deque[tuple[int, Arrival]]] = [
        collections.deque() for _ in range(n if policy != "shared" else 1)
    ]
    requests: dict[str, tuple[Arrival, SimRequest]] = {}
    refused = 0
    now = 0.0

    def cost(a: Arrival) -> int:
        return blocks_for(a.prompt_tokens + a.max_tokens, configs[0].block_size)

    def headroom_after(s: _Slot, blocks: int) -> float | None:
        left = band * s.capacity - s.reserved_blocks - blocks
        return left / s.capacity if left >= 0 else None

    def place(i: int, a: Arrival, s: _Slot) -> None:
        rid = str(i)
        req = SimRequest(rid, a.prompt_tokens, a.max_tokens, now)
        s.engine.add(req)
        s.reserved[rid] = cost(a)
        s.placed += 1
        requests[rid] = (a, req)

    def dispatch() -> None:
        if policy == "shared":
            q = queues[0]
            while q:
                i, a = q[0]
                fits = [(h, k) for k, s in enumerate(slots) if (h := headroom_after(s, cost(a))) is not None]
                if not fits:
                    return
                q.popleft()
                place(i, a, slots[max(fits)[1]])
        else:
            for k, q in enumerate(queues):
                while q and headroom_after(slots[k], cost(q[0][1])) is not None:
                    i, a = q.popleft()
                    place(i, a, slots[k])

    while True:
        while pending and pending[0][1].at <= now:
            i, a = pending.popleft()
            queues[0 if policy == "shared" else i % n].append((i, a))
        for q in queues:
            while q and q[0][1].at + max_wait_s <= now:
                q.popleft()
                refused += 1
        dispatch()
        for s in slots:
            if s.step is None and s.engine.has_work():
                s.step = s.engine.schedule(now)
                s.oom_steps += s.step.oom
                s.peak = max(s.peak, s.engine.usage())
                s.step_end = now + s.step.duration
        events = [s.step_end for s in slots]
        if pending:
            events.append(pending[0][1].at)
        events += [q[0][1].at + max_wait_s for q in queues if q]
        nxt = min(events, default=math.inf)
        if nxt == math.inf:
            break
        now = max(now, nxt)
        for s in slots:
            if s.step is not None and s.step_end <= now:
                for ev in s.engine.complete(s.step, s.step_end):
                    if ev.finished:
                        s.reserved.pop(ev.request.request_id, None)
                s.step, s.step_end = None, math.inf
    done = [(a, r) for a, r in requests.values() if r.finished_at is not None]
    tokens = sum(r.num_output for _, r in done)
    start = min((a.at for a in arrivals), default=0.0)
    makespan = max((r.finished_at or 0.0 for _, r in done), default=start) - start
    return {
        "policy": policy,
        "band": band,
        "max_wait_s": max_wait_s,
        "requests": len(arrivals),
        "served": len(done),
        "refused": refused,
        "makespan_s": makespan,
        "output_tok_per_s": tokens / makespan if makespan > 0 else math.nan,
        "ttft_p50_s": percentile([r.first_token - a.at for a, r in done if r.first_token is not None], 0.5),
        "ttft_p99_s": percentile([r.first_token - a.at for a, r in done if r.first_token is not None], 0.99),
        "engines": [
            {
                "blocks": s.capacity + 1,
                "placed": s.placed,
                "peak_kv_usage": s.peak,
                "preemptions": s.engine.stats.num_preemptions,
                "oom_steps": s.oom_steps,
            }
            for s in slots
        ],
    }
