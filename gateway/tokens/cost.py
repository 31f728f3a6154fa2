"""Cost estimation: how many KV blocks a request can occupy at its peak.

vLLM allocates KV memory in fixed-size blocks of ``block_size`` tokens per sequence. A sequence's peak is
``ceil((prompt + output) / block_size)`` blocks; ``n`` (or ``best_of``) sequences each hold their own. When a
request gives no ``max_tokens``, vLLM lets it run to ``max_model_len``, so that is what we reserve.

This module is pure arithmetic: token *counting* happens in :mod:`gateway.tokens.tokenizers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.protocol.errors import GatewayError, bad_request, context_length_exceeded


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """The engine's KV pool, read from ``vllm:cache_config_info`` (or the config's overrides)."""

    block_size: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class RequestCost:
    """What one request may occupy: ``sequences`` copies of each prompt, each growing by ``max_output``."""

    prompt_tokens: tuple[int, ...]
    sequences_per_prompt: int
    max_output: int
    blocks: int

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens) * self.sequences_per_prompt

    @property
    def total_tokens(self) -> int:
        """Prompt plus reserved output over all sequences: what token rate limits charge."""
        return self.total_prompt_tokens + self.max_output * self.num_sequences

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_tokens) * self.sequences_per_prompt

    def blocks_after(self, generated_total: int, block_size: int) -> int:
        """Blocks held once ``generated_total`` tokens (over all sequences) have been produced."""
        per_seq = min(self.max_output, generated_total // max(1, self.num_sequences))
        return self.sequences_per_prompt * sum(blocks_for(p + per_seq, block_size) for p in self.prompt_tokens)


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def output_budget(max_tokens: int | None, prompt_tokens: int, max_model_len: int | None) -> int:
    """Tokens to reserve for the output of one sequence (vLLM's default when max_tokens is absent)."""
    if max_tokens is not None:
        return max_tokens
    if max_model_len is None:
        raise bad_request(
            "max_tokens is required: the gateway does not know the model's max_model_len", param="max_tokens"
        )
    return max(0, max_model_len - prompt_tokens)


def estimate_cost(
    prompt_tokens: tuple[int, ...],
    *,
    max_tokens: int | None,
    sequences_per_prompt: int,
    max_model_len: int | None,
    geometry: KvGeometry,
    high_watermark: float,
) -> RequestCost:
    """Turn token counts into a block reservation, rejecting what the engine could never serve."""
    longest = max(prompt_tokens, default=0)
    output = output_budget(max_tokens, longest, max_model_len)
    if max_model_len is not None and longest + output > max_model_len:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest + output} tokens ({longest} in the messages, {output} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    blocks = sequences_per_prompt * sum(blocks_for(p + output, geometry.block_size) for p in prompt_tokens)
    ceiling = math.floor(high_watermark * geometry.num_blocks)
    if blocks > ceiling:
        raise GatewayError(
            400,
            f"This request needs {blocks} KV-cache blocks ({sum(prompt_tokens)} prompt tokens, "
            f"{output} output tokens x {sequences_per_prompt} sequence(s), block size {geometry.block_size}), "
            f"but at most {ceiling} of the engine's {geometry.num_blocks} blocks may be in use (high watermark "
            f"{high_watermark:.2f}). Reduce max_tokens, n or the prompt.",
            param="max_tokens",
            code="kv_cache_capacity_exceeded",
        )
    return RequestCost(prompt_tokens, sequences_per_prompt, output, blocks)
