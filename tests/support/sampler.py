"""The one 20 Hz ``/metrics`` sampler, for the burst tests and the load tests.

It runs in a ``spawn``ed process with its own event loop: in the client's loop, or even a thread of the client,
it is starved by the streams being parsed (measured: 2.5-6.5 Hz in the loop, ~12 Hz in a thread against the
vLLM engine, under 10 Hz with hundreds of load-test streams) while /metrics itself answers in ~10 ms.

Every 1/hz seconds it starts a scrape of each target without waiting for the previous one (at most
``MAX_IN_FLIGHT`` outstanding per target), so one slow answer delays only its own reading, not the schedule. A
reading is stamped (``time.monotonic()``, system-wide on Linux, so comparable with the caller's clock) when its
answer arrives, or when it was sent if the scrape failed or took over ``TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import time
from collections.abc import Collection, Sequence
from typing import Any

import aiohttp

from tests.support.promtext import metric_sum, parse_metrics

HZ = 20.0
TIMEOUT_S = 2.0
MAX_IN_FLIGHT = 8

# (stamp, {metric: sum over its samples, NaN if absent}), or (stamp, None) for a failed scrape
Reading = tuple[float, dict[str, float] | None]
Target = tuple[str, Collection[str]]  # (base URL, the metrics wanted from it)


async def _read(session: aiohttp.ClientSession, url: str, names: Collection[str]) -> dict[str, float] | None:
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as response:
            if response.status == 200:
                series = parse_metrics(await response.text(), names)
                return {name: metric_sum(series, name, default=math.nan) for name in names}
    except (TimeoutError, aiohttp.ClientError):
        pass
    return None


async def _poll(targets: Sequence[Target], hz: float, stop: asyncio.Event, ready: Any) -> list[list[Reading]]:
    out: list[list[Reading]] = [[] for _ in targets]
    in_flight: list[set[asyncio.Task[None]]] = [set() for _ in targets]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(i: int) -> None:
            sent = time.monotonic()
            values = await _read(session, *targets[i])
            out[i].append((time.monotonic() if values is not None else sent, values))

        ready.set()
        period = 1.0 / hz
        next_at = time.monotonic()
        while not stop.is_set():
            for i in range(len(targets)):
                if len(in_flight[i]) < MAX_IN_FLIGHT:
                    task = asyncio.create_task(one(i))
                    in_flight[i].add(task)
                    task.add_done_callback(in_flight[i].discard)
            next_at = max(next_at + period, time.monotonic() - period)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
        pending = {task for tasks in in_flight for task in tasks}
        if pending:
            await asyncio.wait(pending)
    return [sorted(readings, key=lambda r: r[0]) for readings in out]


def _main(targets: Sequence[Target], hz: float, ready: Any, stop: Any, results: Any) -> None:
    """The sampler process: poll until the parent sets ``stop``, then send the readings back."""

    async def main() -> list[list[Reading]]:
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (stop.wait(), loop.call_soon_threadsafe(stopped.set)))
        return await _poll(targets, hz, stopped, ready)

    results.put(asyncio.run(main()))


class Sampler:
    """``Sampler([(url, names), ...]).start()``, the burst, then ``stop()``: the readings of each target, in order.

    Both calls block (``asyncio.to_thread`` them from a running loop).
    """

    def __init__(self, targets: Sequence[Target], hz: float = HZ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._results: Any = ctx.Queue()
        wanted = [(url, set(names)) for url, names in targets]
        self._proc = ctx.Process(target=_main, args=(wanted, hz, self._ready, self._stop, self._results), daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the process and wait until its first scrape is under way."""
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the /metrics sampler process did not start (exit {self._proc.exitcode})")

    def stop(self) -> list[list[Reading]]:
        self._stop.set()
        readings: list[list[Reading]] = self._results.get(True, 60.0)
        self._proc.join(10.0)
        return readings
