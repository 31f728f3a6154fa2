"""Queueing that serves the client's deadline: refuse at once what could not be admitted within its wait
budget, refuse a queued request as soon as its wait is known to slip past it, and take the budget from the
client when it says so."""

from __future__ import annotations

from gateway.admission.controller import (
    HONOURED_RETRY_AFTER_S,
    AdmissionController,
    Admitted,
    Queued,
    Rejected,
    UsageSample,
)
from gateway.admission.queue import QueueClass
from gateway.config import AdmissionConfig
from gateway.server.hints import ClientHints, client_hints
from gateway.tenants.policy import TenantPolicy
from gateway.tenants.ratelimit import RateLimits
from gateway.tokens.cost import KvGeometry, RequestCost

GEO = KvGeometry(block_size=16, num_blocks=100)


def full_engine(finished_per_s: float | None) -> AdmissionController:
    """An engine whose pool is taken, that has finished requests at ``finished_per_s`` (None: none yet)."""
    c = AdmissionController(AdmissionConfig(), GEO)
    c.begin_sample()
    c.apply_sample(UsageSample(0.0, 0.0))
    blocker = c.submit(RequestCost((16,), 1, 1424, 90), "x", 0.0)
    assert isinstance(blocker, Admitted)
    if finished_per_s is not None:
        for i in range(10):
            c.drain.record(10.0 + i / finished_per_s)
    return c


def small() -> RequestCost:
    return RequestCost((16,), 1, 144, 10)


def test_a_request_that_cannot_be_admitted_in_time_is_refused_at_once() -> None:
    c = full_engine(finished_per_s=1.0)
    now = 20.0
    for _ in range(5):
        assert isinstance(c.submit(small(), "t", now, max_wait_s=30.0), Queued)
    refused = c.submit(small(), "t", now, max_wait_s=3.0)  # 6th in line at ~1/s: ~6 s > 3 s
    assert isinstance(refused, Rejected) and refused.reason == "queue_wait_predicted"
    assert 5.0 <= refused.retry_after_s <= 7.0 and len(c.queue) == 5  # Retry-After: when the line is gone
    assert isinstance(c.submit(small(), "t", now, max_wait_s=30.0), Queued)  # a patient one still queues


def test_a_retry_that_followed_its_retry_after_is_not_sent_to_the_back_of_the_line() -> None:
    """Refused with a Retry-After, the client comes back to a line that filled up again meanwhile: as a retry it
    queues ahead of its tenant's first attempts and is admitted in time; a first attempt is refused at once."""
    c = full_engine(finished_per_s=1.0)
    now = 20.0
    for _ in range(5):
        assert isinstance(c.submit(small(), "t", now, max_wait_s=30.0), Queued)
    assert isinstance(c.submit(small(), "t", now, max_wait_s=3.0), Rejected)
    retried = c.submit(small(), "t", now, max_wait_s=3.0, retry=True)
    assert isinstance(retried, Queued) and retried.position == 1 and retried.ticket.eta_s == retried.eta_s
    assert [t.retry for t in c.queue.in_order()] == [True, False, False, False, False, False]


def test_without_a_trusted_finish_rate_nobody_is_refused_early() -> None:
    c = full_engine(finished_per_s=None)
    for _ in range(20):
        assert isinstance(c.submit(small(), "t", 0.0, max_wait_s=0.5), Queued)
    assert c.hopeless(0.1) == []


def test_a_queued_request_whose_wait_slips_past_its_budget_is_refused_when_known() -> None:
    c = full_engine(finished_per_s=2.0)
    now = 15.0
    early = [c.submit(small(), "t", now, max_wait_s=20.0) for _ in range(4)]
    late = c.submit(small(), "t", now, max_wait_s=20.0)
    assert all(isinstance(d, Queued) for d in [*early, late])
    assert c.hopeless(now) == []
    # the engine slows down: 8 finished over the last ~29 s, about 0.28/s
    c.drain._events.clear()
    for t in range(1, 30, 4):
        c.drain.record(float(t))
    doomed = c.hopeless(30.0)
    # first in line: ~3.6 s more, before its deadline at 35 s; second: ~7.2 s, past it; and so on
    assert [t for t, _, _ in doomed] == [d.ticket for d in [*early[1:], late] if isinstance(d, Queued)]
    assert all(30.0 + predicted > t.deadline for t, predicted, _ in doomed)
    assert len(c.queue) == 1


