"""A pool of engines in the admission core: placement by headroom, one queue served by whichever engine has
room, ejection and rejoining, restarts, engines leaving, and ledgers that stay exact across all of it."""

from __future__ import annotations

import random
import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.controller import AdmissionController, Admitted, Queued, Rejected, UsageSample
from gateway.admission.engine import EJECT_BASE_S, EJECT_MAX_S, SCRAPE_FAILURES_TO_EJECT
from gateway.admission.ledger import Reservation
from gateway.config import AdmissionConfig, OutputEstimateConfig
from gateway.tokens.cost import KvGeometry, RequestCost, estimate_cost
from gateway.upstream.pool import one_family

CONFIG = AdmissionConfig(output_estimate=OutputEstimateConfig(enabled=False), exclusive_upstream=False)


def pool(*sizes: int) -> AdmissionController:
    """Engines e0, e1, ... with ``sizes`` blocks of 16 tokens, each sampled empty at t=0."""
    c = AdmissionController(CONFIG, engines=())
    for i, size in enumerate(sizes):
        c.add_engine(f"e{i}")
        sample(c, f"e{i}", 0.0, 0.0, size)
    return c


def sample(c: AdmissionController, engine: str, usage: float, now: float, size: int = 100, served: float = 0.0) -> None:
    c.begin_sample(engine)
    c.apply_sample(UsageSample(usage, now, KvGeometry(16, size), served=served), engine)


def req(blocks: int) -> RequestCost:
    return RequestCost((blocks * 16 - 16,), 1, 16, blocks)  # prompt + 16 output tokens = ``blocks`` blocks


def test_a_request_goes_where_the_most_headroom_is_left_after_it() -> None:
    c = pool(100, 100)
    sample(c, "e0", 0.5, 0.1)
    sample(c, "e1", 0.2, 0.1)
    first = c.submit(req(10), "t", 0.2)
    assert isinstance(first, Admitted) and first.reservation.engine == "e1"
    # the projection, not the last sample: e1 holds 0.2 + 0.1 now, e0 0.5; e1 keeps taking until they meet
    placed = [c.submit(req(10), "t", 0.2) for _ in range(3)]
    assert [d.reservation.engine for d in placed if isinstance(d, Admitted)] == ["e1", "e1", "e0"]


def test_a_heterogeneous_pool_fills_by_fraction_not_by_blocks() -> None:
    c = pool(200, 100)  # e1 has half the pool of e0
    engines = []
    for _ in range(9):
        d = c.submit(req(10), "t", 0.1)
        assert isinstance(d, Admitted)
        engines.append(d.reservation.engine)
    assert engines.count("e0") == 6 and engines.count("e1") == 3  # 60/200 and 30/100: the same fraction


def test_one_queue_for_the_pool_served_by_whichever_engine_frees_room() -> None:
    c = pool(100, 100)
    held = [c.submit(req(45), "t", 0.1) for _ in range(4)]  # 2 per engine: 0.90 each, at the watermark
    assert all(isinstance(d, Admitted) for d in held)
    waiting = c.submit(req(30), "t", 0.1, max_wait_s=60.0)
    assert isinstance(waiting, Queued)
    freed = next(d.reservation for d in held if isinstance(d, Admitted) and d.reservation.engine == "e1")
    c.release(freed, 0.2)
    [(ticket, res)] = c.pump(0.2)
    assert ticket is waiting.ticket and res.engine == "e1"


