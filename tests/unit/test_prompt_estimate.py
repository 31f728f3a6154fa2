"""PromptLengths: the token band of a text prompt, learned from the engine's counts; and what is measured."""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.bodies import parse_body
from gateway.protocol.requests import InferenceRequest, parse_request
from gateway.tokens.prompt_estimate import (
    CHAT_OVERHEAD_BYTES,
    PROMPT_OVERHEAD_BYTES,
    RESERVE_REFRESH,
    EstimateErrors,
    Prior,
    PromptLengths,
    TokenBand,
    key_of,
    prompt_sizes,
)

KEY = ("m", "chat")


def chat(messages: list[dict[str, Any]], **extra: Any) -> InferenceRequest:
    return parse_request("chat", orjson.dumps({"messages": messages, **extra}))


def completion(prompt: object) -> InferenceRequest:
    return parse_request("completions", orjson.dumps({"prompt": prompt, "model": "m"}))


# --- what is measured ----------------------------------------------------------------------------------


def test_a_prompt_is_measured_in_utf8_bytes() -> None:
    assert prompt_sizes(completion("hello")) == (5 + PROMPT_OVERHEAD_BYTES,)
    assert prompt_sizes(completion("héllo 日本")) == (len("héllo 日本".encode()) + PROMPT_OVERHEAD_BYTES,)
    assert prompt_sizes(completion(["ab", "cde"])) == (2 + PROMPT_OVERHEAD_BYTES, 3 + PROMPT_OVERHEAD_BYTES)
    assert key_of(completion("x")) == ("m", "completions")


def test_token_ids_are_not_estimated() -> None:
    assert prompt_sizes(completion([1, 2, 3])) is None
    assert prompt_sizes(completion([[1], [2, 3]])) is None
    assert prompt_sizes(parse_body("audio", b"")) is None


def test_a_chat_is_measured_as_its_json_with_the_tools() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ça va?", "name": "bob"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "does things"}}]
    expected = len(orjson.dumps(messages)) + CHAT_OVERHEAD_BYTES
    assert prompt_sizes(chat(messages)) == (expected,)
    shown = [{"type": "function", "function": {"name": "f", "description": "does things", "parameters": None}}]
    assert prompt_sizes(chat(messages, tools=tools)) == (expected + len(orjson.dumps(shown)),)  # as vLLM shows them
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]
    assert prompt_sizes(chat(parts)) == (len(orjson.dumps(parts)) + CHAT_OVERHEAD_BYTES,)


