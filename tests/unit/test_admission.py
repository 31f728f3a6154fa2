"""The admission controller and its ledger, driven with an explicit clock."""

from __future__ import annotations

from unittest.mock import patch

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.admission.controller import (
    DEFAULT_ENGINE,
    AdmissionController,
    Admitted,
    DrainRate,
    Queued,
    Rejected,
    UsageSample,
)
from gateway.admission.engine import SampleMark
from gateway.admission.ledger import ENGINE_LEAD_TOKENS
from gateway.config import AdmissionConfig, OutputEstimateConfig
from gateway.tokens.cost import KvGeometry, RequestCost, blocks_for

GEO = KvGeometry(block_size=16, num_blocks=100)


def make(**cfg: object) -> AdmissionController:
    c = AdmissionController(AdmissionConfig(**cfg), GEO)  # type: ignore[arg-type]
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.0, taken_at=0.0))
    return c


def rc(blocks: int, prompt: int = 16) -> RequestCost:
    """A single-sequence request of ``blocks`` blocks whose prompt fills ``prompt`` tokens."""
    return RequestCost((prompt,), 1, blocks * 16 - prompt, blocks)


def test_admits_up_to_the_high_watermark_then_queues() -> None:
    c = make()
    assert isinstance(c.submit(rc(50), "t", 0.1), Admitted)
    assert isinstance(c.submit(rc(40), "t", 0.1), Admitted)  # 90 blocks = 0.90 exactly
    assert isinstance(c.submit(rc(1), "t", 0.1), Queued)


def test_burst_between_scrapes_counts_as_in_flight_credit() -> None:
    """Without the ledger, 20 x 10 blocks would all pass against a stale 0.0 sample."""
    c = make(exclusive_upstream=False)
    decisions = [c.submit(rc(10), "t", 0.1) for _ in range(20)]
    assert sum(isinstance(d, Admitted) for d in decisions) == 9
    assert c.projected_blocks(0, 0.1) == 90


def test_a_sample_that_shows_admitted_work_does_not_count_it_twice() -> None:
    c = make(exclusive_upstream=False)
    a = c.submit(rc(30, prompt=16 * 10), "t", 0.1)
    assert isinstance(a, Admitted)
    c.progress(a.reservation, 1, 0.2)  # first token seen: prompt (10 blocks) + 1 token are in the engine
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.11, taken_at=0.3))
    # 11 blocks observed + 19 still to grow = the 30 reserved, not 11 + 30.
    assert c.projected_blocks(0, 0.3) == 11 + 30 - 11


def test_claims_say_how_much_of_them_which_sample_showed() -> None:
    """What the other gateway replicas weigh: each reservation whole, the part this replica's last sample shows,
    and which sample that was; with no sample to rest on (stale, exclusive, or an engine that does not say which
    moment it shows) there is no mark, and the others count every claim whole."""
    c = make(exclusive_upstream=False)
    a = c.submit(rc(30, prompt=16 * 10), "t", 0.1)
    assert isinstance(a, Admitted)
    c.progress(a.reservation, 1, 0.2)
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.11, taken_at=0.3, started_at=5.0, tokens=161.0))
    book = c.engines[DEFAULT_ENGINE]
    assert book.claims() == {str(a.reservation.id): (30, 11)}
    assert book.shared_mark(0.3) == SampleMark(5.0, 161.0)
    assert book.shared_mark(0.3 + c.config.stale_after_s + 0.1) is None  # stale: projections ignore the sample
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.11, taken_at=0.4, started_at=5.0))
    assert book.shared_mark(0.4) is None  # no token counters: which moment it shows is unknown
    exclusive = make(exclusive_upstream=True)
    exclusive.begin_sample()
    exclusive.apply_sample(UsageSample(usage=0.0, taken_at=0.1, started_at=5.0, tokens=0.0))
    assert exclusive.engines[DEFAULT_ENGINE].shared_mark(0.1) is None  # the ledgers together are the bound


def test_request_admitted_during_a_scrape_is_not_assumed_inside_it() -> None:
    c = make(exclusive_upstream=False)
    c.begin_sample()
    a = c.submit(rc(30), "t", 0.1)
    assert isinstance(a, Admitted)
    c.progress(a.reservation, 5, 0.15)
    c.apply_sample(UsageSample(usage=0.0, taken_at=0.05))
    assert c.projected_blocks(0, 0.2) == 30


