"""The saturation burst, for the e2e tests and runnable by hand.

The burst is the one in docs/vllm-cpu.md: 64 streamed completions at once, prompts of 500-1500 random token
ids, max_tokens 200-500 with ``ignore_eos`` (so every request generates exactly max_tokens). Against 256
blocks of 128 tokens it needs ~760 blocks of total demand and drives a bare engine into preemption.

Preemptions are read exactly (the engine's counter before and after); KV usage can only be sampled, so the
shared sampler (tests/support/sampler.py) polls the engine's /metrics on a fixed schedule (default 20 Hz)
and the result reports the rate it achieved.

By hand, from the repository root::

    python3 -m tests.e2e.vllm_cpu.burst --url http://127.0.0.1:8080 --engine http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from dataclasses import asdict, dataclass

import openai

from tests.support.promtext import metric_sum, scrape
from tests.support.sampler import Sampler

MODEL = "tiny-llama"
# Token ids 0-4 are the tiny tokenizer's special tokens; stay clear of them.
FIRST_PLAIN_ID, VOCAB_SIZE = 16, 4096
USAGE, RUNNING, WAITING = "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class BurstRequest:
    """``prompt`` as token ids (a completion) or text (a chat message). ``natural``: the output stops on its
    own (sampling with stop tokens kvgate cannot see) instead of running to ``max_tokens`` with ignore_eos."""

    prompt: list[int] | str
    max_tokens: int | None
    natural: bool = False


# Sampled at temperature 1, each generated token is one of these with probability ~K/vocab: output lengths
# are then roughly geometric, median ~300 tokens on the tiny model (measured: K=12 gave a median of 244, K=6
# of 405), and no request says how long it will be. (A per-request seed would pin them, but crashes the CPU
# engine's sampler: "CPU Generator does not use offset".)
NATURAL_STOP_IDS = random.Random(99).sample(range(FIRST_PLAIN_ID, VOCAB_SIZE), 10)
WORDS = [
    "cache",
    "block",
    "token",
    "engine",
    "queue",
    "stream",
    "admit",
    "gate",
    "ledger",
    "prompt",
    "model",
    "batch",
    "decode",
    "prefill",
    "memory",
]


def make_burst(
    n: int = 64,
    prompt_range: tuple[int, int] = (500, 1500),
    gen_range: tuple[int, int] = (200, 500),
    seed: int = 0,
    content_seed: int | None = None,
) -> list[BurstRequest]:
    """Lengths come from ``seed``; token contents from ``content_seed`` (default: ``seed``).

    Two bursts with the same ``seed`` and different ``content_seed`` have identical shapes but share no
    prefix, so the engine's prefix cache cannot make the second one cheaper than the first.
    """
    shapes = random.Random(seed)
    contents = random.Random(seed if content_seed is None else content_seed)
    burst = []
    for _ in range(n):
        plen = shapes.randint(*prompt_range)
        gen = shapes.randint(*gen_range)
        burst.append(BurstRequest([contents.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(plen)], gen))
    return burst


@dataclass
class BurstResult:
    n: int
    ok: int
    errors: list[str]
    wall_s: float
    preemptions: float
    max_kv_usage: float
    seconds_at_or_above_095: float
    max_running: float
    max_waiting: float
    sample_rate_hz: float
    samples: int
    ttft_p50_s: float
    ttft_max_s: float
    generated_tokens: int

    def summary(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "errors"} | {"errors": self.errors[:3]})


def make_natural_burst(
    n: int = 64, prompt_range: tuple[int, int] = (500, 1500), cap: int = 1536, seed: int = 0
) -> list[BurstRequest]:
    """Clients as they are: half chats with no max_tokens, half completions with a generous cap, every output
    stopping on its own long before either."""
    rng = random.Random(seed)
    burst = []
    for i in range(n):
        plen = rng.randint(*prompt_range)
        if i % 2:
            burst.append(BurstRequest([rng.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(plen)], cap, True))
        else:  # a chat message of about plen tokens
            burst.append(BurstRequest(" ".join(rng.choice(WORDS) for _ in range(plen // 2)), None, True))
    return burst


async def _one(client: openai.AsyncOpenAI, req: BurstRequest, t0: float) -> tuple[int, float]:
    """Stream one request; return (completion tokens per the engine's usage, time to first token)."""
    if req.natural:
        sampling: dict[str, object] = {"temperature": 1.0, "extra_body": {"stop_token_ids": NATURAL_STOP_IDS}}
    else:
        sampling = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    common = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **sampling}
    if isinstance(req.prompt, str):
        messages = [{"role": "user", "content": req.prompt}]
        stream = await client.chat.completions.create(messages=messages, **common)
    else:
        stream = await client.completions.create(prompt=req.prompt, max_tokens=req.max_tokens, **common)
    ttft = float("nan")
    completion_tokens = -1
    async for chunk in stream:
        if chunk.choices and ttft != ttft:
            ttft = time.monotonic() - t0
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    if completion_tokens < 0 or (not req.natural and completion_tokens != req.max_tokens):
        raise AssertionError(f"generated {completion_tokens} tokens, expected {req.max_tokens}")
    return completion_tokens, ttft


