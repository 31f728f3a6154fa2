"""An allow-listed admin call in a pool goes to every engine, and the client hears whether they agreed.

The routes an operator opens with ``passthrough.allow`` change one engine's state (``/v1/load_lora_adapter``,
``/reset_prefix_cache``, ``/sleep``): sent to one engine of a pool, the adapter would exist on that engine
alone, and a request for it placed on another would be a 404. So each engine gets the call, and the client
gets their answer when they all gave the same status, or a 502 that lists each engine's status (by its place
in the pool, never its address: that goes to kvgate's log). Pure: the calls are made by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.protocol.errors import GatewayError


@dataclass(frozen=True, slots=True)
class Reply:
    """One engine's whole answer to an admin call (they are small)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def agreed(replies: Sequence[Reply | GatewayError]) -> Reply:
    """The first engine's reply when every engine answered with its status (the first failure when none could
    be reached); else a 502 naming each status (an engine that could not be reached reads as the status kvgate
    would have given: 503, 504 or 502)."""
    statuses = [r.status for r in replies]
    first = replies[0]
    if len(set(statuses)) == 1:
        if all(isinstance(r, Reply) for r in replies) and isinstance(first, Reply):
            return first
        if all(isinstance(r, GatewayError) for r in replies) and isinstance(first, GatewayError):
            raise first
    listed = ", ".join(f"engine {i + 1}: {s}" for i, s in enumerate(statuses))
    raise GatewayError(
        502,
        f"The engines of the pool answered this call differently ({listed}): their state may now differ.",
        type="upstream_error",
        code="engines_disagree",
    )
