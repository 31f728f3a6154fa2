"""Shared limits against a real redis-server: the Lua scripts, two limiters sharing one count, and what happens
when Redis is killed and comes back (fail-open and fail-closed); slots that lapsed are put back, reloaded limits
start as the in-process buckets do, and a drain ends the waits for shared slots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.config import RedisConfig, parse_config
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, shutting_down
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import Policy, TenantPolicy
from gateway.tenants.ratelimit import RateDecision, RateLimiter, RateLimits
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
    d1 = await state.check("k", limits, 60, "c1")
    assert d1.allowed and d1.requests is not None and d1.requests.remaining == 2
    assert d1.tokens is not None and d1.tokens.remaining == 40
    d2 = await state.check("k", limits, 60, "c2")
    assert not d2.allowed and d2.exceeded == "tokens" and d2.retry_after_s > 0
    await state.refund("k", limits, "c2", 60, 1)  # a refused charge took nothing: nothing to give back
    await state.refund("k", limits, "c1", 50)  # settled: only 10 of the 60 were used
    await state.refund("k", limits, "c1", 50)  # a retried refund gives back nothing more
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


ONE_SLOT = """
tenants:
  - name: one
    max_concurrent: 1
"""


def one_slot() -> TenantPolicy:
    cfg = parse_config(ONE_SLOT)
    return Policy(cfg.auth, cfg.tenants, cfg.admission.queue_max_wait_s).resolve("one", None)


async def members(server: RedisServer, key: str) -> list[str]:
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        return list(await client.zrange(key, 0, -1))
    finally:
        await client.aclose()


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def assert_no_room(replica: TenantCounters, tp: TenantPolicy) -> None:
    with pytest.raises(GatewayError) as err:
        await replica.acquire_slot(tp, 0.3)
    assert err.value.status == 429 and err.value.extra["waiting_for"] == "concurrency_slot"


async def test_renewal_puts_back_a_slot_whose_lease_lapsed(redis_server: RedisServer) -> None:
    """A slot whose member left the set (its lease ran out while Redis was slow or away) while its request still
    runs: the renewal counts it again, so another replica cannot take the tenant past max_concurrent."""
    a, b = (TenantCounters(rcfg(redis_server, slot_lease_s=1.5), GatewayMetrics()) for _ in range(2))
    for r in (a, b):
        await r.start()
    tp = one_slot()
    assert a.redis is not None
    key = a.redis.key("slots", tp.key)
    slot = await a.acquire_slot(tp, 1.0)
    assert slot is not None and slot.backend == "redis"
    client = aioredis.Redis.from_url(redis_server.url)
    await client.zrem(key, slot.member)  # the lease lapsed
    await client.aclose()
    await a.renew_leases()
    assert await members(redis_server, key) == [slot.member]
    await assert_no_room(b, tp)
    a.release_slot(slot)
    async with held_slot(b, tp, 1.0):  # and a release still frees it
        pass
    for r in (a, b):
        await r.close()


async def test_a_slot_held_through_a_redis_restart_is_put_back_when_redis_returns(redis_server: RedisServer) -> None:
    """Redis restarts empty while a request holds a slot: as soon as Redis answers again (not a renewal period
    later) the holder puts its slot back, and the other replica finds no room."""
    a, b = (TenantCounters(rcfg(redis_server), GatewayMetrics()) for _ in range(2))  # renewals every 10 s
    for r in (a, b):
        await r.start()
    tp = one_slot()
    assert a.redis is not None
    key = a.redis.key("slots", tp.key)
    slot = await a.acquire_slot(tp, 1.0)
    assert slot is not None and slot.backend == "redis"
    redis_server.kill()
    for r in (a, b):  # each replica finds Redis gone (else b's first call after the restart would, and fall back)
        assert r.redis is not None
        with contextlib.suppress(RedisUnavailable):
            await r.redis.check("probe", RateLimits(1, None), 0)
    redis_server.start()  # without --save: empty, the slot is gone

    async def healthy() -> bool:
        return not a.degraded and b.redis is not None and b.redis.healthy

    async def put_back() -> bool:
        return await members(redis_server, key) == [slot.member]

    assert await until(healthy, 10.0)
    assert await until(put_back, 2.0), "the held slot was not put back"
    await assert_no_room(b, tp)
    a.release_slot(slot)
    async with held_slot(b, tp, 1.0):
        pass
    for r in (a, b):
        await r.close()


async def test_a_limit_added_or_changed_by_a_reload_behaves_as_in_process(redis_server: RedisServer) -> None:
    """The Redis buckets follow TokenBucket step by step: a new key and a limit added by a reload start full
    (not empty, which answered 429s), a changed limit keeps what was used, and a removed one leaves no bucket.
    Each case has its own key, so each one that differs is reported."""
    state = RedisState(rcfg(redis_server))
    await state.start()
    local = RateLimiter()
    steps = [
        ("new key", RateLimits(3, 100), 10),  # starts full
        ("rpm added", RateLimits(None, 300), 100),  # tokens only...
        ("rpm added", RateLimits(5, 300), 100),  # ...then a reload adds requests per minute: full, not empty
        ("rpm raised", RateLimits(2, None), 0),
        ("rpm raised", RateLimits(2, None), 0),
        ("rpm raised", RateLimits(2, None), 0),  # 2 of 2 used: refused
        ("rpm raised", RateLimits(10, None), 0),  # raised: 2 used of 10, 7 left after this one
        ("rpm lowered", RateLimits(10, None), 0),
        ("rpm lowered", RateLimits(10, None), 0),
        ("rpm lowered", RateLimits(3, None), 0),  # 2 used of 3: one left, taken
        ("rpm lowered", RateLimits(3, None), 0),  # refused
        ("tpm raised", RateLimits(None, 100), 100),
        ("tpm raised", RateLimits(None, 400), 250),  # 100 used of 400: 300 left, 50 after this one
        ("tpm readded", RateLimits(10, 200), 150),
        ("tpm readded", RateLimits(10, None), 0),  # removed by a reload...
        ("tpm readded", RateLimits(10, 200), 150),  # ...and added back: full again
    ]
    differ = []
    allowed = []
    for key, limits, tokens in steps:
        want = local.check(key, tokens, 0.0, limits)
        got = await state.check(key, limits, tokens)
        allowed.append(got.allowed)
        # Redis's clock runs on while the in-process one is held at 0: at most a fraction of a unit more
        close = all(
            (g is None) == (w is None) and (g is None or w is None or w <= g <= w + 1)
            for g, w in zip(remaining(got), remaining(want), strict=True)
        )
        if got.allowed != want.allowed or not close:
            differ.append((key, limits, tokens, (got.allowed, remaining(got)), (want.allowed, remaining(want))))
    assert differ == []
    assert allowed == [True] * 5 + [False] + [True] * 4 + [False] + [True] * 5
    await state.close()


def remaining(d: RateDecision) -> tuple[int | None, int | None]:
    return (
        None if d.requests is None else d.requests.remaining,
        None if d.tokens is None else d.tokens.remaining,
    )


async def test_fail_waiters_ends_waits_for_shared_slots(redis_server: RedisServer) -> None:
    """Drain with Redis: the requests polling Redis for a slot end at once with the given error."""
    limits = TenantCounters(rcfg(redis_server), GatewayMetrics())
    await limits.start()
    tp = one_slot()
    async with held_slot(limits, tp, 1.0):
        waiters = [asyncio.create_task(limits.acquire_slot(tp, 30.0)) for _ in range(3)]
        await asyncio.sleep(0.1)
        limits.fail_waiters(shutting_down)
        async with asyncio.timeout(1.0):
            results = await asyncio.gather(*waiters, return_exceptions=True)
        assert [getattr(r, "code", r) for r in results] == ["shutting_down"] * 3
    assert limits.redis is not None
    await asyncio.sleep(0.1)  # the release runs in the background
    assert await members(redis_server, limits.redis.key("slots", tp.key)) == []
    await limits.close()


async def test_a_charge_answered_too_late_and_a_refund_redis_missed_are_given_back(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis runs the charge but its answer comes after ``timeout_s`` (the request is charged locally
    instead): that shared charge is refunded; and a refund that missed its own timeout is owed and retried
    with the slot renewals. Before, both leaked for the rest of the minute: 429s on every replica. The
    lateness is injected around the real scripts; what they do to the buckets is Redis's."""
    limits = TenantCounters(rcfg(redis_server, timeout_s=0.05), GatewayMetrics())
    await limits.start()
    state = limits.redis
    assert state is not None
    run_check, run_refund, late = state._check, state._refund, [True]

    async def answered_late(**kw: Any) -> Any:
        out = await run_check(**kw)  # charged in Redis...
        await asyncio.sleep(1.0)  # ...but the answer misses the timeout
        return out

    async def missed_once(**kw: Any) -> Any:
        if late:
            late.pop()
            await asyncio.sleep(1.0)  # this one never reaches Redis in time
        return await run_refund(**kw)

    monkeypatch.setattr(state, "_check", answered_late)
    monkeypatch.setattr(state, "_refund", missed_once)
    tp = tenant()  # 10 requests and 1,000 tokens a minute
    assert (await limits.check(tp, 400)).backend == "local"  # charged here instead
    monkeypatch.setattr(state, "_check", run_check)
    admin = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    bucket = state.key("rl", tp.key)
    assert float(await admin.hget(bucket, "t")) <= 600  # the late charge landed
    for _ in range(200):  # until the shared tokens are back to full (renewals retry what is owed)
        await limits.renew_leases()
        if float(await admin.hget(bucket, "t") or 0) >= 1000 and state.healthy:
            break
        await asyncio.sleep(0.05)
    after = await state.check(tp.key, tp.rates, 1)
    assert after.requests is not None and after.tokens is not None
    assert (after.requests.remaining, after.tokens.remaining) == (9, 999)  # only this last check is charged
    assert not late  # the refund did miss once
    await admin.aclose()
    await limits.close()


