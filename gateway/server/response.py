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

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": list(headers)})

    async def body(self, chunk: bytes, more: bool = False) -> None:
        self.finished = not more
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def error(self, exc: GatewayError, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        body = exc.body()
        await self.start(exc.status, [*exc.headers(), *extra_headers, (b"content-length", str(len(body)).encode())])
        await self.body(body)
