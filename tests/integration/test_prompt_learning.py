"""The engine's own prompt counts (``usage.prompt_tokens``) teach the prompt-size estimate: once a route has
learned enough, every served prompt is scored against the estimate's band (the error histogram on /metrics),
and the fast path prices prompts far from the limits without asking the engine's /tokenize."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from tests.support.promtext import scrape


def test_served_prompts_teach_the_estimate(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    gw = gateway(mini_vllm(), {"tokenizer": "vllm"})  # exact counts from /tokenize, one round trip each

    async def send(n: int) -> list[int]:
        async with httpx.AsyncClient(base_url=gw, timeout=60) as client:
            replies = await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json={
                            "model": "mini",
                            "messages": [{"role": "user", "content": "word " * (20 + i)}],
                            "max_tokens": 1,
                        },
                    )
                    for i in range(n)
                )
            )
        return [r.status_code for r in replies]

    assert set(asyncio.run(send(200))) == {200}  # the estimate's minimum: it has learned from these
    before = scrape(gw)["kvgate_prompt_estimate_ratio_count"]
    assert set(asyncio.run(send(40))) == {200}
    m = scrape(gw)
    assert m["kvgate_prompt_estimate_ratio_count"] == before + 40  # each served prompt scored against its band
    assert m["kvgate_prompt_estimate_above_band_total"] == 0  # /tokenize and usage count alike
    assert m["kvgate_prompts_priced_total{by=tokenizer}"] == 200  # while learning: /tokenize
    assert m["kvgate_prompts_priced_total{by=estimate}"] == 40  # then far from every limit: no round trip