def test_gate_closed_admits_nothing_until_low_watermark() -> None:
    c = make()
    c.apply_sample(UsageSample(usage=0.91, taken_at=1.0))
    assert isinstance(c.submit(rc(1), "t", 1.0), Queued)
    c.apply_sample(UsageSample(usage=0.85, taken_at=1.2))
    assert c.pump(1.2) == []
    c.apply_sample(UsageSample(usage=0.80, taken_at=1.4))
    assert len(c.pump(1.4)) == 1


def test_exclusive_upstream_admits_as_soon_as_a_request_ends() -> None:
    c = make()
    first = c.submit(rc(90), "t", 0.1)
    assert isinstance(first, Admitted)
    c.progress(first.reservation, 1, 0.2)
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.5, taken_at=0.3))
    assert isinstance(c.submit(rc(40), "t", 0.3), Queued)
    c.release(first.reservation, 0.4)
    assert len(c.pump(0.4)) == 1  # the sample still shows 0.5, but the ledger knows the engine is empty


def test_exclusive_upstream_counts_what_the_sample_shows_beyond_its_reservations() -> None:
    """The ledger is the bound on an engine kvgate has to itself only while the reservations cover what the
    engine holds. A non-streamed answer that outgrew its expected-output reservation says nothing until it
    ends, and a kvgate that restarted holds none of the engine's requests: the sample shows them, and they
    count. Before, exclusive mode never looked at the sample past the gate."""
    c = make()
    grown = c.submit(rc(10), "t", 0.1)
    assert isinstance(grown, Admitted)
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.6, taken_at=0.3))  # it holds 60 blocks, not 10
    assert c.projected_blocks(0, 0.3) == 10 + 50
    assert isinstance(c.submit(rc(35), "t", 0.3), Queued)  # 10 + 35 + 50 > 90 (it was admitted: 45)
    restarted = make()
    restarted.begin_sample()
    restarted.apply_sample(UsageSample(usage=0.85, taken_at=0.3))  # the engine is busy with someone's requests
    assert isinstance(restarted.submit(rc(10), "t", 0.3), Queued)
    assert isinstance(restarted.submit(rc(5), "t2", 0.3), Queued)  # (behind the first, head of line)


def test_a_request_past_the_watermark_runs_alone() -> None:
    """A request more than the watermark leaves room for (a pool of about one context, a chat without
    max_tokens) waits at the head of the line until nothing else of the gateway's is on the engine, then runs
    alone; until it ends nothing else is admitted, and the next one waits for the same."""
    c = make()
    small = c.submit(rc(10), "t", 0.1)
    assert isinstance(small, Admitted)
    big = c.submit(rc(95), "t", 0.1)
    assert isinstance(big, Queued)
    assert isinstance(c.submit(rc(1), "t", 0.1), Queued)  # behind the head, in its turn
    c.release(small.reservation, 0.2)
    ((ticket, res),) = c.pump(0.2)[:1]
    assert ticket is big.ticket and res.blocks == 95
    assert c.pump(0.2) == []  # the small one behind it waits: 95 + 1 > 90
    c.release(res, 0.3)
    assert len(c.pump(0.3)) == 1
    assert isinstance(c.submit(rc(100), "t", 0.3), Queued)  # the whole pool, but one is running
    assert c.projected_blocks(0, 0.3) == 1


def test_a_request_past_the_watermark_waits_for_room_and_the_gate() -> None:
    """Alone is not enough: the gate must be open, and the engine's other clients' blocks (not exclusive) or
    what the sample shows beyond the reservations (exclusive) leave it room in the whole pool."""
    shared = make(exclusive_upstream=False)
    shared.begin_sample()
    shared.apply_sample(UsageSample(usage=0.1, taken_at=0.1))
    assert isinstance(shared.submit(rc(95), "t", 0.1), Queued)  # 10 + 95 > 100
    shared.begin_sample()
    shared.apply_sample(UsageSample(usage=0.05, taken_at=0.2))
    assert len(shared.pump(0.2)) == 1  # 5 + 95
    gate = make()
    gate.apply_sample(UsageSample(usage=0.91, taken_at=1.0))
    gate.apply_sample(UsageSample(usage=0.0, taken_at=1.1))
    gate.apply_sample(UsageSample(usage=0.91, taken_at=1.2))
    gate.apply_sample(UsageSample(usage=0.85, taken_at=1.3))  # someone else's: kvgate holds nothing here
    assert isinstance(gate.submit(rc(5), "t", 1.3), Queued)  # the gate is closed until usage is under 80%
    gate.apply_sample(UsageSample(usage=0.0, taken_at=1.4))
    assert len(gate.pump(1.4)) == 1