async def run_burst(base_url: str, engine_url: str, burst: list[BurstRequest], hz: float = 20.0) -> BurstResult:
    """Send ``burst`` all at once to ``base_url`` (the engine or kvgate) while sampling ``engine_url``."""
    (result,) = await run_burst_on_pool(base_url, [engine_url], burst, hz)
    return result


async def run_burst_on_pool(
    base_url: str, engine_urls: list[str], burst: list[BurstRequest], hz: float = 20.0
) -> list[BurstResult]:
    """Send ``burst`` all at once to ``base_url`` while sampling every engine of ``engine_urls``: one result
    per engine (its samples and preemptions; the requests, wall time and TTFTs are the burst's)."""
    befores = [await asyncio.to_thread(scrape, url) for url in engine_urls]
    sampler = Sampler([(url, (USAGE, RUNNING, WAITING)) for url in engine_urls], hz)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600.0)
    await asyncio.to_thread(sampler.start)
    try:
        await asyncio.sleep(0.3)  # the sampler's first scrapes, before the burst starts
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(client, r, t0) for r in burst), return_exceptions=True)
        wall = time.monotonic() - t0
        await asyncio.sleep(0.2)  # one more sample after the last stream closed
    finally:
        per_engine = await asyncio.to_thread(sampler.stop)
        await client.close()
    afters = [await asyncio.to_thread(scrape, url) for url in engine_urls]
    oks = [r for r in results if not isinstance(r, BaseException)]
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    ttfts = sorted(t for _, t in oks)
    out = []
    for readings, before, after in zip(per_engine, befores, afters, strict=True):
        # (t, usage, running, waiting) of every scrape that answered
        samples = [(t, v[USAGE], v[RUNNING], v[WAITING]) for t, v in readings if v is not None]
        span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
        period = [b[0] - a[0] for a, b in itertools.pairwise(samples) if a[1] >= 0.95]
        out.append(
            BurstResult(
                n=len(burst),
                ok=len(oks),
                errors=errors,
                wall_s=round(wall, 2),
                preemptions=metric_sum(after, PREEMPTIONS, default=0.0) - metric_sum(before, PREEMPTIONS, default=0.0),
                max_kv_usage=round(max((s[1] for s in samples), default=float("nan")), 4),
                seconds_at_or_above_095=round(sum(period), 2),
                max_running=max((s[2] for s in samples), default=float("nan")),
                max_waiting=max((s[3] for s in samples), default=float("nan")),
                sample_rate_hz=round((len(samples) - 1) / span if span else 0.0, 1),
                samples=len(samples),
                ttft_p50_s=round(ttfts[len(ttfts) // 2], 2) if ttfts else float("nan"),
                ttft_max_s=round(ttfts[-1], 2) if ttfts else float("nan"),
                generated_tokens=sum(n for n, _ in oks),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="where to send the burst (engine or kvgate)")
    parser.add_argument("--engine", required=True, help="the engine, for /metrics")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--content-seed", type=int, default=None)
    parser.add_argument("--hz", type=float, default=20.0)
    args = parser.parse_args()
    burst = make_burst(args.n, seed=args.seed, content_seed=args.content_seed)
    print(asyncio.run(run_burst(args.url, args.engine, burst, args.hz)).summary())


if __name__ == "__main__":
    main()
