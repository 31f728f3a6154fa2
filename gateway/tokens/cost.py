"""Cost estimation: how many KV blocks a request can occupy at its peak.

vLLM allocates KV memory in fixed-size blocks of ``block_size`` tokens per sequence. A sequence's peak is
``ceil((prompt + output) / block_size)`` blocks; ``n`` sequences each hold their own. Each
prompt's output budget is vLLM's own (``get_max_tokens``): the request's ``max_tokens`` (or the route's default,
16 for completions, none for chat), never more than ``max_model_len`` minus that prompt. A request whose
``max_tokens`` runs past the context with its prompt is clamped by vLLM, not refused, so it is clamped here too;
a ``max_tokens`` larger than the context itself is vLLM's 400, and kvgate's.

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
    """What one request may occupy: ``sequences`` copies of each prompt, each growing by its output budget
    (``outputs``, one per prompt; all ``max_output`` when not given)."""

    prompt_tokens: tuple[int, ...]
    sequences_per_prompt: int
    max_output: int  # the largest output budget of any prompt
    blocks: int
    outputs: tuple[int, ...] | None = None
    min_output: int = 0  # the request's min_tokens: no estimate goes below it
    # priced without the tokenizer: what the prompts may be at most (the learned band's high end), for what
    # must never fall short of the truth, such as a tenant's token charge; None when counted
    prompt_high: tuple[int, ...] | None = None
    media_tokens: int = 0  # of the (one) prompt: the allowance for its images, audio and video, not counted

    @property
    def output_budgets(self) -> tuple[int, ...]:
        return self.outputs if self.outputs is not None else (self.max_output,) * len(self.prompt_tokens)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens) * self.sequences_per_prompt

    @property
    def total_tokens(self) -> int:
        """Prompt plus reserved output over all sequences: what token rate limits charge."""
        return self.total_prompt_tokens + sum(self.output_budgets) * self.sequences_per_prompt

    @property
    def charge_tokens(self) -> int:
        """What a token rate limit pre-charges: :attr:`total_tokens`, with the prompt at its high end when it
        was estimated, so settling from the engine's usage only ever refunds."""
        if self.prompt_high is None:
            return self.total_tokens
        return (sum(self.prompt_high) + sum(self.output_budgets)) * self.sequences_per_prompt

    @property
    def least_charge_tokens(self) -> int:
        """What a request is billed whatever it generates, as vLLM's usage counts it: its prompts once each
        (their counted size: not the high end of an estimate, nor the media allowance, which never refuse) and
        the output each sequence must produce (``min_tokens``; all of its budget under ignore_eos)."""
        least = sum(min(self.min_output, budget) for budget in self.output_budgets) * self.sequences_per_prompt
        return sum(self.prompt_tokens) - self.media_tokens + least

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_tokens) * self.sequences_per_prompt

    def blocks_after(self, generated_total: int, block_size: int) -> int:
        """Blocks held once ``generated_total`` tokens (over all sequences) have been produced."""
        per_seq = generated_total // max(1, self.num_sequences)
        return self.sequences_per_prompt * sum(
            blocks_for(p + min(o, per_seq), block_size)
            for p, o in zip(self.prompt_tokens, self.output_budgets, strict=True)
        )

    def capped(self, per_sequence: int, block_size: int) -> RequestCost:
        """The same request, expected to stop after ``per_sequence`` output tokens (never past its budgets)."""
        outputs = tuple(min(o, per_sequence) for o in self.output_budgets)
        blocks = self.sequences_per_prompt * sum(
            blocks_for(p + o, block_size) for p, o in zip(self.prompt_tokens, outputs, strict=True)
        )
        return RequestCost(
            self.prompt_tokens,
            self.sequences_per_prompt,
            max(outputs, default=0),
            blocks,
            outputs,
            self.min_output,
            self.prompt_high,
            self.media_tokens,
        )


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def output_budget(max_tokens: int | None, prompt_tokens: int, max_model_len: int | None) -> int:
    """Tokens one sequence of this prompt may generate, as vLLM's ``get_max_tokens`` computes it:
    ``min(max_model_len - prompt, max_tokens)``, where an absent ``max_tokens`` means the context's rest."""
    if max_model_len is None:
        if max_tokens is None:
            raise bad_request(
                "max_tokens is required: the gateway does not know the model's max_model_len", param="max_tokens"
            )
        return max_tokens
    room = max(0, max_model_len - prompt_tokens)
    return room if max_tokens is None else min(max_tokens, room)