def test_a_request_past_the_watermark_is_not_alone_while_the_other_replicas_cannot_say() -> None:
    c = AdmissionController(AdmissionConfig(), GEO, shared_books=True)
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.0, taken_at=0.0))
    book = c.engines[DEFAULT_ENGINE]
    assert book.others_blocks is None
    assert isinstance(c.submit(rc(95), "t", 0.1), Queued)
    book.others_blocks = 3
    assert c.pump(0.1) == []
    book.others_blocks = 0
    assert len(c.pump(0.1)) == 1
    assert book.room_for_others(0.1) == 0  # the others may hold nothing beside it


def test_stale_metrics_fall_back_to_the_ledger_under_a_lower_cap() -> None:
    c = make(stale_after_s=2.0, stale_ledger_cap=0.5)
    assert isinstance(c.submit(rc(50), "t", 5.0), Admitted)
    assert isinstance(c.submit(rc(1), "t", 5.0), Queued)


def test_the_stale_ledger_never_admits_past_the_high_watermark() -> None:
    """Lowering high_watermark alone (0.6, under the default stale_ledger_cap of 0.75) lowers what a stale
    ledger admits with it: never more without fresh metrics than with them."""
    c = make(stale_after_s=2.0, high_watermark=0.6, low_watermark=0.5)
    assert isinstance(c.submit(rc(60), "t", 5.0), Admitted)  # 60 of 100 blocks: the watermark exactly
    assert isinstance(c.submit(rc(1), "t", 5.0), Queued)  # under 0.75, but past 0.6


def test_stale_metrics_fall_back_to_the_ledger_only_where_it_bounds_the_engine() -> None:
    """The reservations stand for the engine while its metrics are stale only if kvgate has the engine to
    itself, has seen it, and did not last see it full with requests of its own in. Other clients' use, an
    engine never seen, or a closed gate with our requests still held: admit nothing until a fresh sample
    (before, up to stale_ledger_cap of kvgate's own on top)."""
    shared = make(stale_after_s=2.0, exclusive_upstream=False)
    assert isinstance(shared.submit(rc(1), "t", 5.0), Queued)
    full = make(stale_after_s=2.0)
    held = full.submit(rc(20), "t", 0.1)
    assert isinstance(held, Admitted)
    full.begin_sample()
    full.apply_sample(UsageSample(usage=0.92, taken_at=0.2))  # the gate closes with our request in
    assert isinstance(full.submit(rc(1), "t", 5.0), Queued)  # stale now, and the gate was closed
    full.release(held.reservation, 5.1)
    assert len(full.pump(5.1)) == 1  # ours are gone: the ledger bounds it again
    unseen = AdmissionController(AdmissionConfig(stale_after_s=2.0), KvGeometry(16, 100))
    assert isinstance(unseen.submit(rc(1), "t", 5.0), Queued)


def test_hold_policy_admits_nothing_on_stale_metrics() -> None:
    c = make(stale_after_s=2.0, stale_policy="hold")
    assert isinstance(c.submit(rc(1), "t", 5.0), Queued)


def test_unknown_geometry_admits_nothing() -> None:
    c = AdmissionController(AdmissionConfig())
    assert isinstance(c.submit(rc(1), "t", 0.0), Queued)


def test_queue_full_is_rejected_with_retry_after_from_the_drain_rate() -> None:
    c = make(queue_max_length=2)
    held = [c.submit(rc(10), "t", 0.0) for _ in range(8)]
    for _ in range(2):
        assert isinstance(c.submit(rc(45), "t", 0.0), Queued)
    rejected = c.submit(rc(45), "t", 0.0)
    assert isinstance(rejected, Rejected) and rejected.reason == "queue_full"
    for i, d in enumerate(held[:2]):
        assert isinstance(d, Admitted)
        c.release(d.reservation, 1.0 + i)
    # two finishes are no rate yet (a batch that ends together reads as tens a second): the default
    assert c.retry_after(3, 2.0) == c.retry_after(100, 2.0) == 5.0
    for i, d in enumerate(held[2:]):
        assert isinstance(d, Admitted)
        c.release(d.reservation, 3.0 + i)
    # eight finishes a second apart: about one a second -> positions / rate
    assert 1.0 <= c.retry_after(3, 10.0) <= 60.0
    assert c.retry_after(30, 10.0) > c.retry_after(3, 10.0)


