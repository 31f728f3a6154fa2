"""The asyncio shell and the request's exchange: queued waiters, cancellation races, failures and deadlines
never leak a reservation, and never release one twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.admitter import Admitter
from gateway.admission.controller import AdmissionController, Admitted, Queued, Rejected, UsageSample
from gateway.admission.engine import BUSY_HOLD_S, SampleMark
from gateway.admission.queue import QueueClass
from gateway.config import AdmissionConfig, RedisConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, shutting_down
from gateway.server.exchange import Exchange
from gateway.server.hints import client_hints
from gateway.server.response import ResponseWriter
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import TenantPolicy
from gateway.tenants.ratelimit import RateLimits
from gateway.tokens.cost import KvGeometry, RequestCost
from gateway.upstream.forwarder import EngineBusy, EngineUnreachable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**cfg: object) -> tuple[Admitter, Clock]:
    clock = Clock()
    controller = AdmissionController(AdmissionConfig(**cfg), KvGeometry(16, 100))  # type: ignore[arg-type]
    admitter = Admitter(controller, GatewayMetrics(), clock)
    admitter.scrape_started()
    admitter.sample(UsageSample(0.0, 0.0))
    return admitter, clock


async def _unused_send(message: object) -> None:
    raise AssertionError("nothing is written to the client here")


def exchange(admitter: Admitter) -> Exchange:
    return Exchange("req", ResponseWriter(_unused_send), admitter=admitter, counters=COUNTERS, metrics=admitter.metrics)


def tenant(admitter: Admitter) -> TenantPolicy:
    wait = admitter.controller.config.queue_max_wait_s
    return TenantPolicy("t", "t", RateLimits(), None, wait, QueueClass())


COUNTERS = TenantCounters(RedisConfig(), GatewayMetrics())


def rc(blocks: int) -> RequestCost:
    return RequestCost((16,), 1, blocks * 16 - 16, blocks)


async def hold(admitter: Admitter, blocks: int, release: asyncio.Event, fail: bool = False) -> str:
    """One request as the request path runs it: charge, admit (or queue), 'stream' until ``release``."""
    async with exchange(admitter) as ex:
        await ex.charge_rate_limits(tenant(admitter), rc(blocks))
        await ex.admit()
        ex.sending()
        await release.wait()
        if fail:
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


async def queued_behind_a_blocker(
    admitter: Admitter, gate: asyncio.Event
) -> tuple[asyncio.Task[str], asyncio.Task[str]]:
    """A request holding 90 of the 100 blocks until ``gate``, and one of 10 queued behind it."""
    blocker = asyncio.create_task(hold(admitter, 90, gate))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold(admitter, 10, asyncio.Event()))
    await asyncio.sleep(0)
    return blocker, waiter


async def test_deadline_gives_503_with_retry_after() -> None:
    admitter, clock = make(queue_max_wait_s=1.0)
    gate = asyncio.Event()
    blocker, waiter = await queued_behind_a_blocker(admitter, gate)
    clock.now = 1.5
    admitter._expire()
    with pytest.raises(GatewayError) as err:
        await waiter
    assert err.value.status == 503 and err.value.retry_after_s is not None
    gate.set()
    await blocker
    assert len(admitter.controller.ledger) == 0


async def test_every_wait_is_in_the_queue_wait_histogram_admitted_or_not() -> None:
    """The longest waits are those that end in a timeout or a client gone: an alert on the waits' 95th
    percentile must see them, not only the admitted ones'."""
    admitter, clock = make(queue_max_wait_s=30.0)
    gate = asyncio.Event()
    blocker, timed_out = await queued_behind_a_blocker(admitter, gate)  # the blocker: admitted at once
    abandoned = asyncio.create_task(hold(admitter, 10, asyncio.Event()))
    await asyncio.sleep(0)
    clock.now = 20.0
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    clock.now = 31.0
    admitter._expire()
    with pytest.raises(GatewayError):
        await timed_out
    gate.set()
    await blocker
    (family,) = [m for m in admitter.metrics.registry.collect() if m.name == "kvgate_queue_wait_seconds"]
    samples = {(x.name, x.labels.get("le")): x.value for x in family.samples}
    # the blocker (0 s), the abandoned one (20 s), the timed-out one (31 s)
    assert samples["kvgate_queue_wait_seconds_count", None] == 3
    assert samples["kvgate_queue_wait_seconds_sum", None] == pytest.approx(51.0)
    assert samples["kvgate_queue_wait_seconds_bucket", "10.0"] == 1
    assert samples["kvgate_queue_wait_seconds_bucket", "30.0"] == 2


