"""The client side of one ASGI response."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from gateway.protocol.errors import GatewayError

Send = Callable[[dict[str, Any]], Awaitable[None]]


class ResponseWriter:
    """The client side of one ASGI response; remembers whether the head has gone out."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.status = 0
        self.event_stream = False  # the response is server-sent events

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        headers = list(headers)
        self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes, more: bool = False) -> None:
        self.finished = not more
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def stream_error(self, exc: GatewayError) -> bool:
        """A stream that broke off after its head went out ends with an error event, as vLLM ends its own
        (``data: {"error": {...}}``), not by just stopping: clients tell a cut answer from a short one. True if
        the event was written (only an unfinished event stream can take one)."""
        if not self.event_stream or self.finished:
            return False
        await self.body(b"data: " + exc.body() + b"\n\n", more=True)
        await self.body(b"")
        return True

    async def error(self, exc: GatewayError, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        body = exc.body()
        await self.start(exc.status, [*exc.headers(), *extra_headers, (b"content-length", str(len(body)).encode())])
        await self.body(body)
