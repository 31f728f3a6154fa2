"""The headline claim: a burst that lands between two scrapes never pushes the engine past the high watermark."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx
import pytest

from tests.support.promtext import assert_ledger_empty
from tests.support.rawhttp import burst

pytestmark = pytest.mark.e2e

NUM_BLOCKS, BLOCK = 400, 16
HIGH_BLOCKS = int(0.9 * NUM_BLOCKS)


def bodies(n: int, seed: int = 7) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        body: dict[str, object] = {"model": "mini", "max_tokens": rng.randint(20, 100), "stream": i % 2 == 0}
        if i % 3 == 0:
            body["messages"] = [{"role": "user", "content": "w" * rng.randint(100, 600)}]
        else:
            body["prompt"] = "w" * rng.randint(100, 600)
        out.append(body)
    return out


def fire(url: str, reqs: list[dict[str, object]]) -> tuple[list, float]:
    async def go() -> tuple[list, float]:
        chat = [b for b in reqs if "messages" in b]
        comp = [b for b in reqs if "prompt" in b]
        (r1, s1), (r2, s2) = await asyncio.gather(
            burst(url, "/v1/chat/completions", chat), burst(url, "/v1/completions", comp)
        )
        return r1 + r2, max(s1, s2)

    return asyncio.run(go())


def test_direct_burst_overruns_the_engine(mini_vllm: Callable[..., str]) -> None:
    """The control arm: the same burst sent straight to the engine blows far past the watermark."""
    upstream = mini_vllm(num_blocks=NUM_BLOCKS, block_size=BLOCK, token_delay_ms=2)
    responses, _ = fire(upstream, bodies(200))
    assert all(r.status == 200 for r in responses)
    assert httpx.get(upstream + "/debug/stats").json()["peak_blocks"] > 2 * HIGH_BLOCKS


@pytest.mark.parametrize("exclusive", [True, False], ids=["ledger-bound", "sample-only"])
def test_burst_of_200_within_50ms_with_1s_scrapes(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], exclusive: bool
) -> None:
    upstream = mini_vllm(num_blocks=NUM_BLOCKS, block_size=BLOCK, token_delay_ms=2)
    gw = gateway(
        upstream,
        {
            "tokenizer": "heuristic",
            "telemetry": {"scrape_interval_s": 1.0},
            "admission": {"exclusive_upstream": exclusive, "stale_after_s": 5.0},
        },
    )
    responses, spread = fire(gw, bodies(200))
    assert spread < 0.05, f"the burst took {spread * 1000:.1f} ms to send"
    for r in responses:
        assert r.status == 200 or (r.status in (429, 503) and "retry-after" in r.headers), (r.status, r.body[:300])
    assert sum(r.status == 200 for r in responses) == 200  # the default queue is deep enough to serve all

    stats = httpx.get(upstream + "/debug/stats").json()
    assert stats["peak_blocks"] <= HIGH_BLOCKS, stats  # actual usage, tracked by the engine at every token
    m = assert_ledger_empty(gw)
    # projected usage right after every admission stayed at or under the high watermark
    assert m["kvgate_admission_projected_usage_count"] == 200
    assert m["kvgate_admission_projected_usage_bucket{le=0.9}"] == 200
    assert m["kvgate_queue_wait_seconds_count"] == 200


def test_queue_full_is_429_and_queue_timeout_is_503(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    # Non-streaming requests of >= 1 s each: their progress is invisible, so they hold whole reservations
    # until they end, and the five queued ones can only time out.
    upstream = mini_vllm(num_blocks=NUM_BLOCKS, block_size=BLOCK, token_delay_ms=50)
    gw = gateway(upstream, {"tokenizer": "heuristic", "admission": {"queue_max_length": 5, "queue_max_wait_s": 0.2}})
    responses, _ = fire(gw, [{**b, "stream": False} for b in bodies(60)])
    statuses = [r.status for r in responses]
    assert statuses.count(429) > 0 and statuses.count(503) > 0 and statuses.count(200) > 0
    for r in responses:
        if r.status != 200:
            assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
            code = httpx.Response(r.status, content=r.body).json()["error"]["code"]
            assert code == ("queue_full" if r.status == 429 else "queue_timeout")
    m = assert_ledger_empty(gw)
    assert m["kvgate_requests_rejected_total{reason=queue_full}"] == statuses.count(429)
    assert m["kvgate_requests_rejected_total{reason=queue_timeout}"] == statuses.count(503)
