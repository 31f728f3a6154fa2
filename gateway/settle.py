"""Settling: once the engine has answered, square the books.

The rate limiter pre-charged prompt plus reserved output; the engine's ``usage`` says what was really used,
and the difference is refunded. Without ``usage`` (a stream without ``include_usage``) the relayed event count
stands in for the completion. A request that never reached the engine is refunded in full. Releasing the
KV reservation is not done here but by :meth:`gateway.admitter.Admitter.reserve`, whatever happens.
"""

from __future__ import annotations

from gateway.cost import RequestCost
from gateway.forward import Usage
from gateway.limits import Charge, SharedLimits
from gateway.metrics import GatewayMetrics


def settle(
    *,
    charge: Charge,
    cost: RequestCost,
    usage: Usage | None,
    generated_events: int,
    reached_engine: bool,
    limits: SharedLimits,
    metrics: GatewayMetrics,
) -> int:
    """Refund unused pre-charged tokens (to the counter that took them); returns the tokens finally charged."""
    charged = cost.total_tokens
    if not reached_engine:
        actual = 0
    elif usage is not None:
        actual = usage.prompt_tokens + usage.completion_tokens
        metrics.prompt_tokens_estimated.inc(sum(cost.prompt_tokens))
        metrics.prompt_tokens_actual.inc(usage.prompt_tokens)
        metrics.completion_tokens.inc(usage.completion_tokens)
    elif generated_events == 0:
        actual = 0  # disconnected or failed before the first token: nothing to bill
    else:
        actual = sum(cost.prompt_tokens) + generated_events
    actual = min(actual, charged)
    limits.settle(charge, actual)
    return actual
