import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import AuthConfig, TenantConfig
from gateway.protocol.errors import GatewayError
from gateway.tenants.auth import TenantDirectory, key_digest
from gateway.tenants.ratelimit import RateLimiter, RateLimits, TokenBucket, ratelimit_headers, token_charge
from gateway.tokens.cost import RequestCost


def test_requests_per_minute() -> None:
    rl, a = RateLimiter(), RateLimits(requests_per_minute=2)
    assert rl.check("a", 10, 0.0, a).allowed and rl.check("a", 10, 0.0, a).allowed
    third = rl.check("a", 10, 0.0, a)
    assert not third.allowed and third.exceeded == "requests" and third.retry_after_s == pytest.approx(30.0)
    assert rl.check("a", 10, 30.0, a).allowed
    assert rl.check("unlimited", 10**9, 0.0, RateLimits()).allowed


def test_tokens_are_refunded_on_settle() -> None:
    rl, a = RateLimiter(), RateLimits(tokens_per_minute=1000)
    assert rl.check("a", 800, 0.0, a).allowed
    assert not rl.check("a", 800, 0.0, a).allowed
    rl.settle("a", charged=800, actual=100, now=0.0)
    assert rl.check("a", 800, 0.0, a).allowed


def test_a_request_turned_away_before_the_engine_gives_its_request_back() -> None:
    """Refused by the queue (or its client gone) before the engine saw it: the request does not count
    against requests per minute, so a client retrying after kvgate's own Retry-After is not then refused by
    its rate limit."""
    rl, a = RateLimiter(), RateLimits(requests_per_minute=1, tokens_per_minute=1000)
    assert rl.check("a", 100, 0.0, a).allowed
    rl.settle("a", charged=100, actual=0, now=0.0, request=False)
    assert rl.check("a", 100, 0.0, a).allowed  # the one request a minute is still there
    rl.settle("a", charged=100, actual=100, now=0.0)  # this one reached the engine
    assert not rl.check("a", 100, 0.0, a).allowed


def test_never_fits() -> None:
    d = RateLimiter().check("a", 101, 0.0, RateLimits(tokens_per_minute=100))
    assert not d.allowed and math.isinf(d.retry_after_s)


def test_headers() -> None:
    decision = RateLimiter().check("a", 40, 0.0, RateLimits(requests_per_minute=10, tokens_per_minute=100))
    headers = dict(ratelimit_headers(decision))
    assert headers[b"x-ratelimit-limit-requests"] == b"10"
    assert headers[b"x-ratelimit-remaining-requests"] == b"9"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"60"
    assert headers[b"x-ratelimit-reset-tokens"] == b"24.000s"


@given(st.lists(st.tuples(st.floats(0, 10), st.integers(0, 50)), max_size=50))
def test_bucket_never_exceeds_capacity_or_goes_negative(steps: list[tuple[float, int]]) -> None:
    b = TokenBucket(100, 60.0, 0.0)
    now = 0.0
    for dt, amount in steps:
        now += dt
        if b.wait_for(amount, now) == 0:
            b.take(amount, now)
        assert 0 <= b.available(now) <= 100


def test_auth_plain_and_hashed_keys() -> None:
    d = TenantDirectory(AuthConfig(), [TenantConfig(name="a", api_keys=["k1", "sha256:" + key_digest("k2")])])
    assert d.authenticate(b"Bearer k1") == "a" and d.authenticate(b"Bearer k2") == "a"
    assert d.authenticate(None) == "default"
    with pytest.raises(GatewayError) as err:
        d.authenticate(b"Bearer wrong")
    assert err.value.status == 401
    # an empty Bearer (a client's unset key variable), or another scheme (an ingress's Basic auth passed on): no
    # key, so anonymous while keys are optional
    for sent in (b"Bearer", b"Bearer ", b"Basic azE6"):
        assert d.authenticate(sent) == "default", sent


def test_auth_required() -> None:
    d = TenantDirectory(AuthConfig(require_api_key=True), [TenantConfig(name="a", api_keys=["k1"])])
    with pytest.raises(GatewayError) as err:
        d.authenticate(None)
    assert err.value.status == 401 and err.value.code == "missing_api_key"


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.one_of(st.none(), st.integers(1, 10**6)))
def test_a_charge_is_the_whole_budget_or_a_minutes_allowance_never_more(full: int, least: int, tpm: int | None) -> None:
    """What fits in a minute is charged whole; what does not is charged the minute (a budget it may not use),
    unless even what it takes whatever it generates does not fit: then nothing, it can never be let in."""
    least = min(least, full)
    charge = token_charge(full, least, RateLimits(tokens_per_minute=tpm))
    if tpm is None or full <= tpm:
        assert charge == full
    elif least <= tpm:
        assert charge == tpm
    else:
        assert charge is None


def test_what_a_request_is_billed_whatever_it_generates() -> None:
    """As vLLM's usage counts it: each prompt once (as counted: not an estimate's high end, nor a media
    allowance), and the output each sequence must produce: min_tokens, or all of its budget under ignore_eos
    (a floor past the budget)."""
    assert RequestCost((100,), 1, 4000, 0).least_charge_tokens == 100
    assert RequestCost((100,), 1, 4000, 0, min_output=50).least_charge_tokens == 150
    assert RequestCost((100,), 1, 300, 0, min_output=2**31 - 1).least_charge_tokens == 400
    assert RequestCost((100, 20), 2, 300, 0, min_output=10, prompt_high=(120, 30)).least_charge_tokens == 160
    assert RequestCost((3000,), 4, 100, 0).least_charge_tokens == 3000  # n=4: the prompt is billed once
    assert RequestCost((900,), 1, 100, 0, media_tokens=800).least_charge_tokens == 100


def test_a_charge_cut_to_a_minutes_allowance_takes_what_it_used_beyond_as_a_debt() -> None:
    """What a request used beyond its (cut) charge is taken when it settles: the bucket goes below zero and
    the tenant's next requests wait until it is paid off, so a large budget is no way around the limit."""
    limiter = RateLimiter()
    rates = RateLimits(tokens_per_minute=1000)
    charged = token_charge(5000, 100, rates)
    assert charged == 1000 and limiter.check("k", charged, 0.0, rates).allowed
    limiter.settle("k", charged, 3000, 0.0)  # 2,000 more than charged
    refused = limiter.check("k", 10, 0.0, rates)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(120.6)  # 2,010 at 1,000 a minute
    resized = RateLimits(tokens_per_minute=2000)  # a reload doubles the limit: the debt is not forgiven
    assert limiter.check("k", 10, 0.0, resized).retry_after_s == pytest.approx(30.3)  # 1,010 at 2,000 a minute
    assert limiter.check("k", 10, 121.0, rates).allowed
    cut = RateLimiter()  # a reload that cuts the limit makes no debt of what was used within the old one
    assert cut.check("k", 900, 0.0, rates).allowed
    assert cut.check("k", 10, 0.0, RateLimits(tokens_per_minute=100)).retry_after_s == pytest.approx(6.0)