def test_an_ejected_engine_takes_nothing_until_its_backoff_is_over_and_it_is_sampled_again() -> None:
    c = pool(100, 100)
    sample(c, "e1", 0.5, 0.1)  # e0 has more room, but it refused a connection
    assert c.eject("e0", 1.0) == EJECT_BASE_S
    assert all(d.reservation.engine == "e1" for d in [c.submit(req(5), "t", 1.1)] if isinstance(d, Admitted))
    assert c.eject("e0", 1.2) == EJECT_BASE_S - 0.2  # another request that was on its way: the same ejection
    sample(c, "e0", 0.0, 1.5)  # healthy, but still inside its backoff
    assert c.engines["e0"].ejected
    sample(c, "e0", 0.0, 2.1)  # past it: rejoins
    assert not c.engines["e0"].ejected
    d = c.submit(req(5), "t", 2.2)
    assert isinstance(d, Admitted) and d.reservation.engine == "e0"
    assert c.eject("e0", 2.3) == 2 * EJECT_BASE_S  # ejected again soon after: it waits twice as long
    assert c.engines["e0"].ejections == {"scrape": 0, "connect": 2}
    sample(c, "e0", 0.0, 4.4)  # rejoins; healthy for as long as the longest backoff, the run is forgotten
    sample(c, "e0", 0.0, 4.4 + EJECT_MAX_S)
    assert c.eject("e0", 5.0 + EJECT_MAX_S) == EJECT_BASE_S


def test_failing_scrapes_eject_an_engine_of_a_pool_but_a_lone_engine_keeps_the_stale_policy() -> None:
    c = pool(100, 100)
    for i in range(SCRAPE_FAILURES_TO_EJECT - 1):
        assert not c.scrape_failed(1.0 + i, "e0")
    assert c.scrape_failed(5.0, "e0") and c.engines["e0"].ejected
    lone = pool(100)
    for i in range(10):
        assert not lone.scrape_failed(1.0 + i, "e0")
    assert lone.eject("e0", 1.0) is None  # nowhere else to go: a refused connection is the client's 503


def test_an_engine_that_restarted_drops_what_died_with_it_and_each_reservation_is_released_once() -> None:
    """What was admitted before the old process's last sample died with it and is released; what was
    admitted after that may be running on the new process, and is kept (its own request releases it)."""
    c = pool(100, 100)
    sample(c, "e1", 0.5, 0.1, served=10)
    held = [c.submit(req(10), "t", 0.2) for _ in range(3)]
    on_e0 = [d.reservation for d in held if isinstance(d, Admitted) and d.reservation.engine == "e0"]
    assert on_e0
    sample(c, "e0", 0.1, 0.25, served=50)  # the old process's last sample
    late = c.submit(req(10), "t", 0.27)
    assert isinstance(late, Admitted) and late.reservation.engine == "e0"
    c.begin_sample("e0")
    verdict = c.apply_sample(UsageSample(0.0, 0.3, KvGeometry(16, 100), served=0), "e0")  # counters went back
    assert list(verdict.lost) == on_e0 and c.engines["e0"].restarts == 1
    assert c.engines["e0"].ledger.reserved_blocks == late.reservation.blocks  # the late one is still held
    assert not any(c.release(res, 0.4) for res in on_e0)  # already released when the engine went
    assert c.release(late.reservation, 0.4) and len(c.engines["e0"].ledger) == 0


