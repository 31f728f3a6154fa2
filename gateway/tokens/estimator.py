"""The cost step of the request path: count a parsed request's prompt tokens, then price it in KV blocks
against what is known of the engine right now (its geometry, its context length).

Counting text exactly is the most expensive thing kvgate does for a request, and it matters only near a limit.
So a text request is first priced at the high end of its learned token band
(:mod:`gateway.tokens.prompt_estimate`); if that passes the context and never-fits checks, so would the exact
count (both checks only get stricter as the prompt grows), and the tokenizer is skipped. Otherwise it is
counted as before. Token-id prompts are exact and free either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest
from gateway.tokens.cost import KvGeometry, RequestCost, estimate_cost
from gateway.tokens.counting import TokenCounter
from gateway.tokens.prompt_estimate import EstimateErrors, PromptLengths, key_of, prompt_sizes


@dataclass(slots=True)
class PricingTally:
    """How requests were priced (plain counters, monotonic), and how good the estimate is."""

    by_estimate: int = 0  # text priced at its band's high end: tokenizer skipped
    by_tokenizer: int = 0  # text counted: fast path off, not learned yet, not estimable, or near a limit
    by_token_ids: int = 0  # token-id prompts: exact and free
    near_limit: int = 0  # of by_tokenizer: the band's high end failed a check, so the exact count decided
    errors: EstimateErrors = field(default_factory=EstimateErrors)  # actual / estimated, from learn()


class CostEstimator:
    """``counter`` may be swapped while serving (``--tokenizer auto`` resolves once the engine has answered).

    ``fast_path`` (default on) skips the tokenizer for text whose band decides like an exact count would, once
    the request's (model, endpoint) has learned from ``lengths.min_samples`` served requests; until then
    every text request is counted. The prior alone would decide safely too (one token per byte is more than
    a byte-level tokenizer makes), but pricing at it would reserve up to 4x the prompt for the first requests
    of a burst, so it is only a fallback answer, never a price. With the ``heuristic`` tokenizer the count is
    itself an estimate and cheap: no fast path."""

    def __init__(
        self,
        counter: TokenCounter,
        *,
        geometry: Callable[[], KvGeometry | None],
        max_model_len: Callable[[], int | None],
        high_watermark: float,
        fast_path: bool = True,
        lengths: PromptLengths | None = None,
    ) -> None:
        self.counter = counter
        self._geometry = geometry
        self._max_model_len = max_model_len
        self._high_watermark = high_watermark
        self.fast_path = fast_path
        self.lengths = lengths if lengths is not None else PromptLengths()
        self.tally = PricingTally()

    async def estimate(self, request: InferenceRequest, *, exact: bool = False) -> RequestCost:
        """The request's cost. Priced by estimate it is never smaller than exact counting would make it;
        ``exact=True`` counts anyway (e.g. to re-price a request a tenant's token budget would refuse)."""
        geometry = self._geometry()
        if geometry is None:
            raise GatewayError(
                503,
                "The gateway does not know the engine's KV-cache size yet (no vllm:cache_config_info scraped).",
                type="service_unavailable",
                code="upstream_not_ready",
                retry_after_s=1.0,
            )
        token_ids = request.endpoint == "completions" and all(isinstance(p, list) for p in request.prompts)
        if not (token_ids or exact) and self.fast_path and self.counter.kind != "heuristic":
            cost = self._by_estimate(request, geometry)
            if cost is not None:
                self.tally.by_estimate += 1
                return cost
        prompt_tokens = await self.counter.count(request)
        if token_ids:
            self.tally.by_token_ids += 1
        else:
            self.tally.by_tokenizer += 1
        return self._price(request, prompt_tokens, geometry)

    def learn(self, request: InferenceRequest, prompt_tokens: int) -> None:
        """What the engine counted (``usage.prompt_tokens``) for a request it served. Only a request with one
        text prompt teaches (every chat; a batch's usage sums its prompts, and token ids need no estimate)."""
        sizes = prompt_sizes(request)
        if sizes is None or len(sizes) != 1 or prompt_tokens <= 0:
            return
        key = key_of(request)
        if self.lengths.learned(key):
            self.tally.errors.record(prompt_tokens, self.lengths.band(key, sizes[0]))
        self.lengths.observe(key, sizes[0], prompt_tokens)

    def _by_estimate(self, request: InferenceRequest, geometry: KvGeometry) -> RequestCost | None:
        """Priced at the band's high end, or None when that end fails a check: then only a count decides."""
        key = key_of(request)
        sizes = prompt_sizes(request) if self.lengths.learned(key) else None
        if sizes is None:
            return None
        try:
            return self._price(request, tuple(self.lengths.band(key, size).high for size in sizes), geometry)
        except GatewayError:
            self.tally.near_limit += 1
            return None

    def _price(self, request: InferenceRequest, prompt_tokens: tuple[int, ...], geometry: KvGeometry) -> RequestCost:
        return estimate_cost(
            prompt_tokens,
            max_tokens=request.max_tokens,
            sequences_per_prompt=request.sequences_per_prompt,
            max_model_len=self._max_model_len(),
            geometry=geometry,
            high_watermark=self._high_watermark,
            min_tokens=request.min_tokens,
        )
