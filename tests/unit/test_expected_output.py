"""Reservation by expected output: what is reserved, how a request that outruns its estimate grows, how the
engine's own numbers make kvgate more cautious, and that the ledger stays exact whatever the estimates."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.controller import AdmissionController, Admitted, Caution, UsageSample
from gateway.config import AdmissionConfig, OutputEstimateConfig
from gateway.tokens.cost import KvGeometry, estimate_cost

GEO = KvGeometry(block_size=16, num_blocks=10_000)
KEY = ("m", "chat", "t")


def controller(enabled: bool = True, min_samples: int = 8) -> AdmissionController:
    config = AdmissionConfig(output_estimate=OutputEstimateConfig(enabled=enabled, min_samples=min_samples))
    c = AdmissionController(config, GEO)
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 0.0))
    return c


def chat(prompt: int = 100, max_tokens: int | None = None, n: int = 1):  # type: ignore[no-untyped-def]
    return estimate_cost((prompt,), max_tokens=max_tokens, sequences_per_prompt=n, max_model_len=4096, geometry=GEO)


def test_a_request_reserves_its_expected_output_once_lengths_are_known() -> None:
    c = controller()
    full = chat()  # no max_tokens: the budget is the context's rest, 3996 tokens
    first = c.submit(full, "t", 0.0, key=KEY)
    assert isinstance(first, Admitted) and first.reservation.blocks == full.blocks  # nothing learned yet
    for _ in range(8):
        c.learn(first.reservation, 200)
    second = c.submit(full, "t", 0.0, key=KEY)
    assert isinstance(second, Admitted)
    assert second.reservation.cost.max_output == 200 and second.reservation.blocks == 19  # ceil(300 / 16)
    assert second.reservation.full is full  # the budget is kept: never-fits, rate limits and growth use it


def test_the_estimate_never_exceeds_the_requests_own_cap_and_can_be_switched_off() -> None:
    c = controller()
    res = c.submit(chat(), "t", 0.0, key=KEY)
    assert isinstance(res, Admitted)
    for _ in range(8):
        c.learn(res.reservation, 3000)
    capped = chat(max_tokens=50)
    assert c.expected_cost(capped, KEY) is capped
    off = controller(enabled=False)
    off.lengths = c.lengths
    assert off.expected_cost(chat(), KEY).max_output == 3996


def test_a_request_that_outruns_its_estimate_grows_its_reservation() -> None:
    c = controller()
    seed = c.submit(chat(), "t", 0.0, key=KEY)
    assert isinstance(seed, Admitted)
    for n in [*([100] * 90), *([1500] * 10)]:
        c.learn(seed.reservation, n)
    c.release(seed.reservation, 0.0)
    res = c.submit(chat(), "t", 0.0, key=KEY)
    assert isinstance(res, Admitted) and res.reservation.cost.max_output == 100
    before = c.ledger.reserved_blocks
    c.progress(res.reservation, 95, 1.0)  # within ENGINE_LEAD_TOKENS of its estimate: grow now, not after
    # most requests that got this far stopped at 100: a little more room, ahead of the engine's lead
    assert res.reservation.cost.max_output == 95 + 16 and c.outran == 1
    c.progress(res.reservation, 105, 1.5)  # past 100: only the long ones went further
    assert res.reservation.cost.max_output == 1500 and c.outran == 1  # one request, however often it grows
    assert c.ledger.reserved_blocks == before - 13 + 100  # ceil(200/16) -> ceil(1600/16)
    c.progress(res.reservation, 1505, 2.0)  # past every length seen: the whole budget
    assert res.reservation.cost.max_output == 3996 and res.reservation.blocks == res.reservation.full.blocks


def test_preemptions_make_it_cautious_and_calm_relaxes_it_slowly() -> None:
    caution = Caution(0.9, relax_after_s=30.0)
    assert caution.quantile == 0.9
    caution.observe(1.0, trouble=True)
    caution.observe(2.0, trouble=True)  # the same episode: at most one step per 5 s
    assert caution.quantile == 0.95
    caution.observe(7.0, trouble=True)
    assert caution.quantile == 0.975
    caution.observe(20.0, trouble=False)
    assert caution.quantile == 0.975  # not calm for long enough yet
    caution.observe(38.0, trouble=False)  # 30 s since the last trouble
    assert caution.quantile == 0.95
    for t in range(3):
        caution.observe(100.0 + 5 * t, trouble=True)
    assert caution.quantile == 1.0  # the whole budget: worst case until the engine calms down
    c = controller()
    c.apply_sample(UsageSample(0.5, 1.0, preemptions=3.0))  # preemptions with nothing of ours in flight
    assert c.caution.quantile == 0.7  # someone else's traffic: not a reason to reserve more
    res = c.submit(chat(), "t", 1.0, key=KEY)
    assert isinstance(res, Admitted)
    c.apply_sample(UsageSample(0.5, 2.0, preemptions=5.0))  # the counter moved while ours ran
    assert c.caution.quantile == 0.85  # the configured 0.7, one step more cautious


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, 3000), min_size=0, max_size=40))
def test_the_ledger_stays_exact_whatever_the_estimates(seed: int, learned: list[int]) -> None:
    """Estimates wrong in either direction (learned lengths unrelated to what requests then produce):
    every reservation is released once, the books never go negative, and end at zero."""
    rng = random.Random(seed)
    c = controller(min_samples=4)
    live = []
    for step in range(200):
        op = rng.random()
        if op < 0.35:
            d = c.submit(chat(rng.randint(1, 2000), rng.choice([None, rng.randint(1, 2000)]), rng.randint(1, 3)),
                         "t", float(step), key=KEY)  # fmt: skip
            if isinstance(d, Admitted):
                live.append(d.reservation)
        elif op < 0.7 and live:
            res = rng.choice(live)
            c.progress(res, res.generated + rng.randint(1, 400), float(step))
        elif live:
            res = live.pop(rng.randrange(len(live)))
            if learned:
                c.learn(res, learned[step % len(learned)])
            assert c.release(res, float(step)) and not c.release(res, float(step))
        assert c.ledger.reserved_blocks == sum(r.blocks for r in live) >= 0
        assert all(r.blocks <= r.full.blocks for r in live)
    for res in live:
        c.release(res, 1000.0)
    assert c.ledger.reserved_blocks == 0 and c.ledger.reserved_count == c.ledger.released_count


def test_min_tokens_is_a_floor_of_the_estimate() -> None:
    c = controller()
    seed = c.submit(chat(), "t", 0.0, key=KEY)
    assert isinstance(seed, Admitted)
    for _ in range(8):
        c.learn(seed.reservation, 50)
    floor = estimate_cost(
        (100,), max_tokens=None, sequences_per_prompt=1, max_model_len=4096, geometry=GEO,
        min_tokens=400,
    )  # fmt: skip
    assert c.expected_cost(floor, KEY).max_output == 400
    assert c.expected_cost(chat(), KEY).max_output == 50


def test_a_configured_prior_stands_in_until_lengths_are_learned() -> None:
    config = AdmissionConfig(output_estimate=OutputEstimateConfig(enabled=True, min_samples=4, prior_tokens=300))
    c = AdmissionController(config, GEO)
    assert c.expected_cost(chat(), KEY).max_output == 300
    res = c.ledger.reserve(chat(), "t", 0.0, key=KEY)
    for _ in range(4):
        c.learn(res, 80)
    assert c.expected_cost(chat(), KEY).max_output == 80


def test_a_request_stopped_by_its_budget_is_learned_as_longer_than_that_and_a_batch_not_at_all() -> None:
    """Four answers ended at 100, 200, 300 and 400 tokens, four ran into their cap of 250: the median is 300
    (the capped ones went past 250), not 200 (dropping them) nor 250 (taking the cap for their length). A batch
    (its mean hides its longest sequence) teaches nothing."""
    c = controller(min_samples=1)
    c.learn(c.ledger.reserve(chat(n=2), "t", 0.0, key=KEY), 100)
    assert c.lengths.samples(KEY) == 0
    for n in (100, 200, 300, 400):
        c.learn(c.ledger.reserve(chat(), "t", 0.0, key=KEY), n)
        c.learn(c.ledger.reserve(chat(max_tokens=250), "t", 0.0, key=KEY), 250)
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 1.0))  # answers are cached until the next sample
    assert c.lengths.quantile(KEY, 0.5) == 300
    assert c.expected_cost(chat(n=2), KEY).max_output == 3996  # a batch keeps its whole budget


def test_a_tenant_whose_cap_cuts_most_answers_reserves_its_cap() -> None:
    """Natural lengths uniform on 1-1,000 and every request capped at 300: 70% run into the cap. Their 0.7
    quantile is the cap itself (the whole budget), where learning from the ended ones alone put it near 210
    (and seven requests in ten outran their reservation)."""
    c = controller(min_samples=32)
    rng = random.Random(7)
    for _ in range(512):
        natural = rng.randint(1, 1000)
        res = c.ledger.reserve(chat(max_tokens=300), "t", 0.0, key=KEY)
        c.learn(res, min(natural, 300))
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 1.0))
    assert c.expected_cost(chat(max_tokens=300), KEY).max_output == 300
    assert c.expected_cost(chat(max_tokens=2000), KEY).max_output == 2000  # past what anyone was let run


def test_a_stream_its_client_left_is_learned_as_longer_than_what_it_was_sent() -> None:
    c = controller(min_samples=1)
    for n in (100, 200, 300, 400):
        c.learn(c.ledger.reserve(chat(), "t", 0.0, key=KEY), n)
        c.learn(c.ledger.reserve(chat(), "t", 0.0, key=KEY), 250, ended=False)
    c.learn(c.ledger.reserve(chat(), "t", 0.0, key=KEY), 0, ended=False)  # left before a token: nothing
    assert c.lengths.samples(KEY) == 8
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 1.0))
    assert c.lengths.quantile(KEY, 0.5) == 300


def test_requests_still_generating_raise_the_estimate_from_the_next_sample() -> None:
    """Eight short answers finished, eight long ones are still streaming past 500 tokens: from the next sample
    on, a new request reserves as if the long ones counted (they will end past 500), not at the short ones'."""
    c = controller()
    running = []
    for _ in range(8):
        done = c.submit(chat(), "t", 0.0, key=KEY)
        assert isinstance(done, Admitted)
        c.learn(done.reservation, 100)
        c.release(done.reservation, 0.0)
    assert c.expected_cost(chat(), KEY).max_output == 100
    for _ in range(8):
        long = c.submit(chat(), "t", 0.0, key=KEY)
        assert isinstance(long, Admitted)
        c.progress(long.reservation, 500, 1.0)
        running.append(long.reservation)
    assert c.expected_cost(chat(), KEY).max_output == 100  # not until the engine is sampled
    c.begin_sample()
    c.apply_sample(UsageSample(0.1, 1.0))
    assert c.expected_cost(chat(), KEY).max_output == 3996  # half are past 500: q 0.7 is beyond what ended
    for res in running:
        c.learn(res, 600)
        c.release(res, 2.0)
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 2.0))
    assert c.expected_cost(chat(), KEY).max_output == 600