def test_a_chat_with_an_image_is_not_estimated() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert prompt_sizes(chat([{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])) is None


# --- the band ------------------------------------------------------------------------------------------


def test_the_prior_answers_until_min_samples() -> None:
    lengths = PromptLengths(min_samples=3, prior=Prior(ratio=0.25, low=0.1, high=1.0))
    assert lengths.band(KEY, 1000) == TokenBand(100, 250, 1000, 0)
    assert not lengths.learned(KEY) and lengths.miss_rate(KEY) is None
    for _ in range(2):
        lengths.observe(KEY, 1000, 500)
    assert lengths.band(KEY, 1000).high == 1000  # still the prior
    lengths.observe(KEY, 1000, 500)
    assert lengths.learned(KEY) and lengths.band(KEY, 1000).estimate == 500 and lengths.band(KEY, 1000).samples == 3


def test_a_prompt_reserves_the_quantile_of_the_learned_ratios() -> None:
    lengths = PromptLengths(min_samples=10, prior=Prior(ratio=0.25, low=0.1, high=1.0))
    assert lengths.reserved(KEY, 1000, 0.7) == 250  # the prior's typical ratio while learning
    for tokens in range(201, 301):  # ratios 0.201 .. 0.300
        lengths.observe(KEY, 1000, tokens)
    assert lengths.reserved(KEY, 1000, 0.5) == lengths.band(KEY, 1000).estimate == 251
    assert lengths.reserved(KEY, 1000, 0.7) == 271
    assert lengths.reserved(KEY, 1000, 1.0) == 300  # the largest seen, no further
    assert lengths.reserved(KEY, 1000, 0.7) < lengths.band(KEY, 1000).high


def test_long_dense_prompts_among_short_ones_are_still_covered_in_sum() -> None:
    """85% short chat turns at ~0.26 tokens per byte, 15% long documents at ~0.42 (code, CJK): the 0.7 quantile
    of the ratios alone is a short turn's, and reserving it for everything falls ~25% short of what the pool
    fills with. Weighted by bytes, the reserve covers the total, on the mix and on a burst of documents."""
    rng = random.Random(4)

    def prompt() -> tuple[int, int]:
        if rng.random() < 0.85:
            size = rng.randint(300, 2000)
            return size, round(size * rng.uniform(0.24, 0.28))
        size = rng.randint(8000, 20000)
        return size, round(size * rng.uniform(0.40, 0.44))

    lengths = PromptLengths()
    for _ in range(2048):
        lengths.observe(KEY, *prompt())
    by_count = lengths._keys[KEY].sorted[int(0.7 * 2048)]  # the 0.7 quantile of the ratios, by count
    mix = [prompt() for _ in range(64)]
    documents = [(size, tokens) for size, tokens in (prompt() for _ in range(2000)) if size >= 8000][:16]
    for sample in (mix, documents):
        true = sum(tokens for _, tokens in sample)
        assert sum(lengths.reserved(KEY, size, 0.7) for size, _ in sample) >= true
        assert sum(math.ceil(by_count * size) for size, _ in sample) < 0.9 * true  # what the count quantile gives


def test_nonsense_teaches_nothing() -> None:
    lengths = PromptLengths(min_samples=1)
    lengths.observe(KEY, 0, 10)
    lengths.observe(KEY, 10, 0)
    lengths.observe(KEY, -5, 10)
    assert lengths.samples(KEY) == 0 and len(lengths) == 0


def test_the_band_is_never_narrower_than_the_floor() -> None:
    lengths = PromptLengths(min_samples=10, margin=0.0, min_spread=0.1)
    for _ in range(50):
        lengths.observe(KEY, 1000, 300)  # every prompt alike: the quantiles alone would say [300, 300]
    assert lengths.band(KEY, 1000) == TokenBand(270, 300, 330, 50)


def test_the_miss_rate_is_what_the_window_can_promise() -> None:
    lengths = PromptLengths(window=5000, min_samples=10, miss_rate=0.001)
    for n in range(1, 3000):
        lengths.observe(KEY, 100, 25)
        if n == 99:
            assert lengths.miss_rate(KEY) == pytest.approx(1 / 100)  # the largest of 99: 1 in 100
    assert lengths.miss_rate(KEY) is not None and lengths.miss_rate(KEY) <= 0.001  # type: ignore[operator]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_samples": 0},
        {"window": 10, "min_samples": 11},
        {"max_keys": 0},
        {"miss_rate": 0.0},
        {"miss_rate": 0.5},
        {"margin": -0.1},
        {"prior": Prior(ratio=0.3, low=0.4, high=1.0)},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PromptLengths(**kwargs)


def draw(rng: random.Random, median: float, sigma: float) -> tuple[int, int]:
    """A prompt's (size, tokens): tokens per byte log-normal around ``median``."""
    size = rng.randint(50, 20000)
    return size, max(1, round(median * math.exp(rng.gauss(0, sigma)) * size))


@settings(max_examples=25, deadline=None)
@given(st.floats(0.1, 0.8), st.floats(0.01, 0.5), st.integers(0, 2**32))
def test_the_band_holds_the_truth_at_the_advertised_rate(median: float, sigma: float, seed: int) -> None:
    """Without margin or floor (the quantiles alone), fresh prompts from the learned traffic fall outside the
    band at the advertised rate (1% a side here, 1,000 learned): at most 3% in 4,000, whatever the distribution."""
    rng = random.Random(seed)
    lengths = PromptLengths(window=1000, min_samples=100, miss_rate=0.01, margin=0.0, min_spread=0.0)
    seen = []
    for _ in range(1000):
        size, tokens = draw(rng, median, sigma)
        lengths.observe(KEY, size, tokens)
        seen.append(tokens / size)
    assert lengths.miss_rate(KEY) == pytest.approx(10 / 1001)
    above = below = 0
    for _ in range(4000):
        size, tokens = draw(rng, median, sigma)
        band = lengths.band(KEY, size)
        above += tokens > band.high
        below += tokens < band.low
    assert above <= 120 and below <= 120
    # ... and it is not loose: the high end is a high quantile of what was seen, not past the largest
    seen.sort()
    _, typical, high = lengths.ratios(KEY)
    assert seen[980] <= high <= seen[-1] and typical == seen[500]


def test_the_defaults_leave_no_miss_on_steady_traffic() -> None:
    rng = random.Random(7)
    lengths = PromptLengths()
    for _ in range(2048):
        lengths.observe(KEY, *draw(rng, 0.27, 0.15))
    misses = sum(
        tokens > lengths.band(KEY, size).high for size, tokens in (draw(rng, 0.27, 0.15) for _ in range(20000))
    )
    assert misses <= 10  # 0.05%: the 0.1% bound, tightened by the 5% margin


@settings(max_examples=20, deadline=None)
@given(st.floats(0.1, 0.3), st.floats(2.0, 3.0), st.booleans(), st.integers(0, 2**32))
def test_it_follows_a_shift_within_one_window(low: float, factor: float, upward: bool, seed: int) -> None:
    """After ``window`` prompts of the new traffic nothing of the old is left: the band is the one a learner
    that saw only the new traffic would give, and it has let go of the old tail."""
    rng = random.Random(seed)
    before, after = (low, low * factor) if upward else (low * factor, low)
    shifted, fresh = PromptLengths(window=300, min_samples=50), PromptLengths(window=300, min_samples=50)
    for _ in range(500):
        shifted.observe(KEY, *draw(rng, before, 0.05))
    for _ in range(300):
        size, tokens = draw(rng, after, 0.05)
        shifted.observe(KEY, size, tokens)
        fresh.observe(KEY, size, tokens)
    assert shifted.ratios(KEY) == fresh.ratios(KEY)
    new_low, _, new_high = shifted.ratios(KEY)
    assert new_high < before * 0.85 if not upward else new_low > before * 1.15


ops = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 5000), st.integers(1, 5000)), min_size=20, max_size=300)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_memory_is_bounded_in_keys_and_samples(observations: list[tuple[int, int, int]]) -> None:
    """Against a model: the last ``window`` ratios of the ``max_keys`` most recently observed keys."""
    lengths = PromptLengths(window=3, min_samples=1, max_keys=4)
    model: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
    for k, size, tokens in observations:
        key = (f"m{k}", "chat")
        lengths.observe(key, size, tokens)
        model.setdefault(key, deque(maxlen=3)).append(tokens / size)
        model.move_to_end(key)
        if len(model) > 4:
            model.popitem(last=False)
        assert len(lengths) == len(model) <= 4
    for k in range(6):
        key = (f"m{k}", "chat")
        assert lengths.samples(key) == len(model.get(key, ()))
        if key in model:
            ranked = sorted(model[key])
            assert lengths.ratios(key)[1] == ranked[len(ranked) // 2]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from((1, 2, 3, 5)), st.sampled_from((10, 20, 40, 400))), min_size=1, max_size=80),
    st.floats(0.01, 1.0),
)
def test_the_byte_weighted_reserve_is_the_ratio_where_the_windows_bytes_reach_the_quantile(
    observations: list[tuple[int, int]], quantile: float
) -> None:
    """Against a model (the window's (ratio, bytes) pairs sorted, summed until ``quantile`` of the bytes), with
    many equal ratios of other sizes coming and going: each ratio keeps its own prompt's bytes."""
    lengths = PromptLengths(window=7, min_samples=1)
    model: deque[tuple[float, int]] = deque(maxlen=7)
    for tokens, size in observations:
        lengths.observe(KEY, size, tokens * size // 10)
        model.append((tokens * size // 10 / size, size))
        window = lengths._keys[KEY]
        window.added_since_reserve = RESERVE_REFRESH  # recompute now, not on its schedule
        pairs = sorted(model)
        total, running = sum(size for _, size in pairs), 0
        expected = next(r for r, size in pairs if (running := running + size) >= quantile * total)
        assert window.byte_weighted(quantile) == expected
        assert window.sorted == [r for r, _ in pairs]
        assert sorted(zip(window.sorted, window.sorted_bytes, strict=True)) == pairs  # each ratio with its bytes


# --- the estimate's error, for export ------------------------------------------------------------------


def test_errors_fall_in_fixed_buckets_and_count_misses() -> None:
    errors = EstimateErrors()
    band = TokenBand(low=80, estimate=100, high=120, samples=500)
    for tokens in (40, 100, 101, 119, 121, 500):
        errors.record(tokens, band)
    assert errors.count == 6 and errors.above_high == 2
    assert errors.total == pytest.approx((40 + 100 + 101 + 119 + 121 + 500) / 100)
    cumulative = dict(errors.cumulative())
    assert cumulative[0.5] == 1 and cumulative[1.0] == 2 and cumulative[1.05] == 3
    assert cumulative[1.25] == 5 and cumulative[2.0] == 5 and cumulative[math.inf] == 6


def test_a_chats_documents_and_template_kwargs_are_part_of_its_measure() -> None:
    """Priced without the tokenizer, a chat whose documents the template renders must not look short."""
    messages = [{"role": "user", "content": "hi"}]
    plain = parse_request("chat", orjson.dumps({"messages": messages}))
    docs = [{"text": "d" * 5000}]
    rag = parse_request("chat", orjson.dumps({"messages": messages, "documents": docs}))
    kwargs = parse_request("chat", orjson.dumps({"messages": messages, "chat_template_kwargs": {"ctx": "c" * 5000}}))
    (base,), (with_docs,), (with_kwargs,) = (prompt_sizes(r) for r in (plain, rag, kwargs))  # type: ignore[misc]
    assert with_docs >= base + 5000 and with_kwargs >= base + 5000