def test_fifo_head_blocks_smaller_requests_behind_it() -> None:
    c = make()
    assert isinstance(c.submit(rc(80), "t", 0.0), Admitted)
    big = c.submit(rc(20), "t", 0.0)
    small = c.submit(rc(5), "t", 0.0)
    assert isinstance(big, Queued) and isinstance(small, Queued)
    assert c.pump(0.0) == []  # the 5-block request fits but must not overtake


def test_expired_tickets_leave_the_queue() -> None:
    c = make(queue_max_wait_s=1.0)
    assert isinstance(c.submit(rc(90), "t", 0.0), Admitted)
    q = c.submit(rc(5), "t", 0.0)
    assert isinstance(q, Queued)
    assert c.expire(0.5) == []
    assert c.expire(1.0) == [q.ticket]
    assert len(c.queue) == 0


# --- invariants under any interleaving ---------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 100), st.integers(1, 40)),  # past 90: runs alone
        st.tuples(st.just("progress"), st.integers(0, 50), st.integers(1, 500)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("sample"), st.integers(0, 100), st.just(0)),
        st.tuples(st.just("tick"), st.integers(1, 500), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.booleans())
def test_projection_never_admits_past_the_high_watermark(script: list[tuple[str, int, int]], exclusive: bool) -> None:
    """Model the engine exactly: it holds each admitted request's progress, nothing else. Whatever happens,
    what the engine really holds never exceeds the high watermark (but for a request larger than that, which
    runs alone), and nothing is left in the ledger."""
    c = make(exclusive_upstream=exclusive, queue_max_wait_s=5.0, growth_model="worst_case")
    now = 0.0
    live: list = []
    tickets: list = []
    engine_generated: dict[int, int] = {}

    def engine_blocks() -> int:
        return sum(r.cost.blocks_after(engine_generated.get(r.id, 0), 16) for r in live)

    for op, a, b in script:
        if op == "submit":
            d = c.submit(rc(a, prompt=16 * min(a, b)), "t", now)
            if isinstance(d, Admitted):
                live.append(d.reservation)
            elif isinstance(d, Queued):
                tickets.append(d.ticket)
        elif op == "progress" and live:
            r = live[a % len(live)]
            engine_generated[r.id] = min(r.cost.max_output, engine_generated.get(r.id, 0) + b)
            # the gateway sees at most what the engine produced
            c.progress(r, engine_generated[r.id], now)
        elif op == "release" and live:
            r = live.pop(a % len(live))
            assert c.release(r, now)
            assert not c.release(r, now)
        elif op == "cancel" and tickets:
            c.cancel(tickets.pop(a % len(tickets)))
        elif op == "sample":
            c.begin_sample()
            c.apply_sample(UsageSample(usage=engine_blocks() / 100, taken_at=now))
        elif op == "tick":
            now += b / 100
            for t in c.expire(now):
                tickets.remove(t)
        for t, res in c.pump(now):
            tickets.remove(t)
            live.append(res)
        # Even if every admitted request grew to its whole reservation right now, the engine would stay
        # under the high watermark (samples are true when taken, as the engine's are).
        worst = sum(r.blocks for r in live)
        assert worst == c.ledger.reserved_blocks
        assert engine_blocks() <= worst and (worst <= 90 or (len(live) == 1 and worst <= 100))
    for r in live:
        c.release(r, now)
    assert len(c.ledger) == 0 and c.ledger.reserved_blocks == 0 and c.ledger.in_sample_blocks == 0
    assert c.ledger.reserved_count == c.ledger.released_count


