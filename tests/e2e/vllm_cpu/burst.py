"""The saturation burst and an engine /metrics sampler, shared by the e2e tests and runnable by hand.

The burst is the one in docs/vllm-cpu.md: 64 streamed completions at once, prompts of 500-1500 random token
ids, max_tokens 200-500 with ``ignore_eos`` (so every request generates exactly max_tokens). Against 256
blocks of 128 tokens it needs ~760 blocks of total demand and drives a bare engine into preemption.

Preemptions are read exactly (the engine's counter before and after); KV usage can only be sampled, so the
sampler polls the engine's /metrics on a fixed schedule (default 20 Hz) and reports the rate it achieved.

By hand::

    python3 tests/e2e/vllm_cpu/burst.py --url http://127.0.0.1:8080 --engine http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai

MODEL = "tiny-llama"
# Token ids 0-4 are the tiny tokenizer's special tokens; stay clear of them.
FIRST_PLAIN_ID, VOCAB_SIZE = 16, 4096
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$", re.MULTILINE)


@dataclass(frozen=True)
class BurstRequest:
    prompt: list[int]
    max_tokens: int


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


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each ``vllm:`` series over its labels (one engine, one model here)."""
    values: dict[str, float] = {}
    for match in _SAMPLE.finditer(text):
        name = match.group(1)
        values[name] = values.get(name, 0.0) + float(match.group(3))
    return values


def metrics_now(engine_url: str) -> dict[str, float]:
    """One synchronous scrape of the engine's ``vllm:`` series."""
    response = httpx.get(f"{engine_url}/metrics", timeout=10.0)
    response.raise_for_status()
    return parse_metrics(response.text)


async def fetch_metrics(client: httpx.AsyncClient, engine_url: str) -> dict[str, float]:
    response = await client.get(f"{engine_url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


class Sampler:
    """Polls the engine's /metrics at ``hz`` until stopped; keeps (t, usage, running, waiting) samples.

    It runs in a child process of its own: in the client's event loop (or even a thread of the client) it is
    starved by the 64 streams being parsed (measured: 2.5-6.5 Hz in the loop, ~12 Hz in a thread on a busy
    machine, instead of 20), while /metrics itself answers in ~10 ms.
    """

    def __init__(self, engine_url: str, hz: float = 20.0) -> None:
        self.engine_url = engine_url
        self.hz = hz
        self.samples: list[tuple[float, float, float, float]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: Path | None = None

    def start(self) -> None:
        fd, name = tempfile.mkstemp(prefix="kvgate-sampler-", suffix=".tsv")
        os.close(fd)
        self._out = Path(name)
        argv = [sys.executable, __file__, "--sample-to", name, "--engine", self.engine_url, "--hz", str(self.hz)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)

    async def stop(self) -> None:
        assert self._proc is not None and self._out is not None
        self._proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(self._proc.wait, 10)
        for line in self._out.read_text().splitlines():
            t, usage, running, waiting = (float(x) for x in line.split("\t"))
            self.samples.append((t, usage, running, waiting))
        self._out.unlink()

    @property
    def rate_hz(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return (len(self.samples) - 1) / (self.samples[-1][0] - self.samples[0][0])

    @property
    def max_usage(self) -> float:
        return max((s[1] for s in self.samples), default=float("nan"))


def _sample_forever(engine_url: str, hz: float, out: Path) -> None:
    """The sampler child: one line per scrape, flushed, until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    period = 1.0 / hz
    t0 = time.monotonic()
    next_at = t0
    with httpx.Client(timeout=5.0) as client, out.open("w") as sink:
        while not stop.is_set():
            try:
                response = client.get(f"{engine_url}/metrics")
                response.raise_for_status()
                m = parse_metrics(response.text)
                sink.write(
                    f"{time.monotonic() - t0:.4f}\t{m.get('vllm:kv_cache_usage_perc', float('nan'))}\t"
                    f"{m.get('vllm:num_requests_running', float('nan'))}\t"
                    f"{m.get('vllm:num_requests_waiting', float('nan'))}\n"
                )
                sink.flush()
            except httpx.HTTPError:
                pass
            next_at += period
            stop.wait(max(0.0, next_at - time.monotonic()))


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


async def _one(client: openai.AsyncOpenAI, req: BurstRequest, t0: float) -> tuple[int, float]:
    """Stream one completion; return (completion tokens per the engine's usage, time to first token)."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=req.prompt,
        max_tokens=req.max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    ttft = float("nan")
    completion_tokens = -1
    async for chunk in stream:
        if chunk.choices and ttft != ttft:
            ttft = time.monotonic() - t0
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    if completion_tokens != req.max_tokens:
        raise AssertionError(f"generated {completion_tokens} tokens, expected {req.max_tokens}")
    return completion_tokens, ttft


async def run_burst(base_url: str, engine_url: str, burst: list[BurstRequest], hz: float = 20.0) -> BurstResult:
    """Send ``burst`` all at once to ``base_url`` (the engine or kvgate) while sampling ``engine_url``."""
    async with httpx.AsyncClient(timeout=5.0) as probe:
        before = await fetch_metrics(probe, engine_url)
    sampler = Sampler(engine_url, hz)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600.0)
    sampler.start()
    try:
        await asyncio.sleep(0.3)  # the sampler's first scrape, before the burst starts
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(client, r, t0) for r in burst), return_exceptions=True)
        wall = time.monotonic() - t0
        await asyncio.sleep(0.2)  # one more sample after the last stream closed
    finally:
        await sampler.stop()
        await client.close()
    async with httpx.AsyncClient(timeout=5.0) as probe:
        after = await fetch_metrics(probe, engine_url)

    oks = [r for r in results if not isinstance(r, BaseException)]
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    ttfts = sorted(t for _, t in oks)
    period = [b[0] - a[0] for a, b in zip(sampler.samples, sampler.samples[1:], strict=False) if a[1] >= 0.95]
    return BurstResult(
        n=len(burst),
        ok=len(oks),
        errors=errors,
        wall_s=round(wall, 2),
        preemptions=after.get("vllm:num_preemptions_total", 0.0) - before.get("vllm:num_preemptions_total", 0.0),
        max_kv_usage=round(sampler.max_usage, 4),
        seconds_at_or_above_095=round(sum(period), 2),
        max_running=max((s[2] for s in sampler.samples), default=float("nan")),
        max_waiting=max((s[3] for s in sampler.samples), default=float("nan")),
        sample_rate_hz=round(sampler.rate_hz, 1),
        samples=len(sampler.samples),
        ttft_p50_s=round(ttfts[len(ttfts) // 2], 2) if ttfts else float("nan"),
        ttft_max_s=round(ttfts[-1], 2) if ttfts else float("nan"),
        generated_tokens=sum(n for n, _ in oks),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="where to send the burst (engine or kvgate)")
    parser.add_argument("--engine", required=True, help="the engine, for /metrics")
    parser.add_argument("--sample-to", help=argparse.SUPPRESS)  # the sampler child
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--content-seed", type=int, default=None)
    parser.add_argument("--hz", type=float, default=20.0)
    args = parser.parse_args()
    if args.sample_to:
        _sample_forever(args.engine, args.hz, Path(args.sample_to))
        return
    if not args.url:
        parser.error("--url is required")
    burst = make_burst(args.n, seed=args.seed, content_seed=args.content_seed)
    print(asyncio.run(run_burst(args.url, args.engine, burst, args.hz)).summary())


if __name__ == "__main__":
    main()
