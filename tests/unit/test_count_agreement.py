"""Does the local tokenizer count as the engine does? A tokenizer of another model loads without complaint; the
engine's usage.prompt_tokens says otherwise, and kvgate must notice and say so."""

from __future__ import annotations

import logging
import random

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.bodies import parse_body
from gateway.protocol.requests import parse_request
from gateway.tokens.agreement import CountAgreement
from gateway.tokens.cost import KvGeometry, RequestCost
from gateway.tokens.counting import TokenCounter
from gateway.tokens.estimator import CostEstimator
from gateway.tokens.tokenizers import HeuristicTokenizer


def test_a_template_framing_apart_agrees_and_another_vocabulary_does_not() -> None:
    agreement = CountAgreement(window=32)
    rng = random.Random(3)
    for _ in range(200):  # the engine's chat template adds a few tokens, or a BOS: the same tokenizer
        ours = rng.randint(5, 3000)
        assert not agreement.observe(ours, ours + rng.randint(0, 12)) and not agreement.disagrees
    changes = [agreement.observe(n, 2 * n) for n in rng.choices(range(100, 3000), k=32)]  # twice the tokens
    assert changes.count(True) == 1 and agreement.disagrees
    assert agreement.median_ratio() == pytest.approx(2.0)
    for _ in range(32):
        agreement.observe(500, 505)
    assert not agreement.disagrees  # the tokenizer was swapped for the right one


def test_too_few_comparisons_say_nothing() -> None:
    agreement = CountAgreement(window=32)
    for _ in range(15):
        agreement.observe(100, 300)
    assert not agreement.disagrees and agreement.observe(100, 300) and agreement.disagrees  # the 16th: half a window


@given(st.lists(st.tuples(st.integers(1, 10_000), st.integers(1, 10_000)), max_size=200))
def test_it_says_disagrees_exactly_when_most_of_the_last_window_is_apart(pairs: list[tuple[int, int]]) -> None:
    window = 16
    agreement = CountAgreement(window=window)
    for ours, engine in pairs:
        before = agreement.disagrees
        changed = agreement.observe(ours, engine)
        assert changed == (before != agreement.disagrees)
    recent = pairs[-window:]
    apart = [abs(e - o) > max(16, 0.1 * e) for o, e in recent]
    assert agreement.disagrees == (len(recent) * 2 >= window and sum(apart) * 2 > len(recent))


async def test_the_estimator_warns_when_its_counts_are_not_the_engines(caplog: pytest.LogCaptureFixture) -> None:
    counter = TokenCounter(HeuristicTokenizer(4.0))
    counter.kind, counter.name = "hf", "hf:/models/another-model"  # counted "exactly", by the wrong vocabulary
    costs = CostEstimator(counter, geometry=lambda: KvGeometry(16, 1000), max_model_len=lambda: 8192)
    request = parse_request("completions", orjson.dumps({"model": "m", "prompt": "word " * 400}))
    with caplog.at_level(logging.WARNING, logger="kvgate.tokens"):
        for _ in range(16):
            cost = await costs.estimate(request, exact=True)
            assert cost.prompt_high is None  # counted
            costs.learn(request, cost, 2 * cost.prompt_tokens[0])
    assert costs.agreement.disagrees
    assert "does not count prompts as the engine does" in caplog.text and "2.00x" in caplog.text
    ids = parse_request("completions", orjson.dumps({"model": "m", "prompt": list(range(50))}))
    fresh = CostEstimator(counter, geometry=lambda: KvGeometry(16, 1000), max_model_len=lambda: 8192)
    for _ in range(32):  # token ids are the engine's own count: nothing to compare
        fresh.learn(ids, RequestCost((50,), 1, 16, 5), 100)
    assert len(fresh.agreement) == 0


async def test_a_responses_turn_with_a_stored_history_teaches_nothing() -> None:
    """vLLM puts a previous_response_id's stored history before the input: the engine's count is the whole
    conversation, kvgate's the new turn. Compared, a right tokenizer read as 38x off; learned, tokens per byte
    would be too."""
    counter = TokenCounter(HeuristicTokenizer(4.0))
    counter.kind, counter.name = "hf", "hf:/models/the-right-one"
    costs = CostEstimator(counter, geometry=lambda: KvGeometry(16, 1000), max_model_len=lambda: 8192)
    body = {"model": "m", "input": "and then? " * 20, "previous_response_id": "resp_123"}
    chained = parse_body("responses", orjson.dumps(body))
    assert chained.history_elsewhere
    for _ in range(32):
        cost = await costs.estimate(chained, exact=True)
        costs.learn(chained, cost, 40 * cost.prompt_tokens[0])
    assert len(costs.agreement) == 0 and not costs.agreement.disagrees
    assert costs.lengths.samples(("m", "chat")) == 0
    del body["previous_response_id"]
    assert not parse_body("responses", orjson.dumps(body)).history_elsewhere