async def test_an_undo_that_lands_before_its_late_charge_makes_the_charge_take_nothing(
    redis_server: RedisServer,
) -> None:
    """The undo of a charge whose answer never came may reach Redis before the charge itself (another
    connection): it leaves word, and the charge, when it arrives, takes nothing."""
    state = RedisState(rcfg(redis_server))
    await state.start()
    limits = RateLimits(3, 100)
    await state.refund("k", limits, "late", undo=True)
    assert not (await state.check("k", limits, 60, "late")).allowed  # took nothing
    fresh = await state.check("k", limits, 1, "next")
    assert fresh.requests is not None and fresh.tokens is not None
    assert (fresh.requests.remaining, fresh.tokens.remaining) == (2, 99)
    await state.refund("k", limits, "next", undo=True)  # an undo after the charge gives all of it back
    again = await state.check("k", limits, 1)
    assert again.requests is not None and again.tokens is not None
    assert (again.requests.remaining, again.tokens.remaining) == (2, 99)
    await state.close()


async def test_a_charge_can_be_refunded_as_long_as_a_request_may_last(redis_server: RedisServer) -> None:
    """A charge settled after two minutes in the queue and a long stream still gets back what it did not use:
    its record (what a refund may give back) is kept an hour, not the minute a bucket takes to refill (a busy
    tenant's bucket never refills by itself). So is the record of an undo that came before its charge."""
    state = RedisState(rcfg(redis_server))
    await state.start()
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        limits = RateLimits(None, 10_000)
        assert (await state.check("long", limits, 8_000, "c1")).allowed
        await state.refund("long", limits, "early", 0, 0, undo=True)  # an undo ahead of its charge
        for charge in ("c1", "early"):
            (record,) = [k async for k in raw.scan_iter(match=f"*rl-charge*:{charge}")]
            assert await raw.pttl(record) > 55 * 60 * 1000
        await state.refund("long", limits, "c1", 7_000)
        left = (await state.check("long", limits, 1)).tokens.remaining  # type: ignore[union-attr]
        assert 9_000 - 1 <= left < 10_000  # the 7,000 unused came back (and what refilled meanwhile)
    finally:
        await raw.aclose()
        await state.close()