async def test_a_deadline_timer_that_fires_early_is_armed_again() -> None:
    """uvloop rounds timer delays to whole milliseconds, so a queued request's timer can fire just before its
    deadline: the request must get a timer again, not wait past its budget with none left."""
    admitter, clock = make(queue_max_wait_s=1.0)
    gate = asyncio.Event()
    blocker, waiter = await queued_behind_a_blocker(admitter, gate)
    (ticket_id,) = admitter._waiters
    _, _, timer = admitter._waiters[ticket_id]
    timer.cancel()
    clock.now = 0.999  # the timer fires 1 ms early
    admitter._expire(ticket_id)
    assert not waiter.done()
    clock.now = 1.0  # the deadline passes: the timer armed again answers it
    for _ in range(1000):
        if waiter.done():
            break
        await asyncio.sleep(0.001)
    assert waiter.done()  # (before the fix it waited on, with no timer left)
    with pytest.raises(GatewayError) as err:
        await waiter
    assert err.value.status == 503
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
                admitter.scrape_started()
                admitter.sample(UsageSample(arg / 100, clock.now))
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
    async with exchange(admitter) as ex:
        await ex.charge_rate_limits(tenant(admitter), rc(blocks))
        await ex.admit()
        await release.wait()
        if fail[0]:
            raise RuntimeError("upstream broke")
    return "done"


async def test_the_exchange_releases_once_and_names_how_the_request_ended() -> None:
    admitter, _ = make()
    ledger = admitter.controller.ledger
    released = admitter.metrics.released
    ex = exchange(admitter)
    await ex.charge_rate_limits(tenant(admitter), rc(10))
    await ex.admit()
    assert len(ledger) == 1
    ex.sending()
    busy = GatewayError(503, "busy", code="engine_busy")
    ex.close(busy)
    ex.close(None)  # a second close changes nothing
    assert ex.outcome == "upstream_busy" and len(ledger) == 0
    assert ledger.reserved_count == ledger.released_count == 1
    assert released.labels("upstream_busy").value == 1 and released.labels("completed").value == 0
    for exc, outcome in [
        (None, "completed"),
        (asyncio.CancelledError(), "client_disconnect"),
        (GatewayError(502, "gone", code="upstream_disconnected"), "upstream_error"),
        (RuntimeError("bug"), "error"),
    ]:
        ex = exchange(admitter)
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        await ex.admit()
        ex.sending()
        ex.close(exc)
        assert ex.outcome == outcome and released.labels(outcome).value >= 1
    assert len(ledger) == 0 and ledger.reserved_count == ledger.released_count == 5


async def test_a_stream_that_broke_off_with_an_error_event_teaches_no_output_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM ends a generation that failed midway with an error event on a 200 stream: that answer is cut
    short, and learning its length would shrink the next requests' reservations right after an engine fault."""
    admitter, _ = make()
    learned: list[tuple[int, bool]] = []
    monkeypatch.setattr(admitter, "learn", lambda reservation, tokens, ended=True: learned.append((tokens, ended)))
    for broke_off, stream in ((True, True), (False, True), (False, False)):
        ex = exchange(admitter)
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        await ex.admit()
        ex.sending()
        ex.writer.status, ex.writer.event_stream, ex.generated, ex.broke_off = 200, stream, 3, broke_off
        ex.close(None)
        assert ex.outcome == ("upstream_error" if broke_off else "completed")
    # the finished stream teaches its 3 events; a whole answer without usage teaches nothing (its length is
    # unknown, not the 0 or 3 the counters say)
    assert learned == [(3, True)] and len(admitter.controller.ledger) == 0


