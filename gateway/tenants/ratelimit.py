"""Rate limits: requests and tokens per minute per tenant, as token buckets. Pure: time comes in as ``now``.

Tokens are charged at admission for the prompt plus the reserved output, then settled against the
response's ``usage`` (unused reservation is refunded), so a tenant is not billed for ``max_tokens`` it never
generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class TokenBucket:
    """``capacity`` units that refill continuously at ``capacity / period_s`` per second."""

    def __init__(self, capacity: float, period_s: float, now: float) -> None:
        self.capacity = capacity
        self.period_s = period_s
        self.rate = capacity / period_s
        self.level = capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def available(self, now: float) -> float:
        self._refill(now)
        return self.level

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0 if it is now); inf if it never fits."""
        self._refill(now)
        if amount <= self.level:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def refund(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def resize(self, capacity: float, now: float) -> None:
        """A reloaded limit: keep what was used, at the new capacity and rate."""
        self._refill(now)
        used = self.capacity - self.level
        self.capacity = capacity
        self.rate = capacity / self.period_s
        # what was used carries over, down to 0; below 0, only a debt there was (a cut limit is no new debt)
        self.level = min(capacity, max(min(self.level, 0.0), capacity - used))

    def reset_after(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self._refill(now)
        return (self.capacity - self.level) / self.rate


@dataclass(frozen=True, slots=True)
class LimitState:
    """What the ``x-ratelimit-*`` headers report for one dimension (requests or tokens)."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float
    requests: LimitState | None
    tokens: LimitState | None
    exceeded: str | None = None


@dataclass(frozen=True, slots=True)
class RateLimits:
    """The per-minute rate limits of one bucket key (None = unlimited)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)

    def scaled(self, divisor: int) -> RateLimits:
        """This replica's share when the shared counters are out of reach (fail-open)."""
        return RateLimits(_share(self.requests_per_minute, divisor), _share(self.tokens_per_minute, divisor))


def token_charge(full: int, least: int, rates: RateLimits, limits: RateLimits | None = None) -> int | None:
    """What a request pre-charges against ``rates``' tokens per minute: ``full`` (its prompt and its whole
    output budget), or a minute's allowance when that is less. A chat without max_tokens has the rest of the
    context as its budget, more than many a tenant's minute: it waits for a whole minute's allowance rather
    than never being let in, and what it uses beyond the charge is taken at settle (the bucket goes into debt,
    so the tenant's next requests wait it off). None: ``least`` (what it is billed whatever it generates) is
    more than a minute of ``limits`` (the tenant's own; ``rates`` may be a replica's share of them while Redis
    is down), so no wait would ever let it in."""
    limit = (limits or rates).tokens_per_minute
    if limit and least > limit:
        return None
    cap = rates.tokens_per_minute
    return min(full, cap) if cap else full


def _share(limit: int | None, divisor: int) -> int | None:
    return None if limit is None else max(1, math.ceil(limit / divisor))


class RateLimiter:
    """In-process token buckets by key (a tenant, or a tenant and a model with its own limits)."""

    def __init__(self) -> None:
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _bucket(self, table: dict[str, TokenBucket], key: str, capacity: int | None, now: float) -> TokenBucket | None:
        if not capacity:
            table.pop(key, None)
            return None
        bucket = table.get(key)
        if bucket is None:
            bucket = table[key] = TokenBucket(capacity, 60.0, now)
        elif bucket.capacity != capacity:
            bucket.resize(capacity, now)
        return bucket

    def check(self, key: str, tokens: int, now: float, rates: RateLimits) -> RateDecision:
        """Charge one request and ``tokens`` if both fit; else charge nothing and say how long to wait."""
        req_bucket = self._bucket(self._requests, key, rates.requests_per_minute, now)
        tok_bucket = self._bucket(self._tokens, key, rates.tokens_per_minute, now)
        req_wait = req_bucket.wait_for(1, now) if req_bucket else 0.0
        tok_wait = tok_bucket.wait_for(tokens, now) if tok_bucket else 0.0
        allowed = req_wait == 0.0 and tok_wait == 0.0
        exceeded = None
        if allowed:
            if req_bucket:
                req_bucket.take(1, now)
            if tok_bucket:
                tok_bucket.take(tokens, now)
        else:
            exceeded = "requests" if req_wait >= tok_wait else "tokens"
        return RateDecision(
            allowed,
            max(req_wait, tok_wait),
            _state(req_bucket, now),
            _state(tok_bucket, now),
            exceeded,
        )

    def settle(self, key: str, charged: int, actual: int, now: float, request: bool = True) -> None:
        """Refund the part of the pre-charge the request did not use, or take what it used beyond (a charge
        cut to a minute's allowance: see :func:`token_charge`; the bucket goes below zero), and refund the
        request itself when it never counted (``request`` False: kvgate turned it away before the engine saw
        it)."""
        tok_bucket = self._tokens.get(key)
        if tok_bucket and actual < charged:
            tok_bucket.refund(charged - actual, now)
        elif tok_bucket and actual > charged:
            tok_bucket.take(actual - charged, now)
        req_bucket = self._requests.get(key)
        if req_bucket and not request:
            req_bucket.refund(1, now)


def _state(bucket: TokenBucket | None, now: float) -> LimitState | None:
    if bucket is None:
        return None
    return LimitState(int(bucket.capacity), max(0, math.floor(bucket.available(now))), bucket.reset_after(now))


def ratelimit_headers(decision: RateDecision) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers for whichever dimensions the tenant is limited on."""
    headers = []
    for kind, state in (("requests", decision.requests), ("tokens", decision.tokens)):
        if state is None:
            continue
        headers += [
            (f"x-ratelimit-limit-{kind}".encode(), str(state.limit).encode()),
            (f"x-ratelimit-remaining-{kind}".encode(), str(state.remaining).encode()),
            (f"x-ratelimit-reset-{kind}".encode(), f"{state.reset_s:.3f}s".encode()),
        ]
    return headers
