"""Which HTTP client should carry the gateway's upstream calls? Measured, not guessed (encode/httpx #3215).

One process, one fast local upstream, the same streamed and non-streamed requests through kvgate's own lean
client (``gateway.upstream.http_client``, which carries the inference hot path), aiohttp (which carries everything
else) and httpx (default transport), rounds interleaved. Reports this process's CPU ms per request for each
client, which is what the choice costs the gateway on every proxied request.

    python3 -m loadtests.bench_upstream_client [--requests 2000 --rounds 4 --concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import orjson

from gateway.upstream.http_client import Pool
from tests.support.procs import start_mini_vllm

Client = Callable[[str, bytes, bool], Awaitable[None]]


async def measure(call: Client, url: str, body: bytes, stream: bool, n: int, concurrency: int) -> float:
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            await call(url, body, stream)

    cpu0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - cpu0) / n * 1e3


async def main_async(args: argparse.Namespace) -> str:
    proc = start_mini_vllm(num_blocks=100000, token_delay_ms=0)
    upstream = proc.url
    url = upstream + "/v1/completions"
    headers = {"content-type": "application/json"}
    aio = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency), auto_decompress=False)
    hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency), timeout=30)
    pool = Pool(upstream, connect_timeout_s=5, max_connections=args.concurrency)
    raw_headers = [(b"content-type", b"application/json")]

    async def via_lean(url: str, body: bytes, stream: bool) -> None:
        async with await pool.request("POST", "/v1/completions", raw_headers, body, 30) as resp:
            async for _ in resp.chunks():
                pass

    async def via_aiohttp(url: str, body: bytes, stream: bool) -> None:
        async with aio.post(url, data=body, headers=headers) as resp:
            async for _ in resp.content.iter_any():
                pass

    async def via_httpx(url: str, body: bytes, stream: bool) -> None:
        async with hx.stream("POST", url, content=body, headers=headers) as resp:
            async for _ in resp.aiter_raw():
                pass

    clients = {"kvgate http_client": via_lean, "aiohttp": via_aiohttp, "httpx": via_httpx}
    lines = ["| mode | client | CPU ms/request (mean of rounds) | rounds |", "|---|---|---|---|"]
    try:
        for stream in (False, True):
            body = orjson.dumps({"model": "mini", "prompt": "Hello " * 20, "max_tokens": 16, "stream": stream})
            results: dict[str, list[float]] = {name: [] for name in clients}
            for call in clients.values():  # warm-up
                await measure(call, url, body, stream, args.concurrency * 4, args.concurrency)
            for r in range(args.rounds):
                names = list(clients) if r % 2 == 0 else list(reversed(clients))
                for name in names:
                    results[name].append(
                        await measure(clients[name], url, body, stream, args.requests, args.concurrency)
                    )
            for name, values in results.items():
                mode = "stream" if stream else "non-stream"
                lines.append(
                    f"| {mode} | {name} | {sum(values) / len(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |"
                )
                print(lines[-1], flush=True)
    finally:
        await aio.close()
        await hx.aclose()
        await pool.close()
        proc.stop()
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    table = asyncio.run(main_async(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
