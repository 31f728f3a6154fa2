"""The cost step of the request path: count a parsed request's prompt tokens, then price it in KV blocks
against what is known of the engine right now (its geometry, its context length)."""

from __future__ import annotations

from collections.abc import Callable

from gateway.protocol.errors import GatewayError
from gateway.protocol.requests import InferenceRequest
from gateway.tokens.cost import KvGeometry, RequestCost, estimate_cost
from gateway.tokens.counting import TokenCounter


class CostEstimator:
    """``counter`` may be swapped while serving (``--tokenizer auto`` resolves once the engine has answered)."""

    def __init__(
        self,
        counter: TokenCounter,
        *,
        geometry: Callable[[], KvGeometry | None],
        max_model_len: Callable[[], int | None],
        high_watermark: float,
    ) -> None:
        self.counter = counter
        self._geometry = geometry
        self._max_model_len = max_model_len
        self._high_watermark = high_watermark

    async def estimate(self, request: InferenceRequest) -> RequestCost:
        geometry = self._geometry()
        if geometry is None:
            raise GatewayError(
                503,
                "The gateway does not know the engine's KV-cache size yet (no vllm:cache_config_info scraped).",
                type="service_unavailable",
                code="upstream_not_ready",
                retry_after_s=1.0,
            )
        prompt_tokens = await self.counter.count(request)
        return estimate_cost(
            prompt_tokens,
            max_tokens=request.max_tokens,
            sequences_per_prompt=request.sequences_per_prompt,
            max_model_len=self._max_model_len(),
            geometry=geometry,
            high_watermark=self._high_watermark,
            min_tokens=request.min_tokens,
        )