def test_an_engine_that_leaves_takes_nothing_new_and_its_books_go_when_its_requests_end() -> None:
    c = pool(100, 100)
    sample(c, "e1", 0.5, 0.1)
    d = c.submit(req(10), "t", 0.2)
    assert isinstance(d, Admitted) and d.reservation.engine == "e0"
    c.remove_engine("e0")
    later = c.submit(req(10), "t", 0.3)
    assert isinstance(later, Admitted) and later.reservation.engine == "e1"
    assert "e0" in c.engines  # its request is still running there
    assert c.release(d.reservation, 0.4) and "e0" not in c.engines
    c.add_engine("e0")  # it comes back (the DNS answer changed again)
    assert "e0" in c.engines and not c.engines["e0"].leaving


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.integers(1, 60)),
            st.tuples(st.just("release"), st.integers(0, 1000)),
            st.tuples(st.just("sample"), st.integers(0, 2), st.floats(0, 1), st.booleans()),
            st.tuples(st.just("eject"), st.integers(0, 2)),
            st.tuples(st.just("fail"), st.integers(0, 2)),
            st.tuples(st.just("leave"), st.integers(0, 2)),
            st.tuples(st.just("join"), st.integers(0, 2)),
        ),
        max_size=80,
    ),
    st.integers(0, 2**32 - 1),
)
def test_every_reservation_is_released_exactly_once_and_the_books_stay_exact(
    steps: list[tuple[object, ...]], seed: int
) -> None:
    """Whatever happens to the engines (samples, restarts, ejections, leaving, rejoining), each engine's
    reserved blocks are the sum of its live reservations, a reservation is released at most once, and at the
    end, with everything released, no engine holds anything."""
    rng = random.Random(seed)
    c = pool(100, 60, 140)
    live: list[Reservation] = []
    released = 0
    now = 1.0
    served = {f"e{i}": 100.0 for i in range(3)}
    for step in steps:
        now += 0.1
        kind = step[0]
        if kind == "submit":
            d = c.submit(req(int(step[1])), "t", now, max_wait_s=1.0)  # type: ignore[call-overload]
            if isinstance(d, Admitted):
                live.append(d.reservation)
            for _, res in c.pump(now):
                live.append(res)
            c.expire(now)
        elif kind == "release" and live:
            res = live.pop(int(step[1]) % len(live))  # type: ignore[call-overload]
            if c.release(res, now):
                released += 1
            assert not c.release(res, now)
        elif kind == "sample":
            name = f"e{step[1]}"
            served[name] = 0.0 if step[3] else served[name] + 1  # restarted, or served one more
            sample(c, name, float(step[2]), now, 100, served[name])  # type: ignore[arg-type]
        elif kind == "eject":
            c.eject(f"e{step[1]}", now)
        elif kind == "fail":
            c.scrape_failed(now, f"e{step[1]}")
        elif kind == "leave":
            c.remove_engine(f"e{step[1]}")
        elif kind == "join":
            c.add_engine(f"e{step[1]}")
        for name, book in c.engines.items():
            mine = [r for r in live if r.engine == name and not r.released]
            assert book.ledger.reserved_blocks == sum(r.blocks for r in mine)
            assert len(book.ledger) == len(mine)
    rng.shuffle(live)
    for res in live:
        c.release(res, now)
    assert all(len(b.ledger) == 0 and b.ledger.reserved_blocks == 0 for b in c.engines.values())
    assert sum(b.ledger.released_count for b in c.engines.values()) <= sum(
        b.ledger.reserved_count for b in c.engines.values()
    )


def test_a_dual_stack_name_gives_each_engine_once() -> None:
    """A dual-stack headless Service answers A and AAAA records for every pod: both would make each engine two
    engines with two books. IPv4 when there is any; IPv6 alone when that is all there is."""
    dual = [(socket.AF_INET6, "fd00::2"), (socket.AF_INET, "10.0.0.2"), (socket.AF_INET6, "fd00::1")]
    dual += [(socket.AF_INET, "10.0.0.1"), (socket.AF_INET, "10.0.0.1")]  # one per socket type, say
    assert one_family(dual) == ["10.0.0.1", "10.0.0.2"]
    assert one_family([(socket.AF_INET6, "fd00::1")]) == ["fd00::1"]
    assert one_family([]) == []


