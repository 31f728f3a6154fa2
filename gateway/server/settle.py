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


def tokens_streamed(events: int, stream_interval: int, sequences: int = 1) -> int:
    """The fewest output tokens ``events`` relayed SSE events carry, over ``sequences`` sequences. vLLM sends
    each sequence's first token at once, then one event per ``stream_interval`` tokens (the request's, or the
    engine's ``--stream-interval`` if larger), and its last event with what is left: counting events alone
    would see a request batched by 100 as 1/100th of its length. The relay counts every event, so up to
    ``sequences`` + 2 of them carry none (a chat's role chunks, the usage, ``[DONE]``), and two per sequence
    may carry one. Unbatched (1), the event count itself, as before: a few events over."""
    if stream_interval <= 1:
        return events
    carrying = events - sequences - 2
    if carrying <= 0:
        return 0
    short = min(carrying, 2 * sequences)
    return short + (carrying - short) * stream_interval


def stream_lead(events: int, stream_interval: int, sequences: int = 1, opening: int = 0) -> int:
    """How many tokens per sequence the engine may be past :func:`tokens_streamed`: each sequence's first
    event one token, every later event full (at most ``stream_interval`` tokens, one per decoding step), and
    up to ``stream_interval - 1`` generated but not yet sent. ``opening``: the events a stream starts with that
    carry no token (a chat's role chunks, one per sequence). 0 for an unbatched stream (the ledger's own lead
    covers it)."""
    if stream_interval <= 1:
        return 0
    carrying = max(0, events - opening)
    firsts = min(carrying, sequences)
    most = firsts + (carrying - firsts) * stream_interval
    shortfall = max(0, most - tokens_streamed(events, stream_interval, sequences))
    return -(-shortfall // max(1, sequences)) + stream_interval - 1


def tokens_used(
    cost: RequestCost,
    usage: Usage | None,
    generated: int,
    reached_engine: bool,
    whole_answer: bool = False,
    charged: int | None = None,
) -> int:
    """Tokens to bill: the engine's ``usage`` in full when it says (a prompt counted short, by the heuristic on
    CJK or code or by another model's tokenizer, is billed what the engine counted: the bucket goes into debt);
    otherwise an estimate, never more than the request's whole charge (:attr:`RequestCost.charge_tokens`).
    ``generated``: output tokens streamed (at least; see :func:`tokens_streamed`). ``whole_answer``: a 200
    answered in one piece (not a stream), whose length without ``usage`` is unknown, not zero: billed as
    ``charged``, what its rate limit took (a minute's allowance at most), not the rest of the budget besides."""
    if not reached_engine:
        used = 0
    elif usage is not None:
        return usage.prompt_tokens + usage.completion_tokens
    elif whole_answer:  # and never less than it takes whatever it generates (a charge cut to a replica's share)
        used = cost.charge_tokens if charged is None else max(charged, cost.least_charge_tokens)
    elif generated == 0:
        used = 0  # disconnected or failed before the first token: nothing to bill
    else:
        used = sum(cost.prompt_tokens) + generated
    return min(used, cost.charge_tokens)