async def test_a_stream_its_client_left_teaches_that_outputs_run_longer_than_what_it_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client's timeout cuts the longest answers: dropping them would teach lengths short of the truth. The
    stream counts as stopped after what it was sent; a whole answer the client left teaches nothing (nothing
    says how far the engine got)."""
    admitter, _ = make()
    learned: list[tuple[int, bool]] = []
    monkeypatch.setattr(admitter, "learn", lambda reservation, tokens, ended=True: learned.append((tokens, ended)))
    for stream in (True, False):
        ex = exchange(admitter)
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        await ex.admit()
        ex.sending()
        ex.writer.status, ex.writer.event_stream, ex.generated = 200, stream, 7
        ex.close(asyncio.CancelledError())
        assert ex.outcome == "client_disconnect"
    assert learned == [(7, False)] and len(admitter.controller.ledger) == 0


async def test_an_engine_that_refused_the_connection_in_a_pool_of_one_got_nothing_of_the_request() -> None:
    """Nowhere else to place it: the client hears 503, and the request counts as neither a finish (the queue's
    ETAs would read the refusals as a drain) nor a request the engine saw (its charge is given back)."""
    admitter, _ = make()
    drain = admitter.controller.drain
    for _ in range(drain.MATURE_EVENTS):
        ex = exchange(admitter)
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        await ex.admit()
        ex.sending()
        assert not await ex.place_again()
        ex.close(EngineUnreachable("The inference engine is unreachable."))
        assert ex.outcome == "engine_unreachable" and not ex.reached_engine
    assert admitter.metrics.released.labels("engine_unreachable").value == drain.MATURE_EVENTS
    assert not drain.mature(0.0) and len(admitter.controller.ledger) == 0


async def test_a_request_the_engine_turned_away_as_busy_waits_for_room_and_goes_again() -> None:
    """vLLM caps its unfinished requests (--max-num-queued-reqs): the request it turned away ran nothing, so it
    waits for room and goes again, ahead of first attempts; and the requests queued here wait too, let in as
    the engine's requests end (ours at once, others' at the next sample), instead of each being sent to be
    turned away in its turn (the queue emptied into 503s). Neither the refusal nor its charge counts: no finish
    for the ETAs, no request billed."""
    admitter, clock = make()
    controller = admitter.controller
    (book,) = controller.engines.values()
    running = [exchange(admitter) for _ in range(2)]
    for ex in running:
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        await ex.admit()
        ex.sending()
    admitter.scrape_started()
    admitter.sample(UsageSample(0.1, clock.now, running=2.0, waiting=1.0))  # ours, and one of another client's
    turned = exchange(admitter)
    await turned.charge_rate_limits(tenant(admitter), rc(5))
    await turned.admit()
    turned.sending()
    again = asyncio.create_task(turned.wait_again_after_busy())
    await asyncio.sleep(0)
    assert book.busy_cap == 3  # ours and the other client's: what it would not go past
    newcomers = [asyncio.create_task(hold(admitter, 5, asyncio.Event())) for _ in range(2)]
    await asyncio.sleep(0)
    assert not again.done() and len(controller.queue) == 3  # the pool has room: the engine has none
    assert not turned.reached_engine and admitter.metrics.released.labels("upstream_busy").value == 1
    assert controller.drain.per_second(clock.now) == 0  # a refusal is no finish
    running[0].close(None)  # one of ours ends: one place, for the one turned away (a retry: first in line)
    assert await again is True and turned.admission is not None
    await asyncio.sleep(0)
    assert len(controller.queue) == 2  # the newcomers still wait
    clock.now = 1.0
    admitter.scrape_started()
    admitter.sample(UsageSample(0.1, clock.now, running=2.0))  # the other client's ended: one more place
    await asyncio.sleep(0)
    assert len(controller.queue) == 1
    clock.now = 1.0 + BUSY_HOLD_S  # no refusal for a while: the hold lapses, and the last one goes
    admitter.scrape_started()
    admitter.sample(UsageSample(0.1, clock.now, running=3.0))
    await asyncio.sleep(0)
    assert len(controller.queue) == 0 and book.busy_cap is None
    for task in newcomers:
        task.cancel()
    await asyncio.gather(*newcomers, return_exceptions=True)
    running[1].close(None)
    turned.close(None)
    assert len(controller.ledger) == 0


async def test_an_engine_that_turns_everything_away_is_not_sent_a_request_each_scrape() -> None:
    """Its cap is 0: the request waits for its budget (a lapse of the hold at most sends it once more), then
    hears the engine was busy; never sent again at each sample."""
    admitter, clock = make(queue_max_wait_s=5.0)
    controller = admitter.controller
    turned = exchange(admitter)
    await turned.charge_rate_limits(tenant(admitter), rc(5))
    await turned.admit()
    turned.sending()
    again = asyncio.create_task(turned.wait_again_after_busy())
    await asyncio.sleep(0)  # queued again at 0: its budget ends at 5
    for t in range(1, 5):
        clock.now = float(t)
        admitter.scrape_started()
        admitter.sample(UsageSample(0.0, clock.now))
        await asyncio.sleep(0)
        assert not again.done() and len(controller.queue) == 1
    clock.now = 5.5
    admitter._expire()
    with pytest.raises(GatewayError) as err:
        await again
    assert err.value.code == "engine_busy" and err.value.retry_after_s is not None
    assert admitter.metrics.released.labels("upstream_busy").value == 1
    turned.close(err.value)
    assert len(controller.ledger) == 0


async def test_a_request_the_engine_turned_away_as_busy_is_not_billed_even_when_its_budget_runs_out() -> None:
    """vLLM ran nothing of it: a client that comes back after the Retry-After must not find its requests per
    minute spent on refusals."""
    admitter, clock = make()
    counters = TenantCounters(RedisConfig(), GatewayMetrics(), clock=clock)
    limited = TenantPolicy("t", "t", RateLimits(requests_per_minute=1), None, 0.0, QueueClass())
    (book,) = admitter.controller.engines.values()
    for _ in range(3):  # three in a row within the minute: each refused as busy, none billed
        book.busy_cap = None  # (the last one's hold lapsed: it is sent)
        ex = Exchange(
            "req", ResponseWriter(_unused_send), admitter=admitter, counters=counters, metrics=admitter.metrics
        )
        await ex.charge_rate_limits(limited, rc(5))
        await ex.admit()
        ex.sending()
        assert not await ex.wait_again_after_busy()  # no budget left to wait for room in
        ex.close(EngineBusy(1.0))
        assert ex.outcome == "upstream_busy"
    assert len(admitter.controller.ledger) == 0


async def test_a_stream_under_a_read_timeout_keeps_its_first_events_wait_out_of_its_queue_wait() -> None:
    """The SDK's read timeout runs until the response head, which waits for the stream's first event: a
    stream admitted at the end of its timeout would time out in the engine's prefill and be sent again."""
    admitter, _ = make()
    for _ in range(8):
        admitter.controller.first_event.observe(3.0)  # streams lately began 3 s after admission
    for whole, budget in ((False, 9.0 - 3.0), (True, 9.0)):  # (a whole answer's pace is not known here)
        ex = exchange(admitter)
        ex.client = client_hints([(b"x-stainless-read-timeout", b"10")])  # 9 s of it to wait, the SDK's rule
        ex.whole_answer = whole
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        assert ex.wait_budget_s == budget
        ex.close(None)


