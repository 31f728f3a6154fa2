"""The pricing report's harness (``loadtests/pricing.py``) on one scenario's plan, with a small byte-level BPE
trained here on the same corpus (the Llama 3 tokenizer the report uses is fetched by the benchmark, not CI)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.tokens.tokenizers import HFTokenizer
from loadtests import pricing
from loadtests.scenario import load
from tests.support.bpe import build_bpe_dir


def small_tokenizer(directory: Path) -> HFTokenizer:
    return HFTokenizer.load(str(build_bpe_dir(directory, pricing.corpus()[:3000], 2000, "{{ messages }}")))


def test_the_fast_path_prices_like_exact_counting_on_a_scenario_plan(tmp_path: Path) -> None:
    sc = load(pricing.ROOT / "scenarios" / "burst-8b-h100.yaml")
    tally, fast = asyncio.run(pricing.run(sc, small_tokenizer(tmp_path), requests=400, seed=3))
    assert tally.differed == []  # no request accepted by one and refused by the other
    assert fast.tally.by_tokenizer >= 200 and fast.tally.by_estimate == 400 - fast.tally.by_tokenizer > 150
    assert tally.prompt_exact <= tally.prompt_fast <= 1.1 * tally.prompt_exact  # the sum is covered
    assert len(tally.ratios) == fast.tally.by_estimate
    lines = pricing.section("burst-8b-h100", tally, fast)
    assert lines[0].startswith("| burst-8b-h100 | 400 | ")
