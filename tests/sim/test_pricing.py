"""The pricing report's harness (``loadtests/pricing.py``) on one scenario's plan, with a small byte-level BPE
trained here on the same corpus (the Llama 3 tokenizer the report uses is fetched by the benchmark, not CI)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gateway.tokens.tokenizers import HFTokenizer
from loadtests import pricing
from loadtests.scenario import load


def small_tokenizer(directory: Path) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pricing.corpus()[:3000], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return HFTokenizer.load(str(directory))


def test_the_fast_path_prices_like_exact_counting_on_a_scenario_plan(tmp_path: Path) -> None:
    sc = load(pricing.ROOT / "scenarios" / "burst-8b-h100.yaml")
    tally, fast = asyncio.run(pricing.run(sc, small_tokenizer(tmp_path), requests=400, seed=3))
    assert tally.differed == []  # no request accepted by one and refused by the other
    assert fast.tally.by_tokenizer >= 200 and fast.tally.by_estimate == 400 - fast.tally.by_tokenizer > 150
    assert tally.prompt_exact <= tally.prompt_fast <= 1.1 * tally.prompt_exact  # the sum is covered
    assert len(tally.ratios) == fast.tally.by_estimate
    lines = pricing.section("burst-8b-h100", tally, fast)
    assert lines[0].startswith("| burst-8b-h100 | 400 | ")
