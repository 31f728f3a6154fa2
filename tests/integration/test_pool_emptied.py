"""A discovered pool that DNS empties (NXDOMAIN: a headless Service with no ready pod, a scale to zero): new and
queued requests hear so at once, with a 503 and Retry-After, instead of waiting out their budget or being told
the KV-cache size is not known yet. The gateway runs in this process (its DNS answers are the test's); the
engine is a real mini_vllm process."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from gateway.config import GatewayConfig
from gateway.server.app import Gateway


async def until(condition: Callable[[], bool]) -> None:
    """In-process state with no event to wait on: looked at every 10 ms (pytest's timeout bounds it)."""
    for _ in itertools.count():
        if condition():
            return
        await asyncio.sleep(0.01)


async def test_an_emptied_pool_answers_new_and_queued_requests_at_once(mini_vllm: Callable[..., str]) -> None:
    # 32 blocks of 16 tokens: one long request (25 blocks reserved) fills the engine past the watermark, and the
    # next one (13) queues
    engine = urlsplit(mini_vllm(num_blocks=32, block_size=16, token_delay_ms=20))
    answer: list[str] = [str(engine.hostname)]

    async def resolver(host: str, port: int) -> list[str]:
        if not answer:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(answer)

    discovery = {"dns": "vllm-engines.test", "port": engine.port, "interval_s": 3600}
    config = GatewayConfig.model_validate(
        {
            "tokenizer": "heuristic",
            "upstream": {"discovery": discovery},
            "listen": {"readiness": "gateway"},
            "admission": {"output_estimate": {"enabled": False}},
        }
    )
    gw = Gateway(config)
    gw.pool.resolver = resolver
    await gw.startup()
    transport = httpx.ASGITransport(app=gw)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate", timeout=120) as client:
            small = {"model": "mini", "prompt": "hello there", "max_tokens": 4}
            assert (await client.post("/v1/completions", json=small)).status_code == 200
            # in flight for 200 tokens x 20 ms
            long = asyncio.create_task(
                client.post("/v1/completions", json={"model": "mini", "prompt": "x " * 400, "max_tokens": 200})
            )
            await until(lambda: gw.controller.in_flight() > 0)
            queued = asyncio.create_task(
                client.post("/v1/completions", json={"model": "mini", "prompt": "y " * 200, "max_tokens": 100})
            )
            await until(lambda: len(gw.controller.queue) > 0)

            answer.clear()  # NXDOMAIN: every engine leaves the pool
            assert config.upstream.discovery is not None
            await gw.pool.discover_once(config.upstream.discovery)
            assert gw.pool.engines == {} and all(b.leaving for b in gw.controller.engines.values())

            for response in (await queued, await client.post("/v1/completions", json=small)):
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "upstream_unavailable"
            assert not long.done()  # answered while the leaving engine still serves what it holds
            assert (await long).status_code == 200
            await until(lambda: not gw.controller.engines)  # its books go once its last request has ended
            ready, reason = gw.is_ready()
            assert ready and "no engine in the pool" in reason  # readiness gateway: its 503s, not no endpoint
            after = await client.post("/v1/completions", json=small)
            assert after.status_code == 503 and after.json()["error"]["code"] == "upstream_unavailable"
    finally:
        await gw.shutdown()