@settings(max_examples=300, deadline=None)
@given(ops)
def test_samples_that_lag_behind_admissions_never_let_a_burst_through(script: list[tuple[str, int, int]]) -> None:
    """Samples here always read 0.0, as if every scrape raced ahead of the burst it should have seen:
    the in-flight credit alone must keep the worst case under the high watermark, in both modes."""
    for exclusive in (True, False):
        c = make(exclusive_upstream=exclusive, queue_max_wait_s=5.0, growth_model="worst_case")
        now = 0.0
        live: list = []
        tickets: list = []
        for op, a, _b in script:
            if op == "submit":
                d = c.submit(rc(a), "t", now)
                if isinstance(d, Admitted):
                    live.append(d.reservation)
                elif isinstance(d, Queued):
                    tickets.append(d.ticket)
            elif op == "release" and live:
                c.release(live.pop(a % len(live)), now)
            elif op == "cancel" and tickets:
                c.cancel(tickets.pop(a % len(tickets)))
            elif op == "sample":
                c.begin_sample()
                c.apply_sample(UsageSample(usage=0.0, taken_at=now))
            elif op == "tick":
                now += 0.01
                for t in c.expire(now):
                    tickets.remove(t)
            for t, res in c.pump(now):
                tickets.remove(t)
                live.append(res)
            worst = sum(r.blocks for r in live)
            assert worst <= 90 or (len(live) == 1 and worst <= 100)  # past the watermark only alone


# --- the lockstep growth model -------------------------------------------------------------------------

lockstep_ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 40), st.integers(1, 30), st.integers(1, 3)),
        st.tuples(st.just("burst"), st.integers(1, 10), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 40), st.integers(0, ENGINE_LEAD_TOKENS), st.just(0)),
        st.tuples(st.just("sample"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0), st.just(0)),
    ),
    max_size=150,
)


@pytest.mark.parametrize("exact_limit", [64, 0], ids=["exact", "bound"])
@settings(max_examples=400, deadline=None)
@given(script=lockstep_ops, exclusive=st.booleans())
@example(script=[("burst", 1, 29, 12), ("step", 1, 0, 0), ("burst", 1, 29, 12), ("step", 40, 0, 0)], exclusive=True)
def test_lockstep_engine_never_exceeds_the_high_watermark(
    script: list[tuple[str, int, int, int]], exclusive: bool, exact_limit: int
) -> None:
    """An engine that behaves as continuous batching does: an admitted request prefills at once, then every
    running sequence gains one token per step and frees its blocks at its output budget. The gateway sees
    each request's tokens up to ``lag`` steps late. However requests interleave, what the engine really holds
    never exceeds the high watermark (90 of 100 blocks). That lockstep admits more than whole reservations
    would is shown by test_lockstep_admits_what_finishing_requests_will_free."""
    with patch("gateway.admission.ledger.EXACT_LIMIT", exact_limit):
        _run_lockstep(script, exclusive)


