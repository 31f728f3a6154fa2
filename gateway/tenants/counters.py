"""Where a tenant's counters live: in-process, or in Redis shared by every replica, with the fallback.

* No ``redis.url``: token buckets and concurrency slots in this process (:mod:`gateway.tenants.ratelimit`,
  :mod:`gateway.tenants.slots`).
* ``redis.url`` set and Redis answering: the same counters in Redis, changed by Lua scripts.
* Redis down: ``on_failure: open`` counts locally with each limit divided by ``replicas`` (reported as
  degraded), ``closed`` refuses tenants that have limits with 503 until Redis answers again.

A request waits for a concurrency slot in FIFO order behind the other requests of its key on this replica;
with Redis it retries every ``slot_poll_s`` (slots freed on other replicas are not announced) and at once
when a slot is freed here. The wait is bounded: by the tenant's ``max_queued``, else by
``default_max_waiters``; on drain :meth:`TenantCounters.fail_waiters` ends every wait. Settling and releasing
never make a request wait on Redis: they run in the background, and a release Redis did not take is retried
when the leases are next renewed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gateway.config import RedisConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, request_too_large, slot_timeout
from gateway.tenants.policy import TenantPolicy
from gateway.tenants.ratelimit import RateDecision, RateLimiter, RateLimits, ratelimit_headers, token_charge
from gateway.tenants.redis_store import CHARGE_RECORD_TTL_S, RedisState, RedisUnavailable
from gateway.tenants.slots import HoldTimes, Slot, SlotTable

log = logging.getLogger("kvgate.limits")

_UNLIMITED = RateDecision(True, 0.0, None, None)


@dataclass(slots=True)
class Charge:
    """What a request was charged, and where, so the refund goes back to the same counter."""

    key: str
    rates: RateLimits
    tokens: int
    backend: str  # "local" | "redis" | "none"
    decision: RateDecision
    id: str = ""  # names a Redis charge: its refund gives back at most what it took, once


def _charged(tokens: int, least: int, rates: RateLimits, limits: RateLimits) -> int:
    """:func:`token_charge`, or 400 when the tenant's ``limits`` could never let it in (not ``rates``, a
    replica's share while Redis is down: a request the tenant's limit holds is not refused for good for an
    outage)."""
    amount = token_charge(tokens, least, rates, limits)
    if amount is None:
        assert limits.tokens_per_minute is not None
        raise request_too_large(least, limits.tokens_per_minute)
    return amount


class TenantCounters:
    """A tenant's rate-limit buckets and concurrency slots, in-process or shared through Redis."""

    def __init__(
        self,
        cfg: RedisConfig,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        default_max_waiters: int | None = None,
    ) -> None:
        """``default_max_waiters`` bounds the requests of one key waiting for a slot (with the tenant's requests
        in the admission queue) when the tenant sets no ``max_queued``; None leaves them unbounded."""
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.default_max_waiters = default_max_waiters
        self.local = RateLimiter()
        self.slots = SlotTable()
        self._limits: dict[str, int] = {}  # max_concurrent per key, as the newest policy says (config-bounded)
        self._whose: dict[str, str] = {}  # each of those keys' tenant
        self.holds = HoldTimes()  # how long each key's slots are held: when a request refused one may come back
        self.redis = (
            RedisState(cfg, on_health=self._on_redis_health, on_error=metrics.redis_errors.inc) if cfg.url else None
        )
        self._waiters: dict[str, deque[asyncio.Event]] = {}
        self._failing: Callable[[float], GatewayError] | None = None  # set by fail_waiters (drain)
        self._redis_held: dict[str, tuple[str, str]] = {}
        # member -> (key, when, mark): a release Redis did not take, retried as it was asked
        self._unreleased: dict[str, tuple[str, float, bool]] = {}
        # charge id -> (rate key, limits, tokens, requests, undo, since when): refunds Redis did not take
        self._owed: dict[str, tuple[str, RateLimits, float, float, bool, float]] = {}
        self._charge_ids = itertools.count(1)
        self._members = itertools.count(1)
        self._background: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._renew_soon = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.redis is None:
            return
        await self.redis.start()
        self._renewer = asyncio.create_task(self._renew_leases(), name="kvgate-slot-leases")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._background:
            await asyncio.wait(self._background, timeout=self.cfg.timeout_s * 4)
        if self.redis is not None:
            await self.redis.close()

    @property
    def degraded(self) -> bool:
        return self.redis is not None and not self.redis.healthy

    def status(self) -> dict[str, object]:
        """For /readyz."""
        if self.redis is None:
            return {"backend": "local", "degraded": False}
        return {
            "backend": "redis",
            "redis": "up" if self.redis.healthy else "down",
            "on_failure": self.cfg.on_failure,
            "degraded": self.degraded,
        }

    # --- rate limits --------------------------------------------------------------------------------

    async def check(self, tp: TenantPolicy, tokens: int, least: int = 0) -> Charge:
        """Charge one request and ``tokens`` against the tenant's per-minute limits (at most a minute's
        allowance of those it is checked against: see :func:`token_charge`), or raise 429 (or 503 when Redis is
        down and ``on_failure: closed``; 400 when even ``least``, what it is billed whatever it generates, is
        more than a minute's allowance)."""
        if not tp.rates.any:
            return Charge(tp.key, tp.rates, tokens, "none", _UNLIMITED)
        charge: Charge | None = None
        if self.redis is not None and self.redis.healthy:
            charge_id = str(next(self._charge_ids))
            amount = _charged(tokens, least, tp.rates, tp.rates)
            try:
                decision = await self.redis.check(tp.key, tp.rates, amount, charge_id)
                charge = Charge(tp.key, tp.rates, amount, "redis", decision, charge_id)
            except RedisUnavailable:  # the answer did not come (the script may have run, or may still): undo it
                self._refund_redis(tp.key, tp.rates, charge_id, undo=True)
            except asyncio.CancelledError:  # the client left while Redis was charging it
                self._refund_redis(tp.key, tp.rates, charge_id, undo=True)
                raise
        if charge is None:
            rates = tp.rates
            if self.redis is not None:
                self._refuse_if_closed(tp)
                rates = rates.scaled(self.cfg.replicas)
            amount = _charged(tokens, least, rates, tp.rates)
            charge = Charge(tp.key, rates, amount, "local", self.local.check(tp.key, amount, self.clock(), rates))
        decision = charge.decision
        if not decision.allowed:
            raise GatewayError(
                429,
                f"Rate limit reached for tenant '{tp.tenant}' on {decision.exceeded} per minute.",
                type="requests" if decision.exceeded == "requests" else "tokens",
                code="rate_limit_exceeded",
                retry_after_s=decision.retry_after_s if decision.retry_after_s != float("inf") else 60.0,
                extra_headers=ratelimit_headers(decision),
            )
        return charge

    def settle(self, charge: Charge, actual: int, reached_engine: bool = True) -> None:
        """Refund the unused part of the pre-charge (or take what was used beyond a charge cut to a minute's
        allowance), to the counter that took it, and the request itself if it never reached the engine (kvgate
        turned it away, or its client left first); never waits on Redis."""
        unused = charge.tokens - actual  # below 0: used beyond the charge
        if charge.backend == "local":
            self.local.settle(charge.key, charge.tokens, actual, self.clock(), request=reached_engine)
        elif charge.backend == "redis":  # with nothing to give back too: the refund deletes the charge's record
            self._refund_redis(charge.key, charge.rates, charge.id, unused, 0 if reached_engine else 1)

    def _refund_redis(
        self,
        key: str,
        rates: RateLimits,
        charge: str,
        tokens: float = 0,
        requests: float = 0,
        undo: bool = False,
        since: float | None = None,
    ) -> None:
        """Give back to the shared buckets in the background (at most once per charge: Redis keeps its record);
        a refund Redis does not take is owed, and retried with the slot renewals while the charge's record
        lasts (:data:`CHARGE_RECORD_TTL_S`)."""
        redis = self.redis
        if redis is None:
            return
        owed_since = self.clock() if since is None else since

        async def refund() -> None:
            try:
                await redis.refund(key, rates, charge, tokens, requests, undo)
            except RedisUnavailable:
                self._owed[charge] = (key, rates, tokens, requests, undo, owed_since)
                raise

        self._spawn(refund())

    def _refuse_if_closed(self, tp: TenantPolicy) -> None:
        if self.cfg.on_failure == "closed":
            raise GatewayError(
                503,
                "The gateway cannot reach its shared rate-limit store; retry later.",
                type="service_unavailable",
                code="limits_unavailable",
                retry_after_s=self.cfg.reconnect_interval_s,
            )

    # --- concurrency slots --------------------------------------------------------------------------

    async def acquire_slot(
        self, tp: TenantPolicy, wait_s: float, queued_elsewhere: Callable[[], int] = lambda: 0
    ) -> Slot | None:
        """One of the tenant's concurrency slots (None: the tenant has no concurrency limit), waiting up to
        ``wait_s``. Give it back with :meth:`release_slot`.

        ``queued_elsewhere`` counts the tenant's requests waiting in the admission queue, so that
        ``max_queued`` bounds both waits together."""
        if tp.max_concurrent is None:
            return None
        started = self.clock()
        # the newest policy's limit, for the requests already waiting too: a reload that raises it lets them in
        # (they would hold the line at the old limit, and every new request behind them)
        self._whose[tp.key] = tp.tenant
        self._set_limit(tp.key, tp.max_concurrent)
        return await self._acquire(tp, started, started + wait_s, queued_elsewhere)

    def limits_changed(self, max_concurrent: Callable[[str, str | None], int | None]) -> None:
        """A reload: each key's ``max_concurrent`` as the new policy says (``max_concurrent(tenant, model)``,
        ``model`` the override's, None for the tenant's own). The requests waiting under a limit raised (or
        lifted) try again now, not when a new request of their tenant comes."""
        for key, tenant in self._whose.items():
            limit = max_concurrent(tenant, key[len(tenant) + 1 :] or None)
            self._set_limit(key, sys.maxsize if limit is None else limit)

    def _set_limit(self, key: str, limit: int) -> None:
        raised = limit > self._limits.get(key, limit)
        self._limits[key] = limit
        if raised and (line := self._waiters.get(key)):
            line[0].set()  # the head tries again now, at the new limit, and wakes the next if it got one

    async def _acquire(
        self,
        tp: TenantPolicy,
        started: float,
        deadline: float,
        queued_elsewhere: Callable[[], int],
    ) -> Slot:
        limit = self._limits[tp.key]
        if not self._waiters.get(tp.key):
            slot = await self._try(tp, limit)
            if slot is not None:
                return slot
        if self._failing is not None:
            raise self._failing(1.0)
        # Fetched after the await above: meanwhile the last waiter may have left and removed the line, and
        # waiting in a detached one would split the key's FIFO (and its bound) in two.
        line = self._waiters.setdefault(tp.key, deque())
        max_queued = tp.qclass.max_queued if tp.qclass.max_queued is not None else self.default_max_waiters
        if max_queued is not None and len(line) + queued_elsewhere() >= max_queued:
            if not line:
                del self._waiters[tp.key]
            raise GatewayError(
                429,
                f"Tenant '{tp.tenant}' has {max_queued} request(s) waiting already.",
                type="rate_limit_exceeded",
                code="tenant_queue_full",
                retry_after_s=self.holds.retry_after(tp.key, len(line) + 1, limit),
                extra={"queue_position": len(line) + 1},
            )
        me = asyncio.Event()
        line.append(me)
        try:
            while True:
                if self._failing is not None:
                    raise self._failing(1.0)
                head = line[0] is me
                limit = self._limits[tp.key]
                if head:
                    slot = await self._try(tp, limit)
                    if slot is not None:
                        return slot
                remaining = deadline - self.clock()
                if remaining <= 0:
                    position = line.index(me) + 1
                    retry_after = self.holds.retry_after(tp.key, position, limit)
                    raise slot_timeout(tp.tenant, limit, retry_after, self.clock() - started, position)
                shared = self.redis is not None and self.redis.healthy
                poll = min(remaining, self.cfg.slot_poll_s) if head and shared else remaining
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that arrives as the
                # event is set, and a client that went away would then go on to take a slot and reach the engine.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll):
                        await me.wait()
                me.clear()
        finally:
            with contextlib.suppress(ValueError):
                line.remove(me)
            if line:
                line[0].set()  # the next one tries: there may be room for it too
            elif self._waiters.get(tp.key) is line:
                del self._waiters[tp.key]

    def fail_waiters(self, error: Callable[[float], GatewayError]) -> None:
        """Drain: every request waiting for a slot raises ``error(retry_after_s)``, and so does every later one
        that would have to wait (one that finds a slot free still gets it). Like
        :meth:`~gateway.admission.admitter.Admitter.fail_all_queued` for the admission queue."""
        self._failing = error
        for line in self._waiters.values():
            for waiter in line:
                waiter.set()

    async def _try(self, tp: TenantPolicy, limit: int) -> Slot | None:
        if self.redis is not None and self.redis.healthy:
            member = f"{self.redis.replica_id}:{next(self._members)}"
            try:
                got = await self.redis.acquire(tp.key, limit, member)
            except RedisUnavailable:
                got = None  # fall back below; if the script did run, give the slot straight back
                self._release_redis(tp.key, member)
            except asyncio.CancelledError:
                self._release_redis(tp.key, member)  # it may have been granted meanwhile
                raise
            if got is not None:
                if not got:
                    return None
                self._redis_held[member] = (tp.key, member)
                return Slot(tp.key, "redis", member, taken_at=self.clock())
        if self.redis is not None:
            self._refuse_if_closed(tp)
            # this replica's share, of which the slots it took in Redis and still holds are part: running
            # requests keep them, and the share counted beside them would let twice the limit run
            in_redis = sum(1 for key, _ in self._redis_held.values() if key == tp.key)
            limit = max(1, -(-limit // self.cfg.replicas)) - in_redis
        slot = self.slots.try_acquire(tp.key, limit)
        if slot is not None:
            slot.taken_at = self.clock()
        return slot

    def release_slot(self, slot: Slot) -> None:
        """Give a slot back; a second call for the same slot does nothing."""
        if slot.released:
            return
        self.holds.observe(slot.key, self.clock() - slot.taken_at)
        if slot.backend == "local":
            self.slots.release(slot)
        else:
            slot.released = True
            self._redis_held.pop(slot.member, None)
            self._release_redis(slot.key, slot.member)
        line = self._waiters.get(slot.key)
        if line:
            line[0].set()

    def _release_redis(self, key: str, member: str, mark: bool = False) -> None:
        """ZREM in the background; if Redis does not take it, the next renewal retries it (else the member
        would hold one of the tenant's slots on every replica until its lease runs out). ``mark``: see
        :meth:`RedisState.release`."""
        redis = self.redis
        if redis is None:
            return

        async def release() -> None:
            try:
                await redis.release(key, member, mark=mark)
            except RedisUnavailable:
                self._unreleased.setdefault(member, (key, self.clock(), mark))
                raise
            self._unreleased.pop(member, None)

        self._spawn(release())

    def _on_redis_health(self, up: bool) -> None:
        if up:
            self._renew_soon.set()  # a restarted Redis lost our slots: put them back before others take them

    async def renew_leases(self) -> None:
        """Extend the leases of the Redis slots this replica holds, putting back any that lapsed, and retry the
        releases Redis missed. Runs every ``slot_lease_s / 3`` and as soon as Redis is back."""
        if self.redis is None or not self.redis.healthy:
            return  # the probe sets _renew_soon when Redis is back
        held = list(self._redis_held.values())
        landed = False
        try:
            await self.redis.renew(held)
            landed = True
        finally:
            for key, member in held:
                if member not in self._redis_held:  # released while the renewal was in flight: it put it back
                    # one that timed out may still land after this release: the mark keeps it from re-adding
                    self._release_redis(key, member, mark=not landed)
        stale = self.clock() - self.cfg.slot_lease_s
        for member, (key, since, mark) in list(self._unreleased.items()):
            if since < stale:
                del self._unreleased[member]  # its lease has run out: Redis dropped it by itself
            else:
                self._release_redis(key, member, mark)
        expired = self.clock() - CHARGE_RECORD_TTL_S
        for charge, (key, rates, tokens, requests, undo, since) in list(self._owed.items()):
            del self._owed[charge]
            if since >= expired:  # older: Redis has dropped its record, which a refund needs
                self._refund_redis(key, rates, charge, tokens, requests, undo, since)

    async def _renew_leases(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.slot_lease_s / 3):
                    await self._renew_soon.wait()
            self._renew_soon.clear()
            try:
                await self.renew_leases()
            except RedisUnavailable:
                pass
            except Exception:  # the loop must outlive any one failure, or every held slot lapses
                log.exception("renewing slot leases failed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        async def quietly() -> None:
            with contextlib.suppress(RedisUnavailable):
                await coro

        task = asyncio.create_task(quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
