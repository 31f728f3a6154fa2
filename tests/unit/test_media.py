"""The per-item media allowance: a quantile of what the engine's usage showed, over a window, per model."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from gateway.tokens.media import MediaTokens


@given(st.lists(st.floats(-50, 5000, allow_nan=False), max_size=60), st.sampled_from([0.5, 0.9, 1.0]))
def test_the_allowance_is_the_quantile_of_the_recent_window(observed: list[float], quantile: float) -> None:
    media = MediaTokens(prior=777, window=16, min_samples=4, quantile=quantile)
    for value in observed:
        media.observe(("m", "image"), value)
    recent = sorted([v for v in observed if v >= 0][-16:])
    if len(recent) < 4:
        assert media.per_item(("m", "image")) == 777  # the prior, until there are enough
    else:
        assert media.per_item(("m", "image")) == math.ceil(recent[math.ceil(quantile * len(recent)) - 1])
    assert media.per_item(("m", "video")) == media.per_item(("other", "image")) == 777


def test_models_are_bounded_least_recently_observed_first() -> None:
    media = MediaTokens(prior=1, min_samples=1, max_keys=2)
    for model in ("a", "b", "a", "c"):
        media.observe((model, "image"), 100)
    assert [media.per_item((m, "image")) for m in ("a", "b", "c")] == [100, 1, 100]