def test_an_engine_with_blocks_of_another_size_takes_nothing_until_its_size_is_the_pools() -> None:
    """A rolling update from --block-size 16 to 32: requests are priced in the pool's 16-token blocks, half
    what they hold on the new engine, which would fill past its watermark. It takes nothing (and its blocks do
    not count toward what fits) while the 16-token engines hold most of the pool's KV capacity; once they
    are leaving, the pool is priced in its size, even while one of them still drains its streams."""
    c = pool(100, 100)
    c.add_engine("new")
    c.begin_sample("new")
    c.apply_sample(UsageSample(0.0, 0.0, KvGeometry(32, 50)), "new")  # the same tokens in half the blocks
    assert c.engines["new"].other_block_size and not c.engines["new"].placeable
    assert c.geometry == KvGeometry(16, 100)
    placed = [c.submit(req(5), "t", 0.1) for _ in range(10)]
    assert all(isinstance(d, Admitted) and d.reservation.engine != "new" for d in placed)
    c.remove_engine("e0")
    c.remove_engine("e1")  # both still drain their requests
    c.begin_sample("new")
    c.apply_sample(UsageSample(0.0, 0.2, KvGeometry(32, 50)), "new")
    assert c.geometry == KvGeometry(32, 50) and c.engines["new"].placeable
    assert c.engines["e0"].leaving and c.engines["e0"].other_block_size
    for d in placed:
        assert isinstance(d, Admitted)
        c.release(d.reservation, 0.3)
    assert set(c.engines) == {"new"}


def test_when_the_engines_of_the_pools_block_size_are_ejected_the_others_take_over() -> None:
    """The larger engine, whose 32-token blocks the pool was priced in, died (or restarts with another
    --block-size): the 16-token engine was "of another size" and took nothing, so nothing was placeable and
    every request waited out its budget. The pool's size comes from the engines that take requests."""
    c = pool(100)
    c.add_engine("big")
    c.begin_sample("big")
    c.apply_sample(UsageSample(0.0, 0.0, KvGeometry(32, 200)), "big")
    assert c.engines["e0"].other_block_size and c.geometry == KvGeometry(32, 200)
    for _ in range(3):
        c.scrape_failed(1.0, "big")  # the third failure in a row ejects it
    assert c.engines["big"].ejected
    assert c.geometry == KvGeometry(16, 100) and c.engines["e0"].placeable
    placed = c.submit(req(5), "t", 1.1)
    assert isinstance(placed, Admitted) and placed.reservation.engine == "e0"


def test_a_request_only_an_ejected_engine_can_hold_is_still_priced_against_it() -> None:
    """The large engine is ejected for a backoff (one refused connection): the pool's blocks stay its blocks,
    so a request only it can hold is priced and waits for it, rather than being refused as larger than every
    engine (a 400 the SDKs do not retry)."""
    c = pool(100, 1000)
    c.eject("e1", 1.0)
    assert c.engines["e1"].ejected and c.geometry == KvGeometry(16, 1000)
    big = estimate_cost((4000,), max_tokens=1000, sequences_per_prompt=1, max_model_len=None, geometry=c.geometry)
    assert big.blocks > 100
    assert isinstance(c.submit(big, "t", 1.1), Queued)


def test_with_every_engine_down_a_request_is_told_to_come_back_not_held_for_its_budget() -> None:
    """All the pool's engines ejected: nothing can take the request until one is back, so it is refused at
    once with when that may be (the first backoff's end), as a lone engine's refused connection is; with one
    engine back, requests are placed again."""
    c = pool(100, 100)
    for engine in ("e0", "e1"):
        c.eject(engine, 1.0)
    refused = c.submit(req(5), "t", 1.2)
    assert isinstance(refused, Rejected) and refused.reason == "no_engine" and refused.retry_after_s >= 1.0
    assert len(c.queue) == 0
    sample(c, "e0", 0.0, 10.0)  # back, after its backoff
    assert not c.engines["e0"].ejected
    assert isinstance(c.submit(req(5), "t", 10.1), Admitted)


def test_engines_ejected_for_metrics_that_time_out_are_waited_for_and_those_refusing_connections_are_not() -> None:
    """Ejected for three scrapes that timed out (an API server slow under load, perhaps still generating):
    requests wait in the queue for them, as for room. Ejected for scrapes whose connections were refused
    (nothing listening): the request is refused at once, to come back."""
    slow = pool(100, 100)
    for engine in ("e0", "e1"):
        for _ in range(3):
            slow.scrape_failed(1.0, engine)
    assert all(b.ejected and not b.down for b in slow.engines.values())
    assert isinstance(slow.submit(req(5), "t", 1.2), Queued)
    dead = pool(100, 100)
    for engine in ("e0", "e1"):
        for _ in range(3):
            dead.scrape_failed(1.0, engine, refused=True)
    refused = dead.submit(req(5), "t", 1.2)
    assert isinstance(refused, Rejected) and refused.reason == "no_engine"


