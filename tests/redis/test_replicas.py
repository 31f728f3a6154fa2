"""Two real gateway processes sharing one real Redis: one global limit; Redis killed and restarted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.redis.conftest import RedisServer
from tests.support.promtext import assert_ledger_empty, scrape
from tests.support.tenant_http import Reply, completion, post

pytestmark = [pytest.mark.redis, pytest.mark.e2e]

KEY = "sk-team"


def policy(redis_url: str, **tenant: object) -> dict[str, object]:
    return {
        "tokenizer": "heuristic",
        # 0.5 s, not the 50 ms default: these tests run 4 processes on 2 shared cores, and a late reply makes a
        # request fall back to the local share (fail-open), which is a different test (below).
        "redis": {"url": redis_url, "replicas": 2, "reconnect_interval_s": 0.2, "timeout_s": 0.5},
        "auth": {"require_api_key": True},
        "tenants": [{"name": "team", "api_keys": [KEY], **tenant}],
    }


def fire(urls: list[str], n: int, max_tokens: int = 1) -> list[Reply]:
    """n requests at once, alternating between the replicas."""

    async def go() -> list[Reply]:
        return await asyncio.gather(*(post(urls[i % len(urls)], completion(64, max_tokens), KEY) for i in range(n)))

    return asyncio.run(go())


def test_requests_per_minute_hold_across_two_replicas(
    redis_server: RedisServer, mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm()
    cfg = policy(redis_server.url, requests_per_minute=20)
    replicas = [gateway(upstream, cfg), gateway(upstream, cfg)]
    responses = fire(replicas, 60)
    ok = [r for r in responses if r.status == 200]
    limited = [r for r in responses if r.status == 429]
    assert len(ok) + len(limited) == 60, sorted(r.status for r in responses)
    assert sum(scrape(url).get("kvgate_redis_errors_total", 0) for url in replicas) == 0
    # 20 per minute in total, not 20 per replica (a bucket refills 1 per 3 s: at most one more while we send)
    assert 20 <= len(ok) <= 21, len(ok)
    # Both replicas turned requests away: each saw the shared count (which replica got the 20 is up to the
    # scheduler; with per-replica buckets each would have served 20 and none of its first 20 would be a 429).
    limited_by = {
        url: sum(1 for i, r in enumerate(responses) if r.status == 429 and i % 2 == j) for j, url in enumerate(replicas)
    }
    assert all(v > 0 for v in limited_by.values()), limited_by
    r = limited[0]
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-limit-requests"] == "20"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    print(f"\n[replicas] rpm=20 over 2 replicas: {len(ok)} admitted of 60, 429s by replica {limited_by}")


def test_max_concurrent_holds_across_two_replicas(
    redis_server: RedisServer, mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    upstream = mini_vllm(token_delay_ms=4)
    cfg = policy(redis_server.url, max_concurrent=3)
    replicas = [gateway(upstream, cfg), gateway(upstream, cfg)]
    assert fire(replicas[:1], 1, max_tokens=24)[0].status == 200
    one = httpx.get(upstream + "/debug/stats").json()["peak_blocks"]  # what one request holds at its peak
    responses = fire(replicas, 30, max_tokens=24)
    assert [r.status for r in responses] == [200] * 30, [r.body for r in responses if r.status != 200]
    peak = httpx.get(upstream + "/debug/stats").json()["peak_blocks"]
    assert peak <= 3 * one, (peak, one)  # never more than 3 in the engine at once, across both replicas
    assert peak > one  # and they did run concurrently
    waited = [r for r in responses if "x-kvgate-queue-wait-ms" in r.headers]
    assert len(waited) >= 20  # most had to wait for one of the 3 shared slots
    print(f"\n[replicas] max_concurrent=3 over 2 replicas: engine peak {peak} blocks = {peak / one:.1f} requests")
    for url in replicas:
        assert_ledger_empty(url)


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _limits(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(url + "/readyz").json()["limits"]
    return body


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_killed_and_restarted(
    redis_server: RedisServer, mini_vllm: Callable[..., str], gateway: Callable[..., str], mode: str
) -> None:
    upstream = mini_vllm()
    cfg = policy(redis_server.url, requests_per_minute=600)
    cfg["redis"] = {**cfg["redis"], "on_failure": mode}  # type: ignore[dict-item]
    gw = gateway(upstream, cfg)
    assert [r.status for r in fire([gw], 5)] == [200] * 5
    assert _limits(gw) == {"backend": "redis", "redis": "up", "on_failure": mode, "degraded": False}

    redis_server.kill()
    during = fire([gw], 10)
    if mode == "open":
        # served, against this replica's share of the limit (600 / 2), and reported as degraded
        assert [r.status for r in during] == [200] * 10
        assert during[-1].headers["x-ratelimit-limit-requests"] == "300"
    else:
        assert {r.status for r in during} == {503}
        assert during[0].json()["error"]["code"] == "limits_unavailable" and "retry-after" in during[0].headers
    assert _limits(gw)["degraded"] is True and _limits(gw)["redis"] == "down"
    ready = httpx.get(gw + "/readyz")
    assert ready.status_code == 200  # still ready: taking every replica out of service would be worse
    m = scrape(gw)
    assert m["kvgate_limits_degraded"] == 1 and m["kvgate_redis_up"] == 0

    redis_server.start()
    _wait(lambda: _limits(gw)["redis"] == "up", "the gateway to reconnect to Redis")
    after = fire([gw], 5)
    assert [r.status for r in after] == [200] * 5
    assert after[-1].headers["x-ratelimit-limit-requests"] == "600"  # the shared limit again
    m = scrape(gw)
    assert m["kvgate_limits_degraded"] == 0 and m["kvgate_redis_up"] == 1
    assert_ledger_empty(gw)