def _run_lockstep(script: list[tuple[str, int, int, int]], exclusive: bool) -> None:
    c = make(exclusive_upstream=exclusive, queue_max_wait_s=1e9, growth_model="lockstep")
    now = 0.0
    live: list = []  # reservations in the engine
    generated: dict[int, int] = {}  # per sequence, as the engine has it
    tickets: list = []

    def engine_blocks() -> int:
        return sum(r.cost.blocks_after(generated[r.id] * r.cost.num_sequences, 16) for r in live)

    def admitted(res) -> None:  # type: ignore[no-untyped-def]
        live.append(res)
        generated[res.id] = 0

    for op, a, b, n in script:
        if op in ("submit", "burst"):
            # a burst is n single-sequence copies of one request: short prompts, long outputs
            copies, seqs = (n, 1) if op == "burst" else (1, n)
            cost = RequestCost((a * 4,), seqs, b * 4, seqs * ((a * 4 + b * 4 + 15) // 16))
            if cost.blocks > 90:
                continue
            for _ in range(copies):
                d = c.submit(cost, "t", now)
                if isinstance(d, Admitted):
                    admitted(d.reservation)
                elif isinstance(d, Queued):
                    tickets.append(d.ticket)
        elif op == "step":
            for _ in range(a):
                now += 0.001
                for r in list(live):
                    generated[r.id] += 1
                    if generated[r.id] >= r.cost.max_output:
                        live.remove(r)
                        c.release(r, now)
                    else:
                        # the gateway has seen up to ENGINE_LEAD_TOKENS fewer than the engine made, and
                        # how many fewer differs from request to request
                        lag = (b * r.id + r.id // 3) % (ENGINE_LEAD_TOKENS + 1)
                        c.progress(r, max(0, generated[r.id] - lag) * r.cost.num_sequences, now)
                assert engine_blocks() <= 90
                for t, res in c.pump(now):
                    tickets.remove(t)
                    admitted(res)
                assert engine_blocks() <= 90
        elif op == "sample":
            c.begin_sample()
            c.apply_sample(UsageSample(usage=engine_blocks() / 100, taken_at=now))
        elif op == "cancel" and tickets:
            c.cancel(tickets.pop(a % len(tickets)))
        for t, res in c.pump(now):
            tickets.remove(t)
            admitted(res)
        assert engine_blocks() <= 90
    for r in live:
        c.release(r, now)
    assert c.ledger.reserved_count == c.ledger.released_count and len(c.ledger) == 0


def test_lockstep_admits_what_finishing_requests_will_free() -> None:
    """Three 30-block requests at different stages never hold 90 blocks together: the furthest one is gone
    before the youngest has grown. Lockstep sees room for 10 more blocks; worst case does not."""
    results = {}
    for model in ("worst_case", "lockstep"):
        c = make(growth_model=model)
        for done_blocks in (28, 14, 0):
            d = c.submit(RequestCost((16,), 1, 16 * 29, 30), "t", 0.0)
            assert isinstance(d, Admitted)
            c.progress(d.reservation, max(1, 16 * done_blocks), 0.1)
        assert c.ledger.reserved_blocks == 90
        results[model] = isinstance(c.submit(RequestCost((16,), 1, 16 * 9, 10), "t", 0.1), Admitted)
        if model == "lockstep":
            # peak is just before the oldest finishes: 30 + (1 + 14 + 1) + (1 + 0 + 1) blocks, plus rounding
            assert 48 <= c.ledger.peak_blocks() - 10 <= 51
    assert results == {"worst_case": False, "lockstep": True}


def test_streams_whose_events_ran_behind_their_tokens_are_counted_from_the_sample() -> None:
    """Exclusive and lockstep: a stream's events can run far behind its tokens (vLLM merges the deltas a busy
    API server has not sent; the relay waits on a slow client), and the model grows it from what was seen. The
    sample shows what the model missed, and the projection carries it: what is admitted then keeps the engine
    under the watermark as everything goes on decoding. (Counted against the whole reservations instead, the
    miss hid under them: 390 blocks were admitted and the engine reached 98.7%.)"""
    bs, total = 16, 1000
    c = AdmissionController(
        AdmissionConfig(output_estimate=OutputEstimateConfig(enabled=False), exclusive_upstream=True),
        KvGeometry(bs, total),
    )
    c.begin_sample()
    c.apply_sample(UsageSample(usage=0.0, taken_at=0.0))
    slow = c.submit(RequestCost((16,), 1, 1584, 100), "t", 0.1)  # a long stream
    big = c.submit(RequestCost((8000,), 1, 16, 501), "t", 0.1)  # a long prompt, 16 tokens to go
    assert isinstance(slow, Admitted) and isinstance(big, Admitted)
    c.progress(slow.reservation, 1, 0.2)  # one event seen, 1,500 tokens in the engine
    c.progress(big.reservation, 1, 0.2)
    engine = blocks_for(16 + 1500, bs) + blocks_for(8001, bs)
    c.begin_sample()
    c.apply_sample(UsageSample(usage=engine / total, taken_at=0.3))
    admitted = 0
    while isinstance(d := c.submit(RequestCost((16,), 1, 144, 10), "t", 0.3), Admitted):
        admitted += d.reservation.blocks
    assert admitted > 0
    step = 14  # the last step before the long prompt's request ends, every sequence a token further
    held = blocks_for(16 + 1500 + step, bs) + blocks_for(8001 + step, bs) + admitted
    assert held <= 0.90 * total


def test_a_burst_of_finishes_in_one_instant_is_not_read_as_a_rate() -> None:
    """32 requests ending within a millisecond read 32,000 a second, and every queue ETA as 0; a floor much
    longer than a scrape would read the first burst after a lull too slow, and refuse requests as hopeless."""
    rate = DrainRate(window_s=30.0)
    for i in range(32):
        rate.record(10.0 + i * 1e-5)
    assert rate.per_second(10.001) == pytest.approx(32 / 0.25)  # over a scrape's time at least
    assert rate.per_second(12.0) == pytest.approx(16.0)  # then over what has passed
