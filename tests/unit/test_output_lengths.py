"""The output-length estimator: quantiles of what finished requests produced, per key with fallback."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.output_lengths import BEYOND, STALE_AFTER, OutputLengths

KEY = ("llama", "chat", "team-a")


def test_a_young_key_falls_back_to_coarser_ones_and_then_to_none() -> None:
    est = OutputLengths(min_samples=10)
    assert est.quantile(KEY, 0.9) is None  # nothing known: the caller reserves the cap
    for n in range(1, 11):
        est.observe(("llama", "chat", "team-b"), n * 10)
    assert est.quantile(KEY, 0.9) == 90  # team-a is unknown; (llama, chat) knows 10 lengths
    assert est.quantile(("other", "chat", "x"), 0.5) == 50  # only the root knows enough
    for _ in range(10):
        est.observe(KEY, 1000)
    assert est.quantile(KEY, 0.9) == 1000  # its own key once it has enough


def test_a_request_that_outran_its_estimate_asks_among_the_longer_ones() -> None:
    est = OutputLengths(min_samples=8)
    for n in [*([100] * 90), *range(1000, 1100, 10)]:
        est.observe(KEY, n)
    assert est.quantile(KEY, 0.9) == 100
    assert est.quantile(KEY, 0.9, above=100) == 1080  # past 100: only the long tail went further
    assert est.quantile(KEY, 0.9, above=5000) is None  # nobody went that far: reserve the cap


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("quantile", [(0.5, 0.0, 0.1), (0.9, 1.2816, 0.1), (0.99, 2.3263, 0.2)])
def test_it_converges_on_stationary_traffic(seed: int, quantile: tuple[float, float, float]) -> None:
    """Lognormal lengths (median 250): the estimate lands near the distribution's true quantile, within about
    four standard errors of 4,096 draws (wider in the tail, where fewer draws land). Fixed seeds: a search over
    seeds would find the one sample in a million that strays further."""
    q, z, tolerance = quantile
    rng = random.Random(seed)
    est = OutputLengths(window=4096, min_samples=32)
    for _ in range(4096):
        est.observe(KEY, max(1, round(rng.lognormvariate(5.52, 0.9))))
    got = est.quantile(KEY, q)
    truth = math.exp(5.52 + 0.9 * z)
    assert got is not None and abs(got - truth) <= tolerance * truth


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_it_follows_a_shift_within_one_window(seed: int) -> None:
    rng = random.Random(seed)
    est = OutputLengths(window=256, min_samples=32)
    for _ in range(1000):
        est.observe(KEY, rng.randint(100, 200))
    assert 180 <= (est.quantile(KEY, 0.9) or 0) <= 200
    for _ in range(256):  # the traffic changes: outputs are now 10x longer
        est.observe(KEY, rng.randint(1000, 2000))
    assert 1800 <= (est.quantile(KEY, 0.9) or 0) <= 2000


def test_keys_are_bounded_and_the_root_is_kept() -> None:
    est = OutputLengths(min_samples=1, max_keys=10)
    for i in range(100):
        est.observe((f"model-{i}", "chat", "t"), i)
    assert len(est._windows) <= 10 and est.samples(()) == 100


def _snapshot_of_a_steady_flow(seed: int, at: int) -> tuple[list[int], list[int], list[int]]:
    """One request per step, each producing one token per step until its lognormal length (median 250):
    at step ``at``, the lengths of those that finished, the tokens produced so far by those still running,
    and every length drawn (the truth)."""
    rng = random.Random(seed)
    finished, running, drawn = [], [], []
    for arrival in range(at):
        length = max(1, round(rng.lognormvariate(5.52, 0.9)))
        drawn.append(length)
        if arrival + length <= at:
            finished.append(length)
        else:
            running.append(at - arrival)
    return finished, running, drawn


@pytest.mark.parametrize("seed", range(6))
def test_requests_still_running_correct_the_bias_of_finished_ones(seed: int) -> None:
    """Short outputs finish first: after 1,500 steps of a steady flow whose tail runs for thousands of steps,
    the finished requests alone put the 0.7 quantile well below the truth; counted as censored observations,
    the requests still running bring the estimate back to within 10% of it."""
    finished, running, drawn = _snapshot_of_a_steady_flow(seed, at=1500)
    est = OutputLengths(window=4096, min_samples=32)
    for n in finished:
        est.observe(KEY, n)
    truth = sorted(drawn)[math.ceil(0.7 * len(drawn)) - 1]
    naive = est.quantile(KEY, 0.7)
    assert naive is not None and naive < 0.9 * truth  # the bias this is about
    est.set_in_flight((KEY, produced) for produced in running)
    corrected = est.quantile(KEY, 0.7)
    assert corrected is not None and abs(corrected - truth) <= 0.1 * truth, (naive, corrected, truth)
    est.set_in_flight(())
    assert est.quantile(KEY, 0.7) == naive  # nothing running: the finished ones alone again


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3000), min_size=1, max_size=300),
    st.lists(st.integers(0, 3000), max_size=300),
    st.floats(0.05, 0.99),
    st.integers(0, 2000),
)
def test_running_requests_only_ever_raise_the_estimate(
    finished: list[int], running: list[int], q: float, above: int
) -> None:
    """A running request is one more that went at least that far: counting it can only move a quantile up
    (or out of reach, BEYOND: reserve the budget), never down; and its answers come from lengths really seen."""
    est = OutputLengths(min_samples=1, window=1024)
    for n in finished:
        est.observe(KEY, n)
    plain = est.quantile(KEY, q, above=above)
    est.set_in_flight((KEY, r) for r in running)
    censored = est.quantile(KEY, q, above=above)
    if plain is None:
        assert censored is None
    else:
        assert censored is not None and plain <= censored
        assert censored == BEYOND or (censored in finished and censored > above)
    assert est.quantile(KEY, q, above=above) == censored  # the cached answer is the same


def test_running_requests_count_for_every_coarser_key_and_are_replaced_each_sample() -> None:
    est = OutputLengths(min_samples=4)
    for n in (10, 20, 30, 40):
        est.observe(("m", "chat", "a"), n)
    assert est.quantile(("m", "chat", "b"), 0.5) == 20  # via (m, chat)
    est.set_in_flight([(("m", "chat", "b"), 35)] * 4)  # four of another tenant are past 35 already
    assert est.quantile(("m", "chat", "b"), 0.5) == 40
    est.set_in_flight([])
    assert est.quantile(("m", "chat", "b"), 0.5) == 20


def test_a_key_whose_running_requests_outlast_what_ended_does_not_fall_back_to_a_shorter_coarser_key() -> None:
    """A tenant's finished outputs put its 0.7 quantile at 600 and 60 of its requests are still running past
    900, longer than any of its that ended: the answer is "past everything seen" (the whole budget), not the
    model-wide quantile, which is shorter."""
    est = OutputLengths(min_samples=8)
    for n in range(100, 700, 10):  # the model's other tenants
        est.observe(("m", "chat", "other"), n // 2 + 50)
    for n in range(200, 800, 20):
        est.observe(("m", "chat", "t"), n)
    assert est.quantile(("m", "chat", "t"), 0.7) == 600
    assert (est.quantile(("m", "chat"), 0.7) or 0) < 600
    est.set_in_flight([(("m", "chat", "t"), 900)] * 60)
    assert est.quantile(("m", "chat", "t"), 0.7) == BEYOND


def test_running_requests_are_forgotten_when_no_new_set_comes() -> None:
    """The engine's metrics stopped (no samples, no new in-flight set): after STALE_AFTER finishes the old
    running set no longer counts."""
    est = OutputLengths(min_samples=4)
    for n in (10, 20, 30, 40):
        est.observe(KEY, n)
    est.set_in_flight([(KEY, 35)] * 4)
    assert est.quantile(KEY, 0.5) == 40
    for _ in range(STALE_AFTER):
        est.observe(KEY, 20)
    assert est.quantile(KEY, 0.5) == 20


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.booleans()), min_size=1, max_size=300),
    st.floats(0.05, 0.99),
    st.integers(0, 2000),
)
def test_stopped_requests_only_ever_raise_the_estimate(observed: list[tuple[int, bool]], q: float, above: int) -> None:
    """A request stopped after ``n`` tokens (its cap, its client) went at least that far: learning it as such
    moves a quantile up (or out of reach) against dropping it, never down, and any answer is a length that
    really ended; the window holds the last ``window`` observations of either kind."""
    window = 64
    kept = OutputLengths(min_samples=1, window=window)
    dropped = OutputLengths(min_samples=1, window=window)
    for n, ended in observed:
        kept.observe(KEY, n, ended=ended)
    for n, ended in observed[-window:]:
        if ended:
            dropped.observe(KEY, n)
    assert kept.samples(KEY) == min(window, len(observed))
    with_stopped, without = kept.quantile(KEY, q, above=above), dropped.quantile(KEY, q, above=above)
    if without is None:
        assert with_stopped in (None, BEYOND)  # too few ended: none known, or past them (stopped ones)
    else:
        ended_lengths = [n for n, ended in observed[-window:] if ended]
        assert with_stopped is not None and without <= with_stopped
        assert with_stopped == BEYOND or (with_stopped in ended_lengths and with_stopped > above)


def test_a_key_only_ever_stopped_at_its_cap_reserves_past_it_once_enough_ended() -> None:
    """Sixteen answers ended under 100 and forty-eight ran into a cap of 100: the 0.7 quantile lies past every
    length seen to end (the whole budget); with the capped ones dropped it would be under 100."""
    est = OutputLengths(min_samples=16)
    for n in range(16):
        est.observe(KEY, 50 + n)
    for _ in range(48):
        est.observe(KEY, 100, ended=False)
    assert est.quantile(KEY, 0.7) == BEYOND
    assert est.quantile(KEY, 0.2) == 62  # within the ended ones: survival 0.8 after 13 of 64 ended


def test_a_tenant_whose_answers_all_run_to_their_cap_is_not_given_another_tenants_lengths() -> None:
    """Tenant t's requests all run into their cap of 1,000, u's end at 50 and are nine in ten: t has no ended
    length of its own, and the coarser keys' are u's. Its 0.9 quantile lies past what it was let run (its whole
    budget), not at 50."""
    est = OutputLengths(min_samples=8)
    for i in range(200):
        if i % 10:
            est.observe(("m", "chat", "u"), 50)
        else:
            est.observe(("m", "chat", "t"), 1000, ended=False)
    assert est.quantile(("m", "chat", "t"), 0.9) == BEYOND
    assert est.quantile(("m", "chat", "u"), 0.9) == 50
    assert est.quantile(("m", "chat", "new"), 0.5) == 50  # a tenant with nothing yet: the model's