async def test_a_charge_settled_with_nothing_to_give_back_leaves_no_record(redis_server: RedisServer) -> None:
    """A request that used its whole charge still deletes its record when it settles: kept an hour, the
    records of every fully used charge would pile up in Redis (a thousand a second: millions)."""
    limits = TenantCounters(rcfg(redis_server), GatewayMetrics())
    await limits.start()
    admin = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        charge = await limits.check(tenant(), 400)
        assert charge.backend == "redis"
        assert [k async for k in admin.scan_iter(match="*rl-charge*")]
        limits.settle(charge, 400)  # every token used: nothing to give back
        for _ in range(100):  # the refund runs in the background
            if not [k async for k in admin.scan_iter(match="*rl-charge*")]:
                break
            await asyncio.sleep(0.02)
        assert not [k async for k in admin.scan_iter(match="*rl-charge*")]
    finally:
        await admin.aclose()
        await limits.close()


async def test_a_charge_cut_to_a_minutes_allowance_takes_what_it_used_beyond_as_a_debt(
    redis_server: RedisServer,
) -> None:
    """A request whose budget is more than a minute's tokens (a chat without max_tokens) is charged the
    minute's allowance; what it used beyond is taken when it settles, on every replica's count: the bucket goes
    into debt and the tenant waits it off, so a large budget is no way around the limit. The debt outlives the
    minute a bucket's key otherwise lasts, and one taken after the bucket's key expired starts from a full one.
    Even the least such a request is billed, when more than a minute's allowance, is a 400: no wait helps."""
    limits = TenantCounters(rcfg(redis_server), GatewayMetrics())
    other = TenantCounters(rcfg(redis_server), GatewayMetrics())  # a second replica
    await limits.start()
    await other.start()
    admin = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        charge = await limits.check(tenant(), 5_000, least=100)  # tokens_per_minute 1000
        assert charge.backend == "redis" and charge.tokens == 1000
        limits.settle(charge, 3_000)  # used 3,000: 2,000 more than charged

        async def settled() -> bool:  # it runs in the background: its charge's record goes
            return not [k async for k in admin.scan_iter(match="*rl-charge*")]

        assert await until(settled, 2.0)
        with pytest.raises(GatewayError) as err:
            await other.check(tenant(), 10, least=10)
        assert err.value.status == 429 and err.value.retry_after_s is not None
        assert 110 <= err.value.retry_after_s <= 121  # 2,000 in debt: two minutes to wait off, and a bit
        (bucket,) = [k async for k in admin.scan_iter(match="*:rl:*")]
        assert await admin.pttl(bucket) > 120_000  # kept until paid off, not the minute a full one lasts
        await admin.delete(bucket)  # expired meanwhile: a debt starts from a full bucket
        again = await limits.check(tenant(), 5_000, least=100)
        await admin.delete(bucket)
        limits.settle(again, 1_500)

        async def bucket_back() -> bool:
            return bool(await admin.exists(bucket))

        assert await until(bucket_back, 2.0)
        assert float(await admin.hget(bucket, "t")) == pytest.approx(500, abs=5)  # type: ignore[arg-type]
        with pytest.raises(GatewayError) as err:
            await limits.check(tenant(), 5_000, least=1_001)
        assert err.value.status == 400 and err.value.code == "request_too_large"
    finally:
        await admin.aclose()
        await limits.close()
        await other.close()