def test_the_wait_budget_is_the_clients_when_it_says_so() -> None:
    assert client_hints([(b"x-stainless-read-timeout", b"600")]).wait_s == 599.0  # answered before it gives up
    assert client_hints([(b"x-kvgate-max-wait-s", b"12.5"), (b"x-stainless-read-timeout", b"600")]).wait_s == 12.5
    assert client_hints([(b"x-stainless-read-timeout", b"nan")]).wait_s is None
    assert client_hints([]) == ClientHints(None, retry=False)
    assert client_hints([(b"x-stainless-retry-count", b"0")]).retry is False  # the SDK's first attempt
    assert client_hints([(b"x-stainless-retry-count", b"2"), (b"x-kvgate-max-wait-s", b"5")]) == ClientHints(5.0, True)
    capped = TenantPolicy("t", "t", RateLimits(), None, 10.0, QueueClass(), wait_cap_s=10.0)
    free = TenantPolicy("t", "t", RateLimits(), None, 120.0, QueueClass())
    assert capped.wait_budget(599.0) == 10.0 and capped.wait_budget(None) == 10.0
    assert free.wait_budget(599.0) == 599.0 and free.wait_budget(None) == 120.0
    assert free.wait_budget(1e9) == 600.0  # no client queues longer than the SDKs' own default timeout


def test_refused_clients_are_told_to_come_back_one_finish_apart_and_first_attempts_count_them() -> None:
    """Three refused at once at ~1 finish/s are booked to come back ~1 s apart (not all together); a first
    attempt that arrives meanwhile counts those returns, which will queue ahead of it, and is refused at once
    with a return after theirs; a retry does not count them."""
    c = full_engine(finished_per_s=1.0)
    now = 20.0
    for _ in range(5):
        assert isinstance(c.submit(small(), "t", now, max_wait_s=30.0), Queued)
    refusals = [c.submit(small(), "t", now, max_wait_s=3.0) for _ in range(3)]
    afters = [r.retry_after_s for r in refusals if isinstance(r, Rejected)]
    assert len(afters) == 3 and afters[1] - afters[0] == afters[2] - afters[1] and 0.9 <= afters[1] - afters[0] <= 1.2
    assert len(c.returns) == 3 and c.returns.due(now, now + afters[2]) == 3
    while len(c.queue) > 1:  # the line drains to one: alone, a first attempt would wait ~2 s < 3 s
        c.queue.pop()
    late = c.submit(small(), "t", now + afters[0] - 1.0, max_wait_s=3.0)  # but three will be back before it is in
    assert isinstance(late, Rejected) and late.reason == "queue_wait_predicted"
    assert late.retry_after_s > afters[2] - afters[0] + 1.0  # booked after the three
    assert isinstance(c.submit(small(), "t", now + afters[0], max_wait_s=3.0, retry=True), Queued)
    c.returns.forget(now + 1000.0)
    assert len(c.returns) == 0


def test_another_tenants_returns_do_not_stand_ahead_of_a_first_attempt() -> None:
    """A retry goes ahead of its own tenant's first attempts only: tenant b's first attempt, which would be
    admitted in time, is not refused for the returns booked for tenant a's refused clients."""
    c = full_engine(finished_per_s=1.0)
    now = 20.0
    assert isinstance(c.submit(small(), "a", now, max_wait_s=30.0), Queued)
    refusals = [c.submit(small(), "a", now, max_wait_s=0.5) for _ in range(5)]
    assert all(isinstance(r, Rejected) for r in refusals) and len(c.returns) == 5
    assert isinstance(c.submit(small(), "b", now, max_wait_s=2.5), Queued)  # ~2 s behind a's one queued
    assert isinstance(c.submit(small(), "a", now, max_wait_s=2.5), Rejected)  # a's own returns come first


def test_a_return_later_than_the_sdk_waits_is_told_but_not_booked() -> None:
    """At one finish every two seconds, a line of 80 is ~160 s long: the OpenAI SDK does not wait past 120 s (it
    gives up), so that client is not expected back and first attempts do not count it ahead of them."""
    c = full_engine(finished_per_s=0.5)
    now = 30.0
    for _ in range(80):
        assert isinstance(c.submit(small(), "t", now, max_wait_s=600.0), Queued)
    far = c.submit(small(), "t", now, max_wait_s=3.0)
    assert isinstance(far, Rejected) and far.retry_after_s > HONOURED_RETRY_AFTER_S
    assert len(c.returns) == 0
    while len(c.queue) > 20:  # a line of ~40 s: this one is booked
        c.queue.pop()
    near = c.submit(small(), "t", now, max_wait_s=3.0)
    assert isinstance(near, Rejected) and near.retry_after_s <= HONOURED_RETRY_AFTER_S and len(c.returns) == 1
