"""Blocks in flight per engine, shared by the gateway replicas through Redis.

Each replica knows its own reservations; the engine's ``/metrics`` shows everyone's, but only as of the last
scrape. Two replicas that admit into the same engine between two scrapes each see room the other is about to
take. So every admission claims its blocks in Redis, per engine, with an atomic script that admits it only if
the other replicas' claims still fit under what this replica's own projection leaves; each replica restates
its claims at every sample (leases renewed), and a replica that dies loses its claims when their lease runs
out.

Weighed against a replica's sample (``exclusive_upstream`` off), a claim is counted whole, less what the
engine's metrics already show of it; but the replicas scrape the engine at different moments. A request
admitted by one replica after another's last scrape, and seen decoding by its own, is in neither that other
replica's sample nor, had it been taken off, its claim. So each restated claim says which of the claimant's
last two samples showed how much of it (:class:`gateway.admission.engine.SampleMark`), and a replica takes
off what the latest of them no newer than its own sample showed; if both are newer it counts the claim whole,
until a newer sample of its own.

Each replica also says what the first requests of its queue have waited and need, and of what priority class,
and a request at another replica that its own queue would serve first (a higher class, or its class and queued
for longer) counts as held: the replicas' queues are served as one queue. Without it a
replica refills at once the room its own requests free, while the others hear of that room a sample later,
so whichever replica holds more of the engine keeps it, and the other's clients wait (or are refused).
For the same reason a replica says, at every restate, the most its reservations can hold at one future moment
(its ledger projects its requests decoding in lockstep, and counts its own so), and the others count it at
that peak plus what it has claimed since: weighed whole, another replica's claims would count for more than
its own, and the replica holding more of the engine would see more room.

The admission core sees this only through :class:`gateway.admission.admitter.SharedBooks`: Redis down means
"unknown", and admission goes on locally, by the engine's samples.
"""

from __future__ import annotations

from gateway.admission.engine import SampleMark
from gateway.admission.queue import STANDARD
from gateway.tenants.redis_store import RedisState, RedisUnavailable


def _mark(mark: SampleMark | None) -> tuple[float, float] | None:
    return None if mark is None else (mark.process, mark.tokens)


class RedisEngineBooks:
    def __init__(self, redis: RedisState, lease_s: float, waiting_ttl_s: float = 2.0) -> None:
        """``waiting_ttl_s``: how long a replica's word on its queue lasts unless restated (a dead replica's
        waiting request stops counting after it)."""
        self.redis = redis
        self.lease_s = lease_s
        self.waiting_ttl_s = waiting_ttl_s

    async def claim(
        self,
        engine: str,
        member: str,
        blocks: int,
        limit: int,
        mark: SampleMark | None,
        waited_s: float = 0.0,
        priority: int = STANDARD,
    ) -> tuple[bool, int] | None:
        """Claim ``blocks`` on ``engine`` if the other replicas' claims, as ``mark``'s sample sees them, and their
        queued requests that go before this one (a higher class, or its class and queued for longer than
        ``waited_s``) are at most ``limit`` blocks: (claimed, their blocks), or None when Redis cannot say."""
        if not self.redis.healthy:
            return None
        try:
            return await self.redis.claim_blocks(
                engine, member, blocks, limit, self.lease_s, _mark(mark), waited_s, priority
            )
        except RedisUnavailable:
            return None

    async def restate(
        self,
        engine: str,
        held: dict[str, tuple[int, int]],
        mark: SampleMark | None,
        everything: bool = False,
        waiting: tuple[tuple[float, int, int], ...] = (),
        peak: tuple[int, int] | None = None,
        upto: int | None = None,
    ) -> int | None:
        """Set this replica's claims on ``engine``: (blocks, of which ``mark``'s sample shows) each, 0 blocks
        removes one; ``everything``: its claims not listed are removed too (up to ``upto``: one claimed after
        ``held`` was taken stays), so a claim re-added by a late restate lasts one sample, not a lease;
        ``waiting``: the first requests of its queue in serving order (seconds waited, blocks, class) each;
        ``peak``: (restate number, the most its reservations up to ``upto`` can hold at once). The other
        replicas' blocks as ``mark``'s sample sees them, with their queued requests that go before this
        replica's head, or None."""
        if not self.redis.healthy:
            return None
        try:
            return await self.redis.restate_blocks(
                engine, held, self.lease_s, everything, _mark(mark), waiting, peak, upto, self.waiting_ttl_s
            )
        except RedisUnavailable:
            return None
