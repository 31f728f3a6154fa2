"""One request and its response on a client connection: the ASGI ``receive`` and ``send`` of one request.

The connection (:mod:`gateway.server.http_server`) parses requests and feeds each cycle its body; the cycle
hands the body to the app and frames the app's response on the wire: content-length, chunked, or (HTTP/1.0
with no length) ended by the close; nothing at all after HEAD, 204 or 304. A response's head waits for its
first body chunk, so both go out in one write; a head with no body behind it in the same loop iteration goes
out alone.
"""

from __future__ import annotations

import asyncio
import http
from typing import Any, Protocol

from gateway.protocol.errors import GatewayError

_DISCONNECT: dict[str, Any] = {"type": "http.disconnect"}


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


# what the server itself answers (the app never saw the request), in OpenAI's shape as every error is
_SERVER_ERRORS: dict[int, tuple[str, str, str | None, float | None]] = {  # message, type, code, Retry-After
    400: ("The request could not be read as HTTP/1.1.", "invalid_request_error", "bad_http_request", None),
    408: ("The request did not arrive in time.", "invalid_request_error", "request_timeout", None),
    431: ("The request head is too large.", "invalid_request_error", "request_head_too_large", None),
    500: ("The gateway failed to answer the request.", "server_error", "internal_error", None),
    503: ("The gateway holds as many connections as it may.", "service_unavailable", "too_many_connections", 1.0),
}


def plain_response(status: int, server_headers: bytes = b"") -> bytes:
    """A whole response from the server itself (400, 408, 431, 500, 503), OpenAI-shaped, that closes the
    connection."""
    message, kind, code, retry_after_s = _SERVER_ERRORS.get(
        status, (http.HTTPStatus(status).phrase, "server_error", None, None)
    )
    error = GatewayError(status, message, type=kind, code=code, retry_after_s=retry_after_s)
    body = error.body()
    headers = b"".join(b"%s: %s\r\n" % pair for pair in error.headers())
    return b"".join(
        [
            STATUS_LINE[status],
            server_headers,
            headers,
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body),
            body,
        ]
    )


class Connection(Protocol):
    """What a cycle needs of its connection."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    write_paused: bool

    def reading_wanted(self) -> None:
        """The app waits for body bytes: resume reading, unless requests queue behind this one."""

    async def drain(self) -> None: ...

    def send_continue(self) -> None:
        """Answer ``Expect: 100-continue``: the app wants the body."""

    def server_headers(self) -> tuple[bytes, int]: ...

    def response_done(self, cycle: RequestCycle) -> None: ...


class RequestCycle:
    """One request, from its complete head to the end of its response."""

    __slots__ = (
        "body",
        "body_complete",
        "body_size",
        "chunked",
        "connection",
        "delivered",
        "disconnected",
        "expect_continue",
        "head",
        "head_only",
        "keep_alive",
        "remaining",
        "response_complete",
        "response_started",
        "scope",
        "waiter",
    )

    def __init__(self, connection: Connection, scope: dict[str, Any], keep_alive: bool, expect_continue: bool) -> None:
        self.connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []  # received, not yet taken by the app
        self.body_size = 0  # bytes in it
        self.body_complete = False
        self.delivered = False  # the app has taken the last of the body
        self.waiter: asyncio.Future[None] | None = None  # the app waits in receive()
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.head: bytes | None = None  # the response head, until it goes out with the first body chunk
        self.head_only = False  # HEAD, 204, 304: no body on the wire
        self.chunked = False
        self.remaining = 0  # bytes still owed under content-length; -1: not framed by a length

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def disconnect(self) -> None:
        """The client is gone (or cut off): the app's receive() answers http.disconnect, send() writes nothing."""
        self.disconnected = True
        self.head = None
        self.wake()

    async def receive(self) -> dict[str, Any]:
        connection = self.connection
        while True:
            if self.disconnected or self.response_complete:
                return _DISCONNECT
            if not self.delivered and (self.body or self.body_complete):
                body = b"".join(self.body)
                self.body.clear()
                self.body_size = 0
                self.delivered = self.body_complete
                if not self.body_complete:
                    connection.reading_wanted()
                return {"type": "http.request", "body": body, "more_body": not self.body_complete}
            if self.expect_continue:
                self.expect_continue = False
                connection.send_continue()
            connection.reading_wanted()
            self.waiter = connection.loop.create_future()
            await self.waiter

    async def send(self, message: dict[str, Any]) -> None:
        connection = self.connection
        if connection.write_paused and not self.disconnected:
            await connection.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            self.head = self._head(message["status"], message.get("headers", ()))
            self.response_started = True
            self.expect_continue = False
            connection.loop.call_soon(self._flush_head)  # no body right behind it: the head goes out alone
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got {kind!r}.")
            body: bytes = message.get("body", b"")
            more: bool = message.get("more_body", False)
            if self.head_only:
                body = b""
            elif self.chunked:
                if body:
                    body = b"%x\r\n%b\r\n" % (len(body), body)
                if not more:
                    body += b"0\r\n\r\n"
            elif self.remaining >= 0:
                self.remaining -= len(body)
                if self.remaining < 0 or (self.remaining and not more):
                    raise RuntimeError("Response content does not match its Content-Length.")
            head = self.head
            if head is not None:
                self.head = None
                connection.transport.writelines((head, body))
            elif body:
                connection.transport.write(body)
            if not more:
                self.response_complete = True
                self.wake()
                connection.response_done(self)
        else:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent, after the response was complete.")

    def _flush_head(self) -> None:
        head = self.head
        if head is not None and not self.disconnected:
            self.head = None
            self.connection.transport.write(head)

    def _head(self, status: int, headers: Any) -> bytes:
        server_headers, server_lines = self.connection.server_headers()
        lines = [STATUS_LINE[status], server_headers]
        framed = closes = False
        for name, value in headers:
            lines.append(b"%b: %b\r\n" % (name, value))
            lower = name.lower()
            if lower == b"content-length":
                if not value.isdigit():  # int() would take -1, +5 or 1_0
                    raise RuntimeError(f"Invalid Content-Length {value!r}.")
                if not framed:
                    self.remaining = int(value)
                    framed = True
            elif lower == b"transfer-encoding":
                if value.lower() == b"chunked":
                    self.chunked = True
                    framed = True
            elif lower == b"connection" and b"close" in value.lower():
                closes = True
        self.head_only = self.scope["method"] == "HEAD" or status in (204, 304)
        if not framed and not self.head_only:
            if self.scope["http_version"] != "1.1":  # no chunked encoding before HTTP/1.1: the close ends it
                self.keep_alive = False
                self.remaining = -1
            else:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
        if not self.body_complete:
            self.keep_alive = False  # answered before its body is in (401, 413...): the rest is not read
        if closes:
            self.keep_alive = False
        elif not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        # A CR or LF inside a name or value would split the head (response splitting): counting checks them
        # all at once. Every line but the server's block ends in one CRLF; that block holds server_lines.
        newlines = len(lines) - 1 + server_lines
        if head.count(b"\n") != newlines or head.count(b"\r") != newlines:
            raise RuntimeError("Invalid HTTP header name or value.")
        return head