def test_a_request_only_an_ejected_engine_could_hold_does_not_hold_up_the_rest_of_the_pool() -> None:
    """The large engine refused a connection: a request larger than the small engine's whole pool waits for
    it to come back (not refused: it will fit then), while those behind it are served by the small engine. A
    head that waits for room, not for an engine, still goes first."""
    c = pool(200, 100)
    c.eject("e0", 1.0)
    big = c.submit(req(150), "t", 1.1, max_wait_s=60.0)
    assert isinstance(big, Queued)
    small = c.submit(req(10), "t", 1.1, max_wait_s=60.0)
    assert isinstance(small, Queued)  # the line was not empty: it queued, and the pump lets it by
    [(ticket, res)] = c.pump(1.1)
    assert ticket is small.ticket and res.engine == "e1"
    assert c.queue.peek() is big.ticket
    sample(c, "e0", 0.0, 1.0 + EJECT_BASE_S + 0.1, size=200)  # back: the big one goes there
    [(ticket, res)] = c.pump(1.0 + EJECT_BASE_S + 0.2)
    assert ticket is big.ticket and res.engine == "e0"
    # waiting for room is another thing: the head keeps its turn
    c.eject("e0", 3.0)
    sample(c, "e1", 0.0, 3.0)
    held = c.submit(req(80), "t", 3.0)  # with the small one's 10: e1 at its watermark
    assert isinstance(held, Admitted) and held.reservation.engine == "e1"
    head = c.submit(req(50), "t", 3.1, max_wait_s=60.0)
    behind = c.submit(req(2), "t", 3.1, max_wait_s=60.0)
    assert isinstance(head, Queued) and isinstance(behind, Queued)
    assert c.pump(3.1) == [] and len(c.queue) == 2


def test_a_request_let_past_a_stranded_head_has_had_its_tenants_share() -> None:
    """Served out of line, a ticket still counts as its tenant's turn: the tenant's next one does not move up
    ahead of another tenant's that came before it."""
    c = pool(200, 100)
    c.eject("e0", 1.0)
    big = c.submit(req(150), "x", 1.1, max_wait_s=60.0)
    a1, a2 = (c.submit(req(50), "a", 1.1, max_wait_s=60.0) for _ in range(2))
    b1 = c.submit(req(50), "b", 1.1, max_wait_s=60.0)
    assert all(isinstance(d, Queued) for d in (big, a1, a2, b1))
    [(first, res)] = c.pump(1.1)  # e1 takes one of 50 at a time under its watermark
    assert isinstance(a1, Queued) and first is a1.ticket
    c.release(res, 1.2)
    [(second, _)] = c.pump(1.2)
    assert isinstance(b1, Queued) and second is b1.ticket  # not a2: a has had its turn


def test_the_line_shown_to_other_replicas_for_an_engine_leaves_out_what_it_could_never_hold() -> None:
    """Other replicas hold room on an engine for the requests queued here ahead of theirs: not for one larger
    than that engine's whole pool, which waits for another engine."""
    c = pool(200, 100)
    c.eject("e0", 1.0)
    c.submit(req(150), "x", 1.1, max_wait_s=60.0)
    c.submit(req(95), "y", 1.1, max_wait_s=60.0)  # would fit e1 alone: waits for room there
    assert [blocks for _, blocks, _ in c.queued_first(2.0)] == [150, 95]
    assert [blocks for _, blocks, _ in c.queued_first(2.0, within=100)] == [95]
    assert [blocks for _, blocks, _ in c.queued_first(2.0, within=200)] == [150, 95]
