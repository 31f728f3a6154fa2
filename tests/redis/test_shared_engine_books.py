"""Two gateway replicas in front of one engine (and of a pool of two), one real Redis: a burst split between them
lands between two scrapes, and neither replica's metrics show the other's admissions yet. With the shared engine
books each admission claims its blocks in Redis first, so together they stay under the high watermark on every
engine; without them each fills the engine on its own (the control arm)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from tests.integration.test_burst import BLOCK, HIGH_BLOCKS, NUM_BLOCKS, bodies
from tests.redis.conftest import RedisServer
from tests.support.promtext import assert_ledger_empty, metric_sum, scrape
from tests.support.rawhttp import burst

pytestmark = [pytest.mark.redis, pytest.mark.e2e]


def config(redis_url: str, share: bool, exclusive: bool = False) -> dict[str, object]:
    """``exclusive``: the replicas, together, are the engine's only client (their claims and ledgers bound it);
    else the sample is the truth, plus what is claimed."""
    return {
        "tokenizer": "heuristic",
        "telemetry": {"scrape_interval_s": 1.0},
        "admission": {"exclusive_upstream": exclusive, "stale_after_s": 5.0},
        "redis": {"url": redis_url, "replicas": 2, "timeout_s": 0.5, "share_engine_reservations": share},
    }


def fire_split(replicas: list[str], reqs: list[dict[str, object]]) -> list[int]:
    """The completions of ``reqs`` at once, alternating between the replicas; their statuses."""

    async def go() -> list[int]:
        halves = [[b for i, b in enumerate(reqs) if i % 2 == j and "prompt" in b] for j in range(2)]
        results = await asyncio.gather(
            *(burst(url, "/v1/completions", half) for url, half in zip(replicas, halves, strict=True))
        )
        return [r.status for responses, _ in results for r in responses]

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("share", "exclusive"),
    [(False, False), (True, False), (True, True)],
    ids=["each-replica-alone", "shared-books", "shared-books-only-clients"],
)
def test_two_replicas_bursting_into_one_engine_between_two_scrapes(
    redis_server: RedisServer, mini_vllm: Callable[..., str], gateway: Callable[..., str], share: bool, exclusive: bool
) -> None:
    upstream = mini_vllm(num_blocks=NUM_BLOCKS, block_size=BLOCK, token_delay_ms=2)
    replicas = [gateway(upstream, config(redis_server.url, share, exclusive)) for _ in range(2)]
    statuses = fire_split(replicas, bodies(240))
    assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    peak = httpx.get(upstream + "/debug/stats").json()["peak_blocks"]
    if share:
        assert peak <= HIGH_BLOCKS, peak  # actual usage, tracked by the engine at every token
        claims = sum(
            metric_sum(scrape(url), "kvgate_reservations_released_total", outcome="claim_refused", default=0)
            for url in replicas
        )
        print(
            f"\n[shared books, exclusive {exclusive}] peak {peak} of {NUM_BLOCKS} blocks (cap {HIGH_BLOCKS});"
            f" {claims:.0f} claims refused"
        )
    else:
        assert peak > HIGH_BLOCKS, peak  # the premise: alone, each replica fills the engine on its own account
    # a claim refused and placed again is one placement: one per request served, over both replicas
    placements = sum(metric_sum(scrape(url), "kvgate_engine_placements_total", default=0) for url in replicas)
    assert placements == len(statuses)
    for url in replicas:
        assert_ledger_empty(url)


@pytest.mark.parametrize("share", [False, True], ids=["each-replica-alone", "shared-books"])
def test_two_replicas_bursting_into_a_pool_of_two_engines(
    redis_server: RedisServer, mini_vllm: Callable[..., str], gateway: Callable[..., str], share: bool
) -> None:
    """The issue's check: two replicas, each placing into the same two engines, claim per engine: a burst twice
    the one-engine burst leaves every engine at or under the high watermark, and both engines take work."""
    engines = [mini_vllm(num_blocks=NUM_BLOCKS, block_size=BLOCK, token_delay_ms=2) for _ in range(2)]
    replicas = [
        gateway(engines[0], config(redis_server.url, share), extra_args=["--upstream", engines[1]]) for _ in range(2)
    ]
    statuses = fire_split(replicas, bodies(480, seed=11))
    assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    stats = [httpx.get(url + "/debug/stats").json() for url in engines]
    peaks = [s["peak_blocks"] for s in stats]
    assert all(s["completed"] > 0 for s in stats), [s["completed"] for s in stats]  # both engines took work
    if share:
        print(f"\n[shared books, pool of two] peaks {peaks} of {NUM_BLOCKS} blocks each (cap {HIGH_BLOCKS})")
        assert all(peak <= HIGH_BLOCKS for peak in peaks), peaks  # actual usage, tracked by each engine at every token
    else:
        assert max(peaks) > HIGH_BLOCKS, peaks  # the premise: alone, each replica fills the engines on its own account
    for url in replicas:
        assert_ledger_empty(url)
