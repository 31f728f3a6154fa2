"""The shared engine books' scripts against a real redis-server: how one replica weighs another's claims on an
engine. A claim counts whole, less the part the claimant's sample showed, and only when the weighing replica's
own sample is at least as recent (same engine process, at least as many tokens processed): the two replicas
scrape at different moments, and a part one sample shows may be missing from an older one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.admission.engine import SampleMark
from gateway.config import RedisConfig
from gateway.tenants.redis_store import RedisState
from gateway.tenants.shared_books import RedisEngineBooks
from tests.redis.conftest import RedisServer

pytestmark = pytest.mark.redis

PROCESS = 1_795_322_850.13  # the engine's process_start_time_seconds
ENGINE = "http://10.0.0.7:8000"


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[RedisEngineBooks, RedisEngineBooks]]:
    states = [RedisState(RedisConfig(url=redis_server.url, timeout_s=0.5)) for _ in range(2)]
    for state in states:
        await state.start()
        assert state.healthy
    # leases far longer than any test: what these tests weigh must not lapse on a slow machine
    yield RedisEngineBooks(states[0], lease_s=60), RedisEngineBooks(states[1], lease_s=60)
    for state in states:
        await state.close()


async def test_a_claim_is_taken_off_only_by_a_sample_at_least_as_recent(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    a, b = replicas
    # b holds 30 blocks there, of which its sample at 1,000 tokens processed shows 12
    assert await b.restate(ENGINE, {"7": (30, 12)}, SampleMark(PROCESS, 1000.0)) == 0
    seen = {
        "no sample": await a.restate(ENGINE, {}, None),
        "older": await a.restate(ENGINE, {}, SampleMark(PROCESS, 999.0)),
        "the same": await a.restate(ENGINE, {}, SampleMark(PROCESS, 1000.0)),
        "newer": await a.restate(ENGINE, {}, SampleMark(PROCESS, 4000.0)),
        "another process": await a.restate(ENGINE, {}, SampleMark(PROCESS + 60, 9000.0)),
    }
    assert seen == {"no sample": 30, "older": 30, "the same": 18, "newer": 18, "another process": 30}


async def test_a_sample_between_two_of_the_claimants_takes_off_what_the_earlier_one_showed(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """The replicas' scrapes interleave: half the time the other's latest sample is newer than this one's, and
    its sample before that older. What that older one showed is still shown (the request only grew since)."""
    a, b = replicas
    await b.restate(ENGINE, {"7": (30, 12)}, SampleMark(PROCESS, 1000.0))
    await b.restate(ENGINE, {"7": (30, 20)}, SampleMark(PROCESS, 2000.0))
    await b.restate(ENGINE, {"7": (30, 20)}, SampleMark(PROCESS, 2000.0))  # the same sample again: no loss
    seen = [await a.restate(ENGINE, {}, SampleMark(PROCESS, tokens)) for tokens in (900.0, 1500.0, 2000.0)]
    assert seen == [30, 30 - 12, 30 - 20]
    await b.restate(ENGINE, {"7": (30, 25)}, SampleMark(PROCESS + 60, 10.0))  # the engine restarted
    assert await a.restate(ENGINE, {}, SampleMark(PROCESS, 2000.0)) == 30


async def test_a_claim_is_refused_by_what_the_claimants_own_sample_cannot_show(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """The race the marks close: b's request, admitted after a's last scrape, is decoding in b's newer sample. a
    may leave the other replicas 18 blocks: from its older sample all 30 are b's to count, and it must wait."""
    a, b = replicas
    await b.restate(ENGINE, {"7": (30, 12)}, SampleMark(PROCESS, 1000.0))
    assert await a.claim(ENGINE, "1", 5, 18, SampleMark(PROCESS, 900.0)) == (False, 30)
    assert await a.claim(ENGINE, "1", 5, 18, SampleMark(PROCESS, 1000.0)) == (True, 18)
    # and b now weighs a's new claim whole: nothing of it is in any sample yet
    assert await b.restate(ENGINE, {}, SampleMark(PROCESS, 5000.0)) == 5


