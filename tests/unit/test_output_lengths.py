"""The output-length estimator: quantiles of what finished requests produced, per key with fallback."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.output_lengths import OutputLengths

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
