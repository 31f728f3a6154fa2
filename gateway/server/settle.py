"""Settling: once the engine has answered, how many tokens the request really used. Pure.

The rate limiter pre-charged prompt plus reserved output (a prompt priced without the tokenizer at the high end
of its learned band); the engine's ``usage`` says what was really used, and the difference is refunded.
Without ``usage`` (a stream without ``include_usage``) the tokens its relayed events carry at least
(:func:`tokens_streamed`) stand in for the completion and the prompt's price for the prompt. A request that
never reached the engine used nothing.
"""

from __future__ import annotations

from gateway.tokens.cost import RequestCost
from gateway.upstream.forwarder import Usage


def tokens_streamed(events: int, stream_interval: int) -> int:
    """The fewest output tokens ``events`` SSE events carry. vLLM sends a stream's first token at once, then
    one event per ``stream_interval`` tokens (the request's, or the engine's ``--stream-interval`` if larger),
    and the last event with what is left: counting events alone would see a request batched by 100 as 1/100th
    of its length."""
    if stream_interval <= 1 or events <= 2:
        return events
    return 2 + (events - 2) * stream_interval


def tokens_used(
    cost: RequestCost, usage: Usage | None, generated: int, reached_engine: bool, whole_answer: bool = False
) -> int:
    """Tokens to bill, never more than was pre-charged. ``generated``: output tokens streamed (at least; see
    :func:`tokens_streamed`). ``whole_answer``: a 200 answered in one piece (not a stream), whose length without
    ``usage`` is unknown, not zero: billed as charged."""
    if not reached_engine:
        used = 0
    elif usage is not None:
        used = usage.prompt_tokens + usage.completion_tokens
    elif whole_answer:
        used = cost.charge_tokens
    elif generated == 0:
        used = 0  # disconnected or failed before the first token: nothing to bill
    else:
        used = sum(cost.prompt_tokens) + generated
    return min(used, cost.charge_tokens)