def estimate_cost(
    prompt_tokens: tuple[int, ...],
    *,
    max_tokens: int | None,
    sequences_per_prompt: int,
    max_model_len: int | None,
    geometry: KvGeometry,
    min_tokens: int = 0,
    prompt_high: tuple[int, ...] | None = None,
    truncate_to: int | None = None,
    media_tokens: int = 0,
) -> RequestCost:
    """Turn token counts into a block reservation, rejecting what the engine could never serve: a prompt
    longer than the context (vLLM's own 400), or a request larger than its whole pool. One larger than the
    watermark leaves room for is not refused: admission runs it alone (vLLM sizes its pool to hold at least
    one sequence of the whole context, and with ``--max-model-len -1`` the context to the pool).
    ``prompt_high``: the counts are an estimate, and these are the prompts at their most. ``truncate_to``:
    the request's ``truncate_prompt_tokens``; the engine keeps that many of each prompt's tokens.
    ``media_tokens``: what the (one) prompt's media items are expected to add to its count. An estimate of what
    cannot be counted here, it reserves but never refuses: it is added after the context check, and only up
    to what the context leaves."""
    generates = max_tokens != 0  # pooling and scoring requests produce no tokens and may fill the context
    if max_tokens is not None and max_model_len is not None and max_tokens > max_model_len:
        # vLLM's TokenizeParams refuses it before the prompt is looked at; only a cap inside the context is clamped
        raise bad_request(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )
    if truncate_to is not None:
        limit = _truncation_limit(truncate_to, max_model_len, generates)
        if limit is not None:
            prompt_tokens = tuple(min(p, limit) for p in prompt_tokens)
            prompt_high = None if prompt_high is None else tuple(min(p, limit) for p in prompt_high)
    longest = max(prompt_tokens, default=0)
    if max_model_len is not None and (longest > max_model_len or (generates and longest >= max_model_len)):
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{longest} input tokens, which leaves no room for any output. Please reduce the length of the input."
        )
    if media_tokens and len(prompt_tokens) == 1:
        room = media_tokens if max_model_len is None else max_model_len - longest - (1 if generates else 0)
        media_tokens = max(0, min(media_tokens, room))
        longest += media_tokens
        prompt_tokens = (longest,)
        prompt_high = None if prompt_high is None else (prompt_high[0] + media_tokens,)
    else:
        media_tokens = 0
    if len(prompt_tokens) == 1:  # one prompt (every chat): the same sums, without generators
        output = output_budget(max_tokens, longest, max_model_len)
        outputs: tuple[int, ...] = (output,)
        blocks = sequences_per_prompt * -(-(longest + output) // geometry.block_size)
    else:
        outputs = tuple(output_budget(max_tokens, p, max_model_len) for p in prompt_tokens)
        output = max(outputs, default=0)
        blocks = sequences_per_prompt * sum(
            blocks_for(p + o, geometry.block_size) for p, o in zip(prompt_tokens, outputs, strict=True)
        )
    if blocks > geometry.num_blocks:
        raise GatewayError(
            400,
            f"This request needs {blocks} KV-cache blocks ({sum(prompt_tokens)} prompt tokens, "
            f"{output} output tokens x {sequences_per_prompt} sequence(s), block size {geometry.block_size}), "
            f"but the engine has {geometry.num_blocks}. Reduce max_tokens, n or the prompt.",
            param="max_tokens",
            code="kv_cache_capacity_exceeded",
        )
    uniform = len(outputs) == 1 or all(o == output for o in outputs)
    floor = min(min_tokens, output)
    return RequestCost(
        prompt_tokens,
        sequences_per_prompt,
        output,
        blocks,
        None if uniform else outputs,
        floor,
        prompt_high,
        media_tokens,
    )


def _truncation_limit(truncate_to: int, max_model_len: int | None, generates: bool) -> int | None:
    """The tokens vLLM keeps of a prompt under ``truncate_prompt_tokens``: as asked, never more than the context
    (a 400, as vLLM answers); -1 is the whole context, less the one token a generation needs. None when -1 and
    the context is unknown."""
    if max_model_len is None:
        return truncate_to if truncate_to >= 0 else None
    if truncate_to > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens={truncate_to} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    if truncate_to < 0:
        return max_model_len - 1 if generates else max_model_len
    return truncate_to