async def test_a_redis_clock_that_steps_back_credits_no_time_twice(redis_server: RedisServer) -> None:
    """The check script with its clock given (a failover to a Redis whose clock is 30 s behind): the bucket's
    level stays as of the later time, so the 30 s it had already been credited are not credited again."""
    from gateway.tenants import redis_store

    clocked = redis_store._CHECK.replace(
        "local now = tonumber(t[1]) + tonumber(t[2]) / 1000000", "local now = tonumber(ARGV[5])"
    )
    assert clocked != redis_store._CHECK
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        check = client.register_script(clocked)

        async def tokens_left(at: float, take: int) -> float:
            answer = await check(keys=["clock"], args=[0, 6000, take, 1000, at])
            return float(answer[2])

        assert await tokens_left(1000.0, 6000) == 0  # emptied at t=1000
        assert await tokens_left(970.0, 0) == 0  # the clock stepped back 30 s: nothing refilled
        assert await tokens_left(1000.0, 0) == 0  # back at 1000: still nothing (was 3,000, credited twice)
        assert await tokens_left(1010.0, 0) == pytest.approx(1000)  # 10 s at 100 a second
    finally:
        await client.aclose()


async def test_slots_held_in_redis_count_toward_the_share_when_it_goes_down(redis_server: RedisServer) -> None:
    """max_concurrent 4 over 2 replicas: with Redis down each replica's share is 2, and the two it already holds
    in Redis (their requests still running) are that share, not beside it: it grants no more until they end."""
    limits = TenantCounters(rcfg(redis_server, replicas=2, on_failure="open"), GatewayMetrics())
    await limits.start()
    tp = tenant()  # max_concurrent 4
    try:
        held = [await limits.acquire_slot(tp, 1.0) for _ in range(2)]
        assert all(slot is not None and slot.backend == "redis" for slot in held)
        redis_server.kill()
        with pytest.raises(GatewayError) as err:  # both of its share are running: it waits, and times out
            await limits.acquire_slot(tp, 0.3)
        assert err.value.status in (429, 503)
        first = held[0]
        assert first is not None
        limits.release_slot(first)  # one ends: one of its share is free again, now held locally
        local = await limits.acquire_slot(tp, 1.0)
        assert local is not None and local.backend == "local"
        limits.release_slot(local)
    finally:
        redis_server.start()
        await limits.close()