async def test_a_whole_answer_certain_to_outlast_the_clients_read_timeout_is_refused_before_anything_runs() -> None:
    """Run to its budget (ignore_eos) at the pace of recent answers about as long, it would take longer than the SDK's
    read timeout however soon it were admitted: the engine would generate it for nothing, once per retry. A
    400 (which no SDK retries) that says what to do; an answer of uncertain length, or one that fits, goes on."""
    admitter, _ = make()
    for _ in range(8):
        admitter.controller.pace.observe(100, 1.0)  # 10 ms a token, lately
    certain = RequestCost((16,), 1, 400, 30, min_output=400)  # 400 tokens: 4 s
    uncertain = RequestCost((16,), 1, 400, 30)
    for cost, timeout, refused in ((certain, b"3", True), (certain, b"10", False), (uncertain, b"3", False)):
        ex = exchange(admitter)
        ex.client = client_hints([(b"x-stainless-read-timeout", timeout)])
        ex.whole_answer = True
        if refused:
            with pytest.raises(GatewayError) as err:
                await ex.charge_rate_limits(tenant(admitter), cost)
            assert err.value.status == 400 and err.value.code == "answer_outlasts_timeout"
            assert err.value.extra["answer_eta_s"] == pytest.approx(4.0) and ex.charge is None
        else:
            await ex.charge_rate_limits(tenant(admitter), cost)
        ex.close(None)


async def test_a_request_placed_again_waits_within_what_is_left_since_it_began_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection attempt that failed (up to connect_timeout_s) spent the client's time too: the second
    placement's budget is what is left of the whole wait, not of its last pass through the queue."""
    admitter, _ = make()
    budgets: list[float] = []
    acquire = admitter.acquire

    async def recording(cost: RequestCost, tenant: str, max_wait_s: float, *args: Any) -> Any:
        budgets.append(max_wait_s)
        return await acquire(cost, tenant, max_wait_s, *args)

    monkeypatch.setattr(admitter, "acquire", recording)
    monkeypatch.setattr(admitter, "unreachable", lambda engine: True)  # a pool with somewhere else to go
    ex = exchange(admitter)
    await ex.charge_rate_limits(tenant(admitter), rc(5))
    await ex.admit()
    ex.sending()
    await asyncio.sleep(0.2)  # the connection attempt
    assert await ex.place_again()
    assert budgets[0] == ex.wait_budget_s and budgets[1] <= ex.wait_budget_s - 0.2
    ex.close(None)
    assert len(admitter.controller.ledger) == 0


