"""Arrivals take turns with the event loop's I/O.

A burst lands on the event loop as one run of ready tasks: hundreds of requests parsed, priced and admitted
back to back in a single loop iteration, while the connects and writes of the requests already admitted wait
behind them for the next iteration. Measured on the four-engine pool burst (800 long prompts at once): the
engines received their first requests only after the gateway had priced all 800, ~0.3 s after the first
arrival, and every TTFT of the burst carried that offset. :class:`ArrivalPacer` lets at most ``per_tick``
arrivals through per loop iteration and queues the rest in arrival order, so each iteration also runs the
I/O of what was admitted before: the first requests reach their engine while the rest are still priced.
An arrival that finds nobody ahead and room in this iteration passes without suspending, and without
scheduling anything: the allowance is renewed (by a callback in the next iteration) only once it is spent, so
arrivals spread over many iterations cost no extra loop iteration each (one wake-up of the loop per request
at concurrency 1 was measurable CPU). Arrivals spread out that way draw on one allowance until it is spent; the
iteration that spends it lets fewer through than ``per_tick``, never more.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ArrivalPacer:
    def __init__(self, per_tick: int) -> None:
        if per_tick < 1:
            raise ValueError("per_tick must be at least 1")
        self.per_tick = per_tick
        self._passed = 0  # arrivals let through since the last tick
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._woken = 0  # given their turn, not yet resumed: arrivals behind them must not overtake them
        self._tick_pending = False
        self.deferred = 0  # arrivals that had to wait for a later iteration (exported as a counter)

    async def turn(self) -> None:
        """Return when this arrival may be priced: at once, or in arrival order in a later loop iteration."""
        if not self._waiting and not self._woken and self._passed < self.per_tick:
            self._passed += 1
            if self._passed == self.per_tick:
                self._arm()  # the allowance is spent: the next iteration renews it
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self.deferred += 1
        self._arm()
        try:
            await waiter  # a waiter cancelled before its turn (its client went away) is skipped by the tick
        finally:
            if waiter.done() and not waiter.cancelled():
                self._woken -= 1  # resumed, or cancelled after its turn came: either way no longer ahead

    def _arm(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        """Runs in the iteration after the allowance was spent (and then once per iteration while arrivals wait):
        a fresh allowance, spent first on those waiting."""
        self._tick_pending = False
        self._passed = 0
        while self._waiting and self._passed < self.per_tick:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._passed += 1
                self._woken += 1
        if self._waiting or self._passed:
            self._arm()

    @property
    def waiting(self) -> int:
        return len(self._waiting)
