"""Shared limits against a real redis-server: the Lua scripts, two limiters sharing one count, and what happens
when Redis is killed and comes back (fail-open and fail-closed)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import RedisConfig, parse_config
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import Policy, TenantPolicy
from gateway.tenants.ratelimit import RateLimits
from gateway.tenants.redis_store import RedisState, RedisUnavailable
from tests.redis.conftest import RedisServer
from tests.support.tenant_slots import held_slot

pytestmark = pytest.mark.redis

TENANTS = """
tenants:
  - name: a
    requests_per_minute: 10
    tokens_per_minute: 1000
    max_concurrent: 4
"""


def tenant() -> TenantPolicy:
    cfg = parse_config(TENANTS)
    return Policy(cfg.auth, cfg.tenants, cfg.admission.queue_max_wait_s).resolve("a", None)


def rcfg(server: RedisServer, **kw: object) -> RedisConfig:
    # timeout 0.5 s rather than the 50 ms default: the suite shares 2 busy cores, and a late reply (by design)
    # fails that one call over to on_failure, which would blur what these tests check
    return RedisConfig(url=server.url, reconnect_interval_s=0.2, **{"timeout_s": 0.5, **kw})  # type: ignore[arg-type]


async def test_scripts_charge_refund_and_slots(redis_server: RedisServer) -> None:
    state = RedisState(rcfg(redis_server))
    await state.start()
    assert state.healthy
    limits = RateLimits(3, 100)
    d1 = await state.check("k", limits, 60)
    assert d1.allowed and d1.requests is not None and d1.requests.remaining == 2
    assert d1.tokens is not None and d1.tokens.remaining == 40
    d2 = await state.check("k", limits, 60)
    assert not d2.allowed and d2.exceeded == "tokens" and d2.retry_after_s > 0
    await state.refund("k", limits, 50)  # settled: only 10 of the 60 were used
    assert (await state.check("k", limits, 60)).allowed
    assert (await state.check("k", limits, 1)).tokens.remaining == 29  # type: ignore[union-attr]
    never = await state.check("k2", RateLimits(None, 100), 101)
    assert not never.allowed and never.retry_after_s == float("inf")
    # concurrency slots: the limit holds, a release frees one, a re-acquire of a held member is idempotent
    assert [await state.acquire("s", 2, m) for m in ("x", "y", "z")] == [True, True, False]
    assert await state.acquire("s", 2, "x")
    await state.release("s", "x")
    assert await state.acquire("s", 2, "z")
    await state.renew([("s", "y"), ("s", "z")])
    await state.close()


async def test_two_replicas_share_one_concurrency_limit(redis_server: RedisServer) -> None:
    """Two TenantCounters (two replicas' worth of state) on one Redis: together never more than max_concurrent."""
    replicas = [TenantCounters(rcfg(redis_server, slot_poll_s=0.005), GatewayMetrics()) for _ in range(2)]
    for r in replicas:
        await r.start()
    tp = tenant()
    holding = 0
    peak = 0

    async def one(limits: TenantCounters) -> None:
        nonlocal holding, peak
        async with held_slot(limits, tp, 30.0):
            holding += 1
            peak = max(peak, holding)
            await asyncio.sleep(0.01)
            holding -= 1

    await asyncio.gather(*(one(replicas[i % 2]) for i in range(40)))
    assert peak == tp.max_concurrent
    for r in replicas:
        await r.close()


async def test_fail_open_then_recover(redis_server: RedisServer) -> None:
    """Redis killed: limits fall back to this replica's share (limit / replicas), flagged degraded; no call
    waits on the dead Redis; once it is back the shared counters are used again."""
    metrics = GatewayMetrics()
    limits = TenantCounters(rcfg(redis_server, replicas=2, on_failure="open"), metrics)
    await limits.start()
    tp = tenant()
    assert (await limits.check(tp, 10)).backend == "redis"
    redis_server.kill()
    # the first call after the crash finds out (within timeout_s) and falls back; later ones skip Redis
    charges = []
    for _ in range(6):
        try:
            charges.append(await limits.check(tp, 10))
        except GatewayError as exc:
            assert exc.status == 429 and exc.code == "rate_limit_exceeded"
            break
    assert [c.backend for c in charges] == ["local"] * 5  # 10 rpm / 2 replicas
    assert limits.degraded and limits.status()["degraded"] is True  # the gauges read these (test_replicas)
    async with held_slot(limits, tp, 1.0):  # slots fall back too
        assert limits.slots.held("a") == 1
    assert limits.redis is not None
    with pytest.raises(RedisUnavailable):  # known down: refused at once, not after a timeout
        await limits.redis.check("a", tp.rates, 1)

    redis_server.start()
    for _ in range(100):
        if not limits.degraded:
            break
        await asyncio.sleep(0.05)
    assert not limits.degraded
    assert (await limits.check(tp, 10)).backend == "redis"  # a restarted Redis starts with full buckets
    assert limits.status()["degraded"] is False
    await limits.close()


async def test_fail_closed_then_recover(redis_server: RedisServer) -> None:
    limits = TenantCounters(rcfg(redis_server, on_failure="closed"), GatewayMetrics())
    await limits.start()
    tp = tenant()
    assert (await limits.check(tp, 10)).backend == "redis"
    redis_server.kill()
    for _ in range(3):
        with pytest.raises(GatewayError) as err:
            await limits.check(tp, 10)
        assert err.value.status == 503 and err.value.code == "limits_unavailable"
        assert err.value.retry_after_s is not None
    # a tenant with no limits is not affected
    cfg = parse_config("")
    assert (
        await limits.check(Policy(cfg.auth, cfg.tenants, cfg.admission.queue_max_wait_s).resolve("free", None), 10)
    ).backend == "none"
    redis_server.start()
    for _ in range(100):
        if not limits.degraded:
            break
        await asyncio.sleep(0.05)
    assert (await limits.check(tp, 10)).backend == "redis"
    await limits.close()