async def test_a_speculative_or_batched_stream_without_usage_teaches_a_floor_not_a_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With speculative decoding (the engine's metrics show vllm:spec_decode_*) or a --stream-interval, a step's
    event carries several tokens: a stream's event count is a floor of its length, learned as "at least that"
    (a length would teach outputs short of the truth); each event is one token otherwise."""
    admitter, _ = make()
    learned: list[tuple[int, bool]] = []
    monkeypatch.setattr(admitter, "learn", lambda reservation, tokens, ended=True: learned.append((tokens, ended)))
    for speculative, interval in ((False, 1), (True, 1), (False, 4)):
        admitter.sample(UsageSample(0.0, 0.0, multi_token_steps=speculative))
        ex = exchange(admitter)
        await ex.charge_rate_limits(tenant(admitter), rc(5))
        await ex.admit()
        ex.sending()
        ex.stream_interval = interval
        ex.writer.status, ex.writer.event_stream, ex.generated = 200, True, 9
        ex.close(None)
    assert learned == [(9, True), (9, False), (9, False)] and len(admitter.controller.ledger) == 0


def _admitted_and_released(admitter: Admitter) -> tuple[float, float]:
    metrics = {m.name: m for m in admitter.metrics.registry.collect()}
    admitted = sum(s.value for s in metrics["kvgate_requests_admitted"].samples if s.name.endswith("_total"))
    released = sum(s.value for s in metrics["kvgate_reservations_released"].samples if s.name.endswith("_total"))
    return admitted, released


async def test_a_waiter_granted_then_cancelled_before_it_wakes_is_counted_once_each_way() -> None:
    """pump() hands a queued waiter its reservation; the client leaves before the waiter runs again. The
    reservation is released once, and it was counted as admitted once: admitted == released."""
    admitter, _ = make()
    holder = await admitter.acquire(rc(80), "t")
    waiter = asyncio.ensure_future(admitter.acquire(rc(20), "t", max_wait_s=60.0))
    await asyncio.sleep(0)  # queued
    admitter.release(holder.reservation, "completed")  # pump grants the waiter its reservation...
    waiter.cancel()  # ...and its client leaves before the waiter wakes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(admitter.controller.ledger) == 0
    assert _admitted_and_released(admitter) == (2.0, 2.0)


class RecordingBooks:
    """Shared engine books that grant every claim and record what the admitter told them."""

    def __init__(self) -> None:
        self.claims: list[tuple[str, int, SampleMark | None]] = []
        self.restates: list[tuple[dict[str, tuple[int, int]], SampleMark | None, bool]] = []
        self.waiting: list[tuple[tuple[float, int, int], ...]] = []  # what each restate said of the queue
        self.peaks: list[tuple[tuple[int, int] | None, int | None]] = []

    async def claim(
        self,
        engine: str,
        member: str,
        blocks: int,
        limit: int,
        mark: SampleMark | None,
        waited_s: float = 0.0,
        priority: int = 1,
    ) -> tuple[bool, int] | None:
        self.claims.append((member, blocks, mark))
        return True, 0

    async def restate(
        self,
        engine: str,
        held: dict[str, tuple[int, int]],
        mark: SampleMark | None,
        everything: bool = False,
        waiting: tuple[tuple[float, int], ...] = (),
        peak: tuple[int, int] | None = None,
        upto: int | None = None,
    ) -> int | None:
        self.restates.append((held, mark, everything))
        self.waiting.append(waiting)
        self.peaks.append((peak, upto))
        return 0


async def test_claims_carry_the_sample_they_were_weighed_against() -> None:
    """What the other replicas need to weigh this one's claims: each claim and restate names the sample this
    replica's view rests on, and a restate after a sample says how much of each reservation that sample shows."""
    books = RecordingBooks()
    clock = Clock()
    controller = AdmissionController(AdmissionConfig(exclusive_upstream=False), KvGeometry(16, 100))
    admitter = Admitter(controller, GatewayMetrics(), clock, shared=books)
    admitter.scrape_started()
    admitter.sample(UsageSample(0.0, 0.0, started_at=7.0, tokens=500.0))
    admission = await admitter.acquire(RequestCost((160,), 1, 160, 20), "t")
    res = admission.reservation
    assert books.claims == [(str(res.id), 20, SampleMark(7.0, 500.0))]
    admitter.progress(res, 1)  # its first token: prompt (10 blocks) and one token are in the engine from now on
    clock.now = 0.5
    admitter.scrape_started()
    admitter.sample(UsageSample(0.11, 0.5, started_at=7.0, tokens=661.0))
    await asyncio.sleep(0)  # the restate runs in the background
    assert books.restates[-1] == ({str(res.id): (20, 11)}, SampleMark(7.0, 661.0), True)
    admitter.release(res, "ok")
    await asyncio.sleep(0)
    assert books.restates[-1] == ({str(res.id): (0, 0)}, SampleMark(7.0, 661.0), False)


class AnsweringBooks(RecordingBooks):
    """Shared engine books whose other replicas hold ``others`` blocks, or that cannot say (None: Redis down)."""

    def __init__(self, others: int | None) -> None:
        super().__init__()
        self.others = others

    async def claim(self, engine: str, member: str, blocks: int, limit: int, *rest: Any) -> tuple[bool, int] | None:
        await super().claim(engine, member, blocks, limit, *rest)
        return None if self.others is None else (self.others <= limit, self.others)

    async def restate(self, *args: Any, **kwargs: Any) -> int | None:
        await super().restate(*args, **kwargs)
        return self.others


async def test_replicas_sharing_books_bound_the_engine_together_and_the_sample_decides_when_they_cannot() -> None:
    """exclusive_upstream with shared books: the replicas are the engine's one client, so the other replicas'
    claims plus this one's ledger bound the engine, and room the sample still shows taken (a request of another
    replica that has ended since) is used at once. While the shared books cannot say, the sample decides, as
    for a gateway that is not the only client: nothing this replica cannot see is assumed gone."""
    books = AnsweringBooks(None)
    clock = Clock()
    controller = AdmissionController(AdmissionConfig(), KvGeometry(16, 100), shared_books=True)
    admitter = Admitter(controller, GatewayMetrics(), clock, shared=books)
    book = next(iter(controller.engines.values()))
    assert book.others_blocks is None  # nothing said yet: not even "nobody else"
    admitter.scrape_started()
    admitter.sample(UsageSample(0.5, 0.0))  # another replica's 50 blocks, as of this sample
    await asyncio.sleep(0)  # the restate after the sample runs in the background, and cannot say
    assert book.others_blocks is None
    assert book.projected_blocks(45, clock()) == 95  # the sample's 50, plus this request: over 90
    with pytest.raises(GatewayError):
        await admitter.acquire(rc(45), "t", max_wait_s=0)
    books.others = 10  # the books answer: the other replica holds 10 blocks, all the sample shows
    admitter.scrape_started()
    admitter.sample(UsageSample(0.1, 0.1))
    await asyncio.sleep(0)
    assert book.others_blocks == 10
    admission = await admitter.acquire(rc(45), "t", max_wait_s=0)
    assert books.claims[-1][2] is None  # claimed whole: the replicas' ledgers together are the bound
    admitter.scrape_started()
    admitter.sample(UsageSample(0.5, 0.2))  # the other replica's request ended; this one's 45 show, or part
    await asyncio.sleep(0)
    assert book.projected_blocks(30, clock()) == 45 + 30 + 10  # not 50 more: this replica's own may be all of it
    books.others = None  # Redis goes away: the claim cannot be checked, so the sample decides it again
    with pytest.raises(GatewayError):  # by the sample (50 + 45 + 30) it does not fit, and it may not wait
        await admitter.acquire(rc(30), "t", max_wait_s=0)
    assert admitter.metrics.released.labels("claim_unanswered").value == 1
    assert book.others_blocks is None
    assert book.projected_blocks(30, clock()) == 50 + 45 + 30
    books.others = 10  # back; but a replica that lost Redis shows in the sample: 50 beyond this one's 45
    admitter.scrape_started()
    admitter.sample(UsageSample(0.95, 0.3))
    await asyncio.sleep(0)
    assert book.others_blocks == 10
    assert book.projected_blocks(10, clock()) == 45 + 10 + 50
    admitter.release(admission.reservation, "ok")
    assert len(book.ledger) == 0


async def test_a_request_queued_again_after_a_refused_claim_keeps_its_age_for_the_other_replicas() -> None:
    """The other replicas let this replica's queue head go before their younger requests; one whose claim was
    refused, and that queued again, is as old as its first arrival, not its second queueing."""
    clock = Clock()

    class SlowRefusingBooks(AnsweringBooks):
        async def claim(self, *args: Any) -> tuple[bool, int] | None:
            clock.now += 3.0  # the other replica took the room meanwhile
            await super().claim(*args)
            return False, 80

    books = SlowRefusingBooks(0)
    controller = AdmissionController(AdmissionConfig(), KvGeometry(16, 100), shared_books=True)
    admitter = Admitter(controller, GatewayMetrics(), clock, shared=books)
    admitter.scrape_started()
    admitter.sample(UsageSample(0.0, 0.0))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(admitter.acquire(rc(20), "t", max_wait_s=60))
    await asyncio.sleep(0)
    assert len(controller.queue) == 1 and clock.now == 3.0  # refused once, queued again at 3 s
    clock.now = 4.0
    admitter.scrape_started()
    admitter.sample(UsageSample(0.8, 4.0))
    await asyncio.sleep(0)
    assert books.waiting[-1] == ((4.0, 20, 1),)  # waited since 0 s, not since 3 s (class 1: standard)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(next(iter(controller.engines.values())).ledger) == 0


async def test_a_replica_tells_the_others_the_peak_of_its_reservations_and_which_ones_it_covers() -> None:
    """Each restate carries this replica's lockstep peak (what it counts its own reservations at), numbered so
    that a late restate never undoes a newer one, and the newest reservation it covers: one still on its way to
    the shared books included (it is in the ledger), any admitted later not."""
    gate = asyncio.Event()

    class SlowBooks(RecordingBooks):
        async def claim(self, *args: Any) -> tuple[bool, int] | None:
            await gate.wait()
            return await super().claim(*args)

    books = SlowBooks()
    clock = Clock()
    controller = AdmissionController(AdmissionConfig(), KvGeometry(16, 1000), shared_books=True)
    admitter = Admitter(controller, GatewayMetrics(), clock, shared=books)
    book = next(iter(controller.engines.values()))
    admitter.scrape_started()
    admitter.sample(UsageSample(0.0, 0.0))
    await asyncio.sleep(0)
    gate.set()
    first = (await admitter.acquire(RequestCost((16,), 1, 320, 21), "t")).reservation  # 16 + 320 tokens
    second = (await admitter.acquire(RequestCost((16,), 1, 320, 21), "t")).reservation
    admitter.progress(first, 300)  # both decoding: one nearly done, the other just started
    admitter.progress(second, 1)
    assert book.shared_peak() < book.ledger.reserved_blocks
    gate.clear()
    third = asyncio.create_task(admitter.acquire(RequestCost((16,), 1, 320, 21), "t"))
    await asyncio.sleep(0)  # admitted here, its claim on its way
    admitter.scrape_started()
    admitter.sample(UsageSample(0.05, 0.25))
    await asyncio.sleep(0)
    (number, peak), upto = books.peaks[-1]  # type: ignore[misc]
    in_flight = next(res for res in book.ledger.live() if res not in (first, second))
    assert peak == book.shared_peak() and upto == in_flight.id
    gate.set()
    admission = await third
    admitter.release(first, "ok")
    await asyncio.sleep(0)
    (later, _), _ = books.peaks[-1]  # type: ignore[misc]
    assert later > number  # the release's restate, taken later
    for res in (second, admission.reservation):
        admitter.release(res, "ok")
    assert len(book.ledger) == 0


async def test_a_stream_that_outgrows_its_estimate_is_restated_even_while_a_restate_is_on_its_way() -> None:
    """The restate on its way was taken before the growth; another follows it, with the grown peak."""
    landed = asyncio.Event()

    class SlowRestates(RecordingBooks):
        async def restate(self, *args: Any, **kwargs: Any) -> int | None:
            await landed.wait()
            return await super().restate(*args, **kwargs)

    books = SlowRestates()
    clock = Clock()
    config = AdmissionConfig(output_estimate={"prior_tokens": 32})  # type: ignore[arg-type]
    controller = AdmissionController(config, KvGeometry(16, 1000), shared_books=True)
    admitter = Admitter(controller, GatewayMetrics(), clock, shared=books)
    admitter.scrape_started()
    admitter.sample(UsageSample(0.0, 0.0))
    landed.set()
    await asyncio.sleep(0)
    res = (await admitter.acquire(RequestCost((16,), 1, 1000, 64), "t")).reservation
    assert res.cost.max_output == 32  # reserved for its expected output, not its budget
    landed.clear()
    admitter.scrape_started()
    admitter.sample(UsageSample(0.01, 0.25))  # a restate on its way, taken now
    await asyncio.sleep(0)
    admitter.progress(res, 30)  # it outruns its estimate: the reservation grows
    assert res.cost.max_output > 32
    grown = controller.engines[res.engine].shared_peak()
    landed.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert books.peaks[-1][0] is not None and books.peaks[-1][0][1] == grown
    admitter.release(res, "ok")


class RecordingCounters(TenantCounters):
    def __init__(self) -> None:
        super().__init__(RedisConfig(), GatewayMetrics())
        self.settled: list[int] = []

    def settle(self, charge: Any, actual: int, reached_engine: bool = True) -> None:
        self.settled.append(actual)
        super().settle(charge, actual, reached_engine)


async def test_a_batched_stream_shows_its_tokens_to_the_ledger_and_is_billed_for_them() -> None:
    """50 tokens batched by 8 (vLLM's stream_interval) are 8 events and ``[DONE]``: the ledger sees at least
    34 of them held (a floor: any event may be one without tokens, or a sequence's short first or last), and
    the engine possibly 38 further (the first event one token, every other full, 7 not yet sent), so whether
    the request outran its estimate is judged at the far end; the tenant is billed the floor, not 9."""
    admitter, _ = make()
    counters = RecordingCounters()
    policy = TenantPolicy("t", "t", RateLimits(tokens_per_minute=100_000), None, 60.0, QueueClass())
    async with Exchange(
        "req", ResponseWriter(_unused_send), admitter=admitter, counters=counters, metrics=admitter.metrics
    ) as ex:
        ex.stream_interval = 8
        await ex.charge_rate_limits(policy, RequestCost((16,), 1, 200, 14))
        await ex.admit()
        ex.sending()
        ex.progress(9)
        assert ex.admission is not None
        reservation = ex.admission.reservation
        assert (reservation.generated, reservation.lead_tokens) == (34, 38)
        assert reservation.generated <= 50 <= reservation.generated + reservation.lead_tokens
    assert counters.settled == [16 + 34]


async def test_a_whole_answer_its_client_left_is_billed_what_the_engine_had_time_to_generate() -> None:
    """A non-stream request shows no progress until its answer comes: its client gone first (an SDK timeout),
    it is billed its prompt and the tokens the engine had time to generate at the latest answers' pace, not
    nothing (short client timeouts would get around the token limit); with no pace known yet, its charge.
    Every sequence of an n > 1 request had that time."""
    for paced, billed, tpm in ((True, 16 + 100, 100_000), (False, 16 + 1000, 100_000), (False, 500, 500)):
        # the last: its charge cut to a minute's allowance, and billed that much, not its whole budget as a debt
        policy = TenantPolicy("t", "t", RateLimits(tokens_per_minute=tpm), None, 60.0, QueueClass())
        admitter, clock = make()
        if paced:
            for _ in range(40):  # 200 tokens in 10 s, answered whole: 0.05 s per token
                placed = admitter.controller.submit(RequestCost((16,), 1, 1000, 70), "x", 0.0)
                assert not isinstance(placed, Queued | Rejected)
                admitter.controller.learn(placed.reservation, 200, now=10.0)
                admitter.controller.release(placed.reservation, 10.0)
        counters = RecordingCounters()
        clock.now = 100.0
        ex = Exchange(
            "req", ResponseWriter(_unused_send), admitter=admitter, counters=counters, metrics=admitter.metrics
        )
        await ex.charge_rate_limits(policy, RequestCost((16,), 1, 1000, 70))
        await ex.admit()
        ex.sending()
        clock.now = 105.0  # 5 s later its client gives up: 100 tokens at that pace
        ex.close(asyncio.CancelledError())
        assert ex.outcome == "client_disconnect" and counters.settled == [billed]


async def test_a_drain_tells_queued_requests_to_come_back_in_a_second_as_everyone_else() -> None:
    """SIGTERM: a queued request hears 503 shutting_down with the Retry-After new requests and those waiting
    for a tenant slot hear (another replica takes it), not the queue's own estimate of its wait."""
    admitter, _ = make()
    release = asyncio.Event()
    holder = asyncio.create_task(hold(admitter, 85, release))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(hold(admitter, 20, release))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(admitter.controller.queue) == 1
    admitter.fail_all_queued(shutting_down)
    with pytest.raises(GatewayError) as err:
        await waiting
    assert (err.value.code, err.value.retry_after_s) == ("shutting_down", 1.0)
    release.set()
    assert await holder == "done"


async def test_a_whole_answer_of_several_sequences_its_client_left_is_billed_for_each() -> None:
    admitter, clock = make()
    for _ in range(40):  # 0.05 s per token
        placed = admitter.controller.submit(RequestCost((16,), 1, 1000, 70), "x", 0.0)
        assert not isinstance(placed, Queued | Rejected)
        admitter.controller.learn(placed.reservation, 200, now=10.0)
        admitter.controller.release(placed.reservation, 10.0)
    counters = RecordingCounters()
    policy = TenantPolicy("t", "t", RateLimits(tokens_per_minute=100_000), None, 60.0, QueueClass())
    clock.now = 100.0
    ex = Exchange("req", ResponseWriter(_unused_send), admitter=admitter, counters=counters, metrics=admitter.metrics)
    await ex.charge_rate_limits(policy, RequestCost((16,), 3, 1000, 70))  # n=3
    await ex.admit()
    ex.sending()
    clock.now = 105.0
    ex.close(asyncio.CancelledError())
    capped = Exchange(
        "r2", ResponseWriter(_unused_send), admitter=admitter, counters=counters, metrics=admitter.metrics
    )
    await capped.charge_rate_limits(policy, RequestCost((16,), 3, 40, 10))  # max_tokens 40: no sequence runs past
    await capped.admit()
    capped.sending()
    clock.now = 110.0
    capped.close(asyncio.CancelledError())
    assert counters.settled == [16 + 3 * 100, 16 + 3 * 40]


async def test_a_head_that_expires_lets_the_one_behind_it_in_at_once() -> None:
    """The head waited for room it never got; the request behind it fits: it goes in when the head's deadline
    passes, not at the next sample or release."""
    admitter, clock = make(output_estimate={"enabled": False})
    held = (await admitter.acquire(rc(60), "a")).reservation  # 60 of the 90 the watermark allows
    head = asyncio.ensure_future(admitter.acquire(rc(40), "a", max_wait_s=1.0))
    await asyncio.sleep(0)
    behind = asyncio.ensure_future(admitter.acquire(rc(20), "a", max_wait_s=10.0))
    await asyncio.sleep(0)
    assert len(admitter.controller.queue) == 2
    clock.now = 1.0
    admitter._expire()  # the head's timer
    await asyncio.sleep(0)
    assert isinstance(head.exception(), GatewayError)
    assert behind.done() and len(admitter.controller.queue) == 0
    admitter.release(behind.result().reservation, "completed")
    admitter.release(held, "completed")
    assert admitter.controller.ledger.reserved_blocks == 0


async def test_a_first_token_that_lowers_the_peak_lets_the_head_in() -> None:
    """Under lockstep a request counts whole until its first token; then it counts as it will grow, which may
    leave the head of the queue room at once."""
    admitter, _ = make(output_estimate={"enabled": False}, growth_model="lockstep")
    ending = (await admitter.acquire(rc(40), "a")).reservation
    admitter.progress(ending, 600)  # 24 tokens from its end
    starting = (await admitter.acquire(rc(40), "a")).reservation  # counted whole: 80 of 90
    head = asyncio.ensure_future(admitter.acquire(rc(16), "a", max_wait_s=10.0))
    await asyncio.sleep(0)
    assert not head.done()
    admitter.progress(starting, 1)  # decoding: a few blocks when the other ends, all 40 only after it
    await asyncio.sleep(0)
    assert head.done() and not head.cancelled() and head.exception() is None
    for res in (ending, starting, head.result().reservation):
        admitter.release(res, "completed")


def test_a_busy_cap_set_from_a_sample_that_missed_a_burst_rises_with_what_the_engine_is_seen_to_hold() -> None:
    """The sample before the refusal missed another client's burst: the cap read 0, and a later sample of the
    engine emptied could not lift it for the whole hold. The engine held what a sample shows at once: its cap is
    no lower."""
    admitter, clock = make()
    controller = admitter.controller
    (book,) = controller.engines.values()
    placed = controller.submit(rc(5), "t", clock.now)
    assert isinstance(placed, Admitted)
    book.hold_busy(clock.now)  # the request was turned away: what the engine held, as far as we know, is 0
    controller.release(placed.reservation, clock.now, finished=False)
    assert book.busy_cap == 0 and book.busy_full(clock.now)
    for t, unfinished, full in ((0.25, 6.0, True), (0.5, 6.0, True), (2.0, 0.0, False)):
        clock.now = t
        admitter.scrape_started()
        admitter.sample(UsageSample(0.1, t, running=unfinished))
        assert book.busy_cap == 6 and book.busy_full(t) is full
