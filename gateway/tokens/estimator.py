"""The cost step of the request path: count a parsed request's prompt tokens, then price it in KV blocks
against what is known of the engine right now (its geometry, its context length).

Counting text exactly is the most expensive thing kvgate does for a request, and it matters only near a limit.
So a text request is first checked at the high end of its learned token band
(:mod:`gateway.tokens.prompt_estimate`); if that passes the context and never-fits checks, so would the exact
count (both checks only get stricter as the prompt grows), and the tokenizer is skipped. The request then
reserves a quantile of the learned ratio (0.7 by default: ~3% above the median on mixed English text and
READMEs with Llama 3's tokenizer, and over 64 such prompts at least 0.98 of their true total in 2,000 draws),
not the band's high end (1.5-2x the median there): the error of one prompt does not matter, the sum's does, and
the engine's sampled usage and the watermark's margin cover it. A prompt whose band is wide enough that its
error alone could eat that margin (more than ``MAX_ERROR_SHARE`` of the pool) is counted, as is anything near
a limit. Token-id prompts are exact and free either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest
from gateway.tokens.cost import KvGeometry, RequestCost, estimate_cost
from gateway.tokens.counting import TokenCounter
from gateway.tokens.prompt_estimate import EstimateErrors, PromptLengths, key_of, prompt_sizes

MAX_ERROR_SHARE = 0.01  # of the pool's tokens: a prompt whose band is wider than this is counted exactly


@dataclass(slots=True)
class PricingTally:
    """How requests were priced (plain counters, monotonic), and how good the estimate is."""

    by_estimate: int = 0  # text priced by its learned estimate: tokenizer skipped
    by_tokenizer: int = 0  # text counted: fast path off, not learned yet, not estimable, or near a limit
    by_token_ids: int = 0  # token-id prompts: exact and free
    near_limit: int = 0  # of by_tokenizer: the band's high end failed a check, or its band is too wide
    errors: EstimateErrors = field(default_factory=EstimateErrors)  # actual / estimated, from learn()


class CostEstimator:
    """``counter`` may be swapped while serving (``--tokenizer auto`` resolves once the engine has answered).

    ``fast_path`` skips the tokenizer for text whose band decides like an exact count would, once
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
        reserve_quantile: float = 0.7,
        max_error_share: float = MAX_ERROR_SHARE,
        lengths: PromptLengths | None = None,
    ) -> None:
        self.counter = counter
        self._geometry = geometry
        self._max_model_len = max_model_len
        self._high_watermark = high_watermark
        self.fast_path = fast_path
        self.reserve_quantile = reserve_quantile
        self.max_error_share = max_error_share
        self.lengths = lengths if lengths is not None else PromptLengths()
        self.tally = PricingTally()

    async def estimate(self, request: InferenceRequest, *, exact: bool = False) -> RequestCost:
        """The request's cost. Priced by estimate it decides every limit as exact counting would, reserves a
        quantile of the learned ratio (in sum over many requests above their truth) and carries the band's high
        end for token charges;
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
        text prompt teaches (every chat; a batch's usage sums its prompts, and token ids need no estimate). With
        the heuristic counting, whose count is itself an estimate, nothing uses what would be learned."""
        if self.counter.kind == "heuristic":
            return
        sizes = prompt_sizes(request)
        if sizes is None or len(sizes) != 1 or prompt_tokens <= 0:
            return
        key = key_of(request)
        if self.lengths.learned(key):
            self.tally.errors.record(prompt_tokens, self.lengths.band(key, sizes[0]))
        self.lengths.observe(key, sizes[0], prompt_tokens)

    def _by_estimate(self, request: InferenceRequest, geometry: KvGeometry) -> RequestCost | None:
        """Checked at the band's high end and priced at the reserve quantile; None when the high end fails a
        check or the band is too wide for the pool: then only a count decides."""
        key = key_of(request)
        sizes = prompt_sizes(request) if self.lengths.learned(key) else None
        if sizes is None:
            return None
        highs = tuple(self.lengths.band(key, size).high for size in sizes)
        reserved = tuple(self.lengths.reserved(key, size, self.reserve_quantile) for size in sizes)
        error_tokens = (sum(highs) - sum(reserved)) * request.sequences_per_prompt
        try:
            self._price(request, highs, geometry)  # every limit holds at the high end: it holds for the truth
        except GatewayError:
            self.tally.near_limit += 1
            return None
        if error_tokens > self.max_error_share * geometry.num_blocks * geometry.block_size:
            self.tally.near_limit += 1
            return None
        return dataclasses.replace(self._price(request, reserved, geometry), prompt_high=highs)

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
