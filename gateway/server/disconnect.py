"""Noticing that a client went away, so its request stops costing the engine anything.

ASGI reports a disconnect only to whoever is awaiting ``receive()``. Once the body has been read, a watcher
task takes over ``receive()`` and cancels the request's task when the disconnect arrives; the cancellation
unwinds through the upstream call (closing that connection, which makes vLLM abort the request) and through
the reservation's ``async with`` (releasing it). The watcher must not start before the body is read: two
concurrent ``receive()`` callers would race for the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientDisconnected(Exception):
    """The client went away before it had sent its whole body."""


class DisconnectWatch:
    def __init__(self, receive: Receive, is_finished: Callable[[], bool]) -> None:
        self._receive = receive
        self._is_finished = is_finished
        self._task: asyncio.Task[None] | None = None
        self.fired = False

    def start(self) -> None:
        """Call once the body has been read; from then on a disconnect cancels the current task."""
        target = asyncio.current_task()
        assert target is not None
        self._task = asyncio.create_task(self._watch(target))

    async def _watch(self, target: asyncio.Task[Any]) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self._is_finished():  # after the last byte, a disconnect is just the end
                    self.fired = True
                    target.cancel()
                return

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
