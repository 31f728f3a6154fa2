"""The arrival pacer: a burst is priced a few per loop iteration, in arrival order, and the I/O of requests
already admitted runs in between."""

from __future__ import annotations

import asyncio

import pytest

from gateway.server.pacing import ArrivalPacer


class Arrivals:
    """Arrivals through one pacer, recorded in the order they were let through."""

    def __init__(self, per_tick: int) -> None:
        self.pacer = ArrivalPacer(per_tick)
        self.order: list[int] = []

    async def arrive(self, i: int) -> None:
        await self.pacer.turn()
        self.order.append(i)

    def start(self, ids: range) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self.arrive(i)) for i in ids]


async def _burst(pacer: ArrivalPacer, n: int, log: list[str]) -> None:
    async def arrival(i: int) -> None:
        await pacer.turn()
        log.append(f"priced {i}")
        await asyncio.sleep(0)  # what an admitted request's connect costs at least: one loop iteration
        log.append(f"sent {i}")

    await asyncio.gather(*(arrival(i) for i in range(n)))


def test_a_burst_is_priced_in_order_and_the_first_are_sent_before_the_last_is_priced() -> None:
    log: list[str] = []
    pacer = ArrivalPacer(per_tick=4)
    asyncio.run(_burst(pacer, 40, log))
    priced = [int(e.split()[1]) for e in log if e.startswith("priced")]
    assert priced == list(range(40))
    assert log.index("sent 0") < log.index("priced 39") // 2  # without pacing: after all 40 are priced
    assert pacer.deferred == 36 and pacer.waiting == 0


def test_without_pacing_every_arrival_is_priced_before_any_is_sent() -> None:
    """The baseline the pacer exists for: one iteration runs the whole burst."""
    log: list[str] = []
    asyncio.run(_burst(ArrivalPacer(per_tick=1000), 40, log))
    assert log.index("sent 0") == 40


@pytest.mark.parametrize("per_tick", [1, 3, 8])
def test_at_most_per_tick_arrivals_pass_between_two_loop_iterations(per_tick: int) -> None:
    async def run() -> list[int]:
        pacer = ArrivalPacer(per_tick)
        passed_per_iteration: list[int] = []
        count = 0

        async def arrival() -> None:
            nonlocal count
            await pacer.turn()
            count += 1

        async def clock() -> None:  # one sample per loop iteration
            nonlocal count
            for _ in range(60):
                await asyncio.sleep(0)
                passed_per_iteration.append(count)
                count = 0

        await asyncio.gather(clock(), *(arrival() for _ in range(25)))
        return passed_per_iteration

    counts = asyncio.run(run())
    assert max(counts) <= per_tick and sum(counts) == 25


def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    async def run() -> list[int]:
        arrivals = Arrivals(per_tick=1)
        tasks = arrivals.start(range(4))
        await asyncio.sleep(0)  # all four have arrived: 0 passed, 1..3 wait
        tasks[1].cancel()  # its client went away while it waited
        await asyncio.gather(*tasks, return_exceptions=True)
        assert arrivals.pacer.waiting == 0
        return arrivals.order

    assert asyncio.run(run()) == [0, 2, 3]


def test_a_lone_arrival_does_not_wait() -> None:
    async def run() -> bool:
        pacer = ArrivalPacer(per_tick=1)
        step = pacer.turn()
        try:
            step.send(None)  # runs to completion without suspending: StopIteration
        except StopIteration:
            return True
        return False

    assert asyncio.run(run())
    with pytest.raises(ValueError):
        ArrivalPacer(0)


def test_arrivals_of_later_iterations_queue_behind_those_given_their_turn() -> None:
    """Six arrivals, then three more an iteration later, while two of the first six have been given their turn
    but not yet resumed: the three wait behind them."""

    async def run() -> list[int]:
        arrivals = Arrivals(per_tick=4)
        first = arrivals.start(range(6))
        await asyncio.sleep(0)  # 0-3 passed, 4-5 wait
        # the next iteration runs the tick (4 and 5 get their turn: they resume one iteration later), then these
        later = arrivals.start(range(6, 9))
        await asyncio.gather(*first, *later)
        return arrivals.order

    assert asyncio.run(run()) == list(range(9))


def test_a_waiter_cancelled_after_its_turn_came_does_not_block_the_rest() -> None:
    async def run() -> list[int]:
        arrivals = Arrivals(per_tick=1)
        tasks = arrivals.start(range(3))
        await asyncio.sleep(0)  # 0 passed; 1 and 2 wait
        await asyncio.sleep(0)  # the tick gave 1 its turn: it resumes next iteration
        tasks[1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert arrivals.pacer.waiting == 0 and arrivals.pacer._woken == 0
        return arrivals.order

    assert asyncio.run(run()) == [0, 2]


def test_arrivals_one_per_iteration_never_wait_and_schedule_no_callback_until_the_allowance_is_spent() -> None:
    """At concurrency 1 every request arrives in an iteration of its own: none is deferred, and the pacer wakes
    the loop once per ``per_tick`` arrivals, not once per arrival."""

    async def run() -> tuple[list[bool], int]:
        pacer = ArrivalPacer(per_tick=4)
        pending: list[bool] = []
        for _ in range(12):
            await pacer.turn()
            pending.append(pacer._tick_pending)
            await asyncio.sleep(0)  # the request's I/O: the next arrival comes in a later iteration
        return pending, pacer.deferred

    pending, deferred = asyncio.run(run())
    assert deferred == 0
    assert pending == [False, False, False, True] * 3
