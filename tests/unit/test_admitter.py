"""The asyncio shell: queued waiters, cancellation races and deadlines never leak a reservation."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import AdmissionController, UsageSample
from gateway.admitter import Admitter
from gateway.config import AdmissionConfig
from gateway.cost import KvGeometry, RequestCost
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**cfg: object) -> tuple[Admitter, Clock]:
    clock = Clock()
    controller = AdmissionController(AdmissionConfig(**cfg), KvGeometry(16, 100))  # type: ignore[arg-type]
    admitter = Admitter(controller, GatewayMetrics(), clock)
    admitter.begin_sample()
    admitter.on_sample(UsageSample(0.0, 0.0))
    return admitter, clock


def rc(blocks: int) -> RequestCost:
    return RequestCost((16,), 1, blocks * 16 - 16, blocks)


async def hold(admitter: Admitter, blocks: int, release: asyncio.Event, fail: bool = False) -> str:
    async with admitter.reserve(rc(blocks), "t") as admission:
        await release.wait()
        if fail:
            admission.outcome = "upstream_error"
            raise RuntimeError("upstream broke")
    return "done"


async def test_queued_request_is_woken_when_capacity_frees() -> None:
    admitter, _ = make()
    first_release, second_release = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(hold(admitter, 80, first_release))
    second = asyncio.create_task(hold(admitter, 50, second_release))
    await asyncio.sleep(0)
    assert len(admitter.controller.queue) == 1
    first_release.set()
    await first
    await asyncio.sleep(0)
    assert len(admitter.controller.queue) == 0 and len(admitter.controller.ledger) == 1
    second_release.set()
    await second
    assert len(admitter.controller.ledger) == 0


async def test_deadline_gives_503_with_retry_after() -> None:
    admitter, clock = make(queue_max_wait_s=1.0)
    gate = asyncio.Event()
    blocker = asyncio.create_task(hold(admitter, 90, gate))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold(admitter, 10, asyncio.Event()))
    await asyncio.sleep(0)
    clock.now = 1.5
    admitter._expire()
    with pytest.raises(GatewayError) as err:
        await waiter
    assert err.value.status == 503 and err.value.retry_after_s is not None
    gate.set()
    await blocker
    assert len(admitter.controller.ledger) == 0


async def test_cancel_in_the_instant_of_admission_returns_the_blocks() -> None:
    admitter, _ = make()
    gate = asyncio.Event()
    blocker = asyncio.create_task(hold(admitter, 90, gate))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold(admitter, 10, asyncio.Event()))
    await asyncio.sleep(0)
    gate.set()
    await blocker  # release -> pump -> the waiter's future gets its reservation...
    waiter.cancel()  # ...and the client disconnects before the waiter runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    ledger = admitter.controller.ledger
    assert len(ledger) == 0 and ledger.reserved_count == ledger.released_count == 2


OPS = st.lists(
    st.tuples(st.sampled_from(["submit", "complete", "fail", "disconnect", "timeout", "sample"]), st.integers(0, 60)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_no_reservation_is_left_behind(script: list[tuple[str, int]]) -> None:
    """Any interleaving of admit, complete, upstream failure, disconnect (queued or in flight) and timeout
    leaves the ledger empty, with every reservation released exactly once."""

    async def run() -> None:
        admitter, clock = make(queue_max_wait_s=1.0, queue_max_length=8)
        tasks: list[tuple[asyncio.Task[str], asyncio.Event, list[bool]]] = []
        for op, arg in script:
            if op == "submit":
                event, fail = asyncio.Event(), [False]
                task = asyncio.create_task(_hold_flag(admitter, 1 + arg % 60, event, fail))
                tasks.append((task, event, fail))
            elif tasks and op in ("complete", "fail"):
                _, event, fail = tasks[arg % len(tasks)]
                fail[0] = op == "fail"
                event.set()
            elif tasks and op == "disconnect":
                tasks[arg % len(tasks)][0].cancel()
            elif op == "timeout":
                clock.now += 0.3 + arg / 100
                admitter._expire()
            elif op == "sample":
                admitter.begin_sample()
                admitter.on_sample(UsageSample(arg / 100, clock.now))
            await asyncio.sleep(0)
        for _, event, _ in tasks:
            event.set()
        clock.now += 100
        admitter._expire()
        await asyncio.gather(*(t for t, _, _ in tasks), return_exceptions=True)
        ledger = admitter.controller.ledger
        assert len(ledger) == 0 and ledger.reserved_blocks == 0
        assert ledger.reserved_count == ledger.released_count
        assert len(admitter.controller.queue) == 0 and not admitter._waiters

    asyncio.run(run())


async def _hold_flag(admitter: Admitter, blocks: int, release: asyncio.Event, fail: list[bool]) -> str:
    async with admitter.reserve(rc(blocks), "t"):
        await release.wait()
        if fail[0]:
            raise RuntimeError("upstream broke")
    return "done"