async def test_a_slot_given_back_before_its_late_acquire_ran_is_not_taken(redis_server: RedisServer) -> None:
    """An acquire timed out on its way, so its slot was given back at once; the acquire then ran late. It takes
    nothing (the release left a mark): it would have held one of the tenant's slots on every replica for a
    lease with no request behind it. A release of a slot that was taken leaves no mark."""
    state = RedisState(rcfg(redis_server))
    await state.start()
    admin = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        await state.release("late", "r1:1")  # the give-back arrives first
        assert not await state.acquire("late", 1, "r1:1")  # the late acquire takes nothing
        assert await admin.zcard(state.key("slots", "late")) == 0
        assert await state.acquire("late", 1, "r1:2")  # and the slot is free for the next one
        await state.release("late", "r1:2")
        assert not [k async for k in admin.scan_iter(match="*slot-released*")]  # taken, then given back: no mark
    finally:
        await admin.aclose()
        await state.close()


async def test_while_redis_is_down_a_request_the_tenants_limit_holds_is_not_refused_for_good(
    redis_server: RedisServer,
) -> None:
    """1,000 tokens per minute over 2 replicas: with Redis down this replica's share is 500. A request that is
    billed at least 700 fits the tenant's limit: charged the share's minute (the rest is a debt), not a 400
    request_too_large; only what the tenant's own limit could never hold is."""
    limits = TenantCounters(rcfg(redis_server, replicas=2, on_failure="open"), GatewayMetrics())
    await limits.start()
    try:
        redis_server.kill()
        charge = await limits.check(tenant(), 5_000, least=700)
        assert (charge.backend, charge.tokens) == ("local", 500)
        with pytest.raises(GatewayError) as err:
            await limits.check(tenant(), 5_000, least=1_001)
        assert err.value.code == "request_too_large" and "1000 tokens per minute" in err.value.message
    finally:
        redis_server.start()
        await limits.close()


async def test_a_reload_that_cuts_the_limit_keeps_a_debt_and_makes_none(redis_server: RedisServer) -> None:
    """As TokenBucket.resize: 900 of 1,000 used, the limit cut to 100 a minute: the bucket is empty, not 800 in
    debt (a wait of 6 s for 10 tokens, not 8 minutes); a debt there was stays one at the new size."""
    state = RedisState(rcfg(redis_server))
    await state.start()
    try:
        assert (await state.check("cut", RateLimits(None, 1000), 900, "c1")).allowed
        refused = await state.check("cut", RateLimits(None, 100), 10)
        assert not refused.allowed and refused.retry_after_s == pytest.approx(6.0, abs=0.2)
        assert (await state.check("debt", RateLimits(None, 1000), 1000, "c2")).allowed
        await state.refund("debt", RateLimits(None, 1000), "c2", -2000)  # used 2,000 beyond its charge
        refused = await state.check("debt", RateLimits(None, 2000), 10)  # doubled: 1,010 at 2,000 a minute
        assert not refused.allowed and refused.retry_after_s == pytest.approx(30.3, abs=0.5)
    finally:
        await state.close()


async def test_a_renewal_that_lands_after_a_marked_release_puts_nothing_back(redis_server: RedisServer) -> None:
    """A renewal timed out on its way; the slot it carries was given back meanwhile. Released with the mark,
    the renewal landing late takes nothing; a release without one (the renewal had landed) leaves no key."""
    state = RedisState(rcfg(redis_server))
    await state.start()
    admin = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        assert await state.acquire("k", 2, "r1:1")
        await state.release("k", "r1:1", mark=True)
        await state.renew([("k", "r1:1")])  # the late renewal
        assert await admin.zcard(state.key("slots", "k")) == 0
        assert await state.acquire("k", 2, "r1:2")
        await state.renew([("k", "r1:2")])  # a live member is renewed as ever
        assert await admin.zcard(state.key("slots", "k")) == 1
    finally:
        await admin.aclose()
        await state.close()