async def test_restated_claims_replace_and_released_ones_leave(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    a, b = replicas
    now = SampleMark(PROCESS, 1000.0)
    await b.restate(ENGINE, {"7": (30, 12), "8": (10, 0)}, now)
    assert await a.restate(ENGINE, {}, now) == 18 + 10
    # a later claim of the same member starts with nothing shown; a restate without a mark shows nothing either
    await b.claim(ENGINE, "7", 30, 1000, now)
    assert await a.restate(ENGINE, {}, now) == 30 + 10
    await b.restate(ENGINE, {"7": (30, 20)}, None)
    assert await a.restate(ENGINE, {}, now) == 30 + 10
    await b.restate(ENGINE, {"7": (30, 20)}, now, everything=True)  # "8" is no longer listed: it goes
    assert await a.restate(ENGINE, {}, now) == 10
    await b.restate(ENGINE, {"7": (0, 0)}, now)  # released
    assert await a.restate(ENGINE, {}, now) == 0
    assert await a.restate(ENGINE, {}, now) == 0


async def test_a_dead_replicas_claims_lapse_with_their_lease(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    a, b = replicas
    short = RedisEngineBooks(b.redis, lease_s=1.0)  # the same replica, with a lease a test can wait out
    now = SampleMark(PROCESS, 1000.0)
    await short.restate(ENGINE, {"9": (40, 16)}, now)
    await asyncio.sleep(1.5)  # b stopped restating (it died): its lease runs out
    assert await a.restate(ENGINE, {}, now) == 0
    await b.restate(ENGINE, {"9": (40, 16)}, now)  # and what a live replica restates is there again
    assert await a.restate(ENGINE, {}, now) == 24


async def test_requests_queued_longer_at_another_replica_go_first(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """The replicas' queues are served oldest first, as one queue: b's request that has waited 5 s counts as
    held for a's younger requests (its claim is refused if both do not fit), not for a's older ones; b's word
    is cleared when b's own claim is granted, and lapses if b stops restating."""
    a, b = replicas
    now = SampleMark(PROCESS, 1000.0)
    await b.restate(ENGINE, {"1": (30, 0)}, now, waiting=((5.0, 40, 1),))  # 30 blocks held, 40 wanted for 5 s
    assert await a.restate(ENGINE, {}, now) == 30 + 40  # as a request arriving at a now weighs it
    assert await a.restate(ENGINE, {}, now, waiting=((60.0, 8, 1),)) == 30  # a's own head waited longer
    assert await a.claim(ENGINE, "2", 10, 50, now, waited_s=1.0) == (False, 70)  # younger: b's 40 come first
    assert await a.claim(ENGINE, "3", 10, 50, now, waited_s=60.0) == (True, 30)  # older: it goes first
    assert await b.claim(ENGINE, "4", 40, 100, now, waited_s=5.0) == (True, 10)  # b's head admitted ...
    assert await a.restate(ENGINE, {"3": (10, 0)}, now) == 30 + 40  # ... and held as a claim, not as waiting
    short = RedisEngineBooks(b.redis, lease_s=60, waiting_ttl_s=0.5)  # b, with a word a test can outwait
    await short.restate(ENGINE, {"1": (30, 0), "4": (40, 0)}, now, everything=True, waiting=((2.0, 25, 1),))
    assert await a.restate(ENGINE, {"3": (10, 0)}, now) == 70 + 25
    await asyncio.sleep(1.0)  # b stopped restating: its queue's word lapses, its claims' leases do not yet
    assert await a.restate(ENGINE, {"3": (10, 0)}, now) == 70


async def test_weighed_whole_a_replicas_claims_count_at_its_peak_plus_what_it_claimed_since(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """A replica counts its own requests decoding in lockstep (their peak), and says that peak with every
    restate; the others weigh its claims so, plus any it made since, whole. A restate that lands after a newer
    one does not undo it. Weighed against a sample (exclusive_upstream off) claims stay whole less what the
    sample shows."""
    a, b = replicas
    now = SampleMark(PROCESS, 1000.0)
    await b.restate(ENGINE, {"1": (30, 0), "2": (40, 0)}, now, everything=True, peak=(5, 45), upto=2)
    assert await a.restate(ENGINE, {}, None) == 45
    assert await a.claim(ENGINE, "8", 10, 44, None) == (False, 45)
    assert await a.restate(ENGINE, {}, SampleMark(PROCESS, 999.0)) == 70  # weighed against a sample: whole
    assert await b.claim(ENGINE, "3", 10, 100, now) == (True, 0)  # claimed since: whole, on top of the peak
    assert await a.restate(ENGINE, {}, None) == 55
    await b.restate(ENGINE, {"2": (0, 0)}, now, peak=(7, 5), upto=3)  # 2 ended: 1 and 3 peak at 5 together
    assert await a.restate(ENGINE, {}, None) == 5
    await b.restate(ENGINE, {"1": (0, 0)}, now, peak=(6, 40), upto=3)  # taken before the one above, late
    assert await a.restate(ENGINE, {}, None) == 5


async def test_a_restate_taken_before_a_claim_and_landing_after_it_keeps_the_claim(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """A replica's restate lists its reservations as of one moment; a claim it makes after that moment may
    reach Redis first. The restate removes the replica's unlisted claims only up to the newest reservation it
    knew of: the later claim stays (else the other replicas would not see it until the next sample)."""
    a, b = replicas
    await b.restate(ENGINE, {"11": (30, 0), "12": (20, 0)}, None, everything=True, upto=12)
    assert await b.claim(ENGINE, "14", 25, 1000, None) == (True, 0)  # made after the restate below was taken
    await b.restate(ENGINE, {"12": (20, 0)}, None, everything=True, upto=13)  # 11 ended; it knew of up to 13
    assert await a.restate(ENGINE, {}, None) == 20 + 25
    await b.restate(ENGINE, {"12": (20, 0)}, None, everything=True, upto=14)  # 14 ended too
    assert await a.restate(ENGINE, {}, None) == 20


async def test_all_the_first_requests_of_another_replicas_queue_that_waited_longer_go_first(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """Not only the head: a replica admitting a burst into room it freed would take all of it but the head's
    share. Each of b's first queued requests that waited longer than a's counts as held; one of b's that is
    granted its claim leaves the queue b showed."""
    a, b = replicas
    await b.restate(ENGINE, {}, None, waiting=((5.0, 10, 1), (4.0, 20, 1), (1.0, 30, 1)))
    assert await a.claim(ENGINE, "1", 5, 100, None, waited_s=2.0) == (True, 10 + 20)
    assert await a.claim(ENGINE, "2", 5, 100, None, waited_s=4.5) == (True, 10)
    assert await a.claim(ENGINE, "3", 5, 29, None, waited_s=2.0) == (False, 30)
    assert await b.claim(ENGINE, "9", 10, 100, None, waited_s=5.0) == (True, 10)  # b's oldest: admitted
    assert await a.restate(ENGINE, {"1": (5, 0), "2": (5, 0)}, None) == 10 + 20 + 30  # its claim, and the rest


async def test_a_higher_class_at_another_replica_goes_first_and_a_lower_one_does_not(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """One queue across the replicas, in the order each serves its own: strict priority between classes,
    oldest first within one. b's sheddable request that has waited 30 s does not hold back a's critical
    arrival; b's critical one, however young, holds back a's standard request that waited longer."""
    a, b = replicas
    critical, standard, sheddable = 0, 1, 2
    await b.restate(ENGINE, {}, None, waiting=((30.0, 40, sheddable),))
    assert await a.claim(ENGINE, "1", 10, 39, None, waited_s=0.0, priority=critical) == (True, 0)
    assert await a.claim(ENGINE, "2", 10, 39, None, waited_s=0.0, priority=sheddable) == (False, 40)
    assert await a.restate(ENGINE, {"1": (10, 0)}, None, waiting=((1.0, 8, critical),)) == 0  # a's head: critical
    assert await a.restate(ENGINE, {"1": (10, 0)}, None, waiting=((1.0, 8, sheddable),)) == 40  # b's waited longer
    await b.restate(ENGINE, {}, None, waiting=((0.5, 30, critical), (30.0, 40, sheddable)))
    assert await a.claim(ENGINE, "3", 10, 29, None, waited_s=60.0, priority=standard) == (False, 30)
    assert await b.claim(ENGINE, "9", 30, 100, None, waited_s=0.5, priority=critical) == (True, 10)  # b's head in
    assert await a.claim(ENGINE, "4", 10, 100, None, waited_s=60.0, priority=standard) == (True, 30)  # a claim now


async def test_claims_whose_leases_were_evicted_do_not_count_forever(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """Under a maxmemory policy that evicts keys with a TTL, the leases key may go alone: the blocks it timed
    would then never expire, and every live replica's restate would keep renewing them. A claim without a lease
    is dropped when next weighed."""
    a, b = replicas
    now = SampleMark(PROCESS, 1000.0)
    await b.restate(ENGINE, {"9": (100, 0)}, now)
    assert await a.restate(ENGINE, {}, now) == 100
    leases, blocks = a.redis._engine_keys(ENGINE)[:2]
    await a.redis._client.delete(leases)  # evicted
    assert await a.claim(ENGINE, "1", 10, 50, now) == (True, 0)
    assert await a.redis._client.hkeys(blocks) == [f"{a.redis.replica_id}:1".encode()]
    await b.restate(ENGINE, {"9": (100, 0)}, now)  # a live replica's next restate puts its claim back
    assert await a.restate(ENGINE, {"1": (10, 0)}, now) == 100


async def test_expired_peaks_go_when_replicas_weigh_against_samples(redis_server: RedisServer) -> None:
    """Every replica started says its peak; weighed against samples (exclusive_upstream off) the peaks are not
    read, and expired ones still go, or each restart of a replica would add one for good."""
    states = [RedisState(RedisConfig(url=redis_server.url, timeout_s=0.5)) for _ in range(4)]
    for state in states:
        await state.start()
    try:
        now = SampleMark(PROCESS, 1000.0)
        for state in states[:3]:  # three replicas that say their peak, then die
            await RedisEngineBooks(state, lease_s=1.0).restate(ENGINE, {}, now, peak=(1, 5), upto=0)
        live = RedisEngineBooks(states[3], lease_s=60)
        peaks = states[3]._engine_keys(ENGINE)[4]
        assert await states[3]._client.hlen(peaks) == 3
        await asyncio.sleep(1.5)
        await live.restate(ENGINE, {}, now, peak=(1, 0), upto=0)
        assert await states[3]._client.hkeys(peaks) == [states[3].replica_id.encode() + b":"]
    finally:
        for state in states:
            await state.close()


async def test_a_shorter_lease_never_cuts_a_keys_life_short(
    replicas: tuple[RedisEngineBooks, RedisEngineBooks],
) -> None:
    """Replicas of two configurations (a rolling update): the one with the shorter lease renews the engine's
    keys without shortening the life the longer lease gave them."""
    a, b = replicas  # 60 s leases
    now = SampleMark(PROCESS, 1000.0)
    await b.restate(ENGINE, {"9": (40, 0)}, now)
    short = RedisEngineBooks(a.redis, lease_s=2.0)
    await short.restate(ENGINE, {"1": (10, 0)}, now)
    for key in a.redis._engine_keys(ENGINE)[:2]:
        assert await a.redis._client.pttl(key) > 100_000  # what b's 60 s lease gave it, not 4 s
