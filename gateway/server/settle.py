"""Settling: once the engine has answered, how many tokens the request really used. Pure.

The rate limiter pre-charged prompt plus reserved output (a prompt priced without the tokenizer at the high end
of its learned band); the engine's ``usage`` says what was really used, and the difference is refunded.
Without ``usage`` (a stream without ``include_usage``) the relayed event count stands in for the completion
and the prompt's price for the prompt. A request that never reached the engine used nothing.
"""

from __future__ import annotations

from gateway.tokens.cost import RequestCost
from gateway.upstream.forwarder import Usage


def tokens_used(
    cost: RequestCost, usage: Usage | None, generated_events: int, reached_engine: bool, whole_answer: bool = False
) -> int:
    """Tokens to bill, never more than was pre-charged. ``whole_answer``: a 200 answered in one piece (not a
    stream), whose length without ``usage`` is unknown, not zero: billed as charged."""
    if not reached_engine:
        used = 0
    elif usage is not None:
        used = usage.prompt_tokens + usage.completion_tokens
    elif whole_answer:
        used = cost.charge_tokens
    elif generated_events == 0:
        used = 0  # disconnected or failed before the first token: nothing to bill
    else:
        used = sum(cost.prompt_tokens) + generated_events
    return min(used, cost.charge_tokens)
