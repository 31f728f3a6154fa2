"""Hold a tenant concurrency slot for the body of an ``async with``, as the request path's exchange does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import TenantPolicy


@contextlib.asynccontextmanager
async def held_slot(
    counters: TenantCounters, tp: TenantPolicy, wait_s: float, queued_elsewhere: Callable[[], int] = lambda: 0
) -> AsyncIterator[None]:
    slot = await counters.acquire_slot(tp, wait_s, queued_elsewhere)
    try:
        yield
    finally:
        if slot is not None:
            counters.release_slot(slot)
