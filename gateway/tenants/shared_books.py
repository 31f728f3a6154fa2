"""Blocks in flight per engine, shared by the gateway replicas through Redis.

Each replica knows its own reservations; the engine's ``/metrics`` shows everyone's, but only as of the last
scrape. Two replicas that admit into the same engine between two scrapes each see room the other is about to
take. So every admission claims its blocks in Redis, per engine, with an atomic script that admits it only if
the other replicas' claims still fit under what this replica's own projection leaves; each replica restates
its claims at every sample (what the engine's metrics now show is taken off; leases renewed), and a replica
that dies loses its claims when their lease runs out. The admission core sees this only through
:class:`gateway.admission.admitter.SharedBooks`: Redis down means "unknown", and admission goes on locally.
"""

from __future__ import annotations

from gateway.tenants.redis_store import RedisState, RedisUnavailable


class RedisEngineBooks:
    def __init__(self, redis: RedisState, lease_s: float) -> None:
        self.redis = redis
        self.lease_s = lease_s

    async def claim(self, engine: str, member: str, blocks: int, limit: int) -> tuple[bool, int] | None:
        """Claim ``blocks`` on ``engine`` if the other replicas' claims are at most ``limit`` blocks: (claimed,
        their blocks), or None when Redis cannot say."""
        if not self.redis.healthy:
            return None
        try:
            return await self.redis.claim_blocks(engine, member, blocks, limit, self.lease_s)
        except RedisUnavailable:
            return None

    async def restate(self, engine: str, held: dict[str, int], everything: bool = False) -> int | None:
        """Set this replica's claims on ``engine`` (0 removes one; ``everything``: its claims not listed are
        removed too, so a claim re-added by a late restate lasts one sample, not a lease); the other replicas'
        blocks, or None."""
        if not self.redis.healthy:
            return None
        try:
            return await self.redis.restate_blocks(engine, held, self.lease_s, everything)
        except RedisUnavailable:
            return None
