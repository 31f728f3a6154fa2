"""kvgate's client-facing HTTP/1.1 server protocol: ASGI over httptools, with read deadlines (slowloris).

uvicorn still runs the server (sockets, lifespan, signals, graceful shutdown); only its per-connection protocol
is replaced, through ``uvicorn.Config(http=...)``. Why: uvicorn's protocol cost ~0.055 ms of CPU per request
more than this one for the same ASGI app (``python3 -m loadtests.bench_http_server``), a sixth of kvgate's
whole cost per request, and the hot path is measured against a Rust router. What this one does differently:

* a response's head goes out with its first body chunk, in one write (uvicorn writes them apart: two sends,
  two segments to the client); a head with no body behind it within the same loop iteration goes out alone;
* a request body that has fully arrived is handed over without an event to wait on;
* one timer per connection, re-armed lazily, serves every deadline (head, body, keep-alive); the hot path
  only stamps the time of each read; uvicorn arms and cancels a keep-alive timer per request;
* the response head is checked once as a whole for stray CR/LF instead of two regular expressions per header.

Deadlines (uvicorn has no limit on how long a client may take to send a request):

* head: a request's whole head must arrive within ``header_timeout_s`` of the connection opening (first
  request) or of its own first byte (later ones);
* body: while a body is being received, no byte for longer than ``body_timeout_s`` ends it. Silence that is
  ours does not count: reading paused by flow control, or ``Expect: 100-continue`` not yet answered. A slow
  but steady body is never cut;
* keep-alive: a connection idle between requests for ``keepalive_timeout_s`` is closed.

On a head or body deadline the connection is closed, after a ``408`` when part of a request arrived and no
response to it has started. While a response is owed nothing is timed: it takes as long as the engine takes.

Also: pipelined requests are served in turn (reading pauses behind them); ``Expect: 100-continue`` is answered
when the app first reads the body; an ``Upgrade`` request (websocket, h2c) is served as plain HTTP and the
connection closed after its answer (the parser stops at an upgrade, so whatever followed the head is lost);
beyond uvicorn's ``limit_concurrency`` (``max_connections``) a request gets ``503`` and the connection closes;
a connection's drop is told to the request it is serving through :class:`~gateway.server.disconnect.ConnectionLoss`
(the scope extension ``kvgate.connection_loss``), so no request parks a task in ``receive()`` to hear of it.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections import deque
from typing import Any, ClassVar, cast
from urllib.parse import unquote

import httptools
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.config import ListenConfig
from gateway.server.disconnect import CONNECTION_LOSS, ConnectionLoss

log = logging.getLogger("kvgate")

_NEVER = float("inf")
_HIGH_WATER = 65536  # request body bytes buffered, not yet taken by the app, before reading pauses
_DISCONNECT: dict[str, Any] = {"type": "http.disconnect"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


def plain_response(status: int, text: bytes, server_headers: bytes = b"") -> bytes:
    """A whole ``text/plain`` response that closes the connection: what the server itself answers."""
    return b"".join(
        [
            STATUS_LINE[status],
            server_headers,
            b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(text),
            text,
        ]
    )


class _Cycle:
    """One request and its response: the ASGI ``receive`` and ``send`` of one request."""

    __slots__ = (
        "body",
        "body_complete",
        "body_size",
        "chunked",
        "delivered",
        "disconnected",
        "expect_continue",
        "head",
        "head_only",
        "keep_alive",
        "protocol",
        "remaining",
        "response_complete",
        "response_started",
        "scope",
        "waiter",
    )

    def __init__(self, protocol: HttpProtocol, scope: dict[str, Any], keep_alive: bool, expect_continue: bool) -> None:
        self.protocol = protocol
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []
        self.body_size = 0
        self.body_complete = False
        self.delivered = False  # the last body message went to the app
        self.waiter: asyncio.Future[None] | None = None  # the app waits in receive()
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.head: bytes | None = None  # the response head, until it goes out with the first body chunk
        self.head_only = False  # HEAD, 204, 304: no body on the wire
        self.chunked = False
        self.remaining = 0  # bytes still owed under content-length

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        protocol = self.protocol
        while True:
            if self.disconnected or self.response_complete:
                return _DISCONNECT
            if not self.delivered and (self.body or self.body_complete):
                body = b"".join(self.body)
                self.body.clear()
                self.body_size = 0
                self.delivered = self.body_complete
                if protocol.read_paused and protocol.pipeline_empty():
                    protocol.resume_reading()
                return {"type": "http.request", "body": body, "more_body": not self.body_complete}
            if self.expect_continue:
                self.expect_continue = False
                if not protocol.transport.is_closing():
                    protocol.transport.write(_CONTINUE)
            if protocol.read_paused and protocol.pipeline_empty():
                protocol.resume_reading()
            self.waiter = protocol.loop.create_future()
            await self.waiter

    async def send(self, message: dict[str, Any]) -> None:
        protocol = self.protocol
        if protocol.write_paused and not self.disconnected:
            await protocol.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            self.head = self._head(message["status"], message.get("headers", ()))
            self.response_started = True
            self.expect_continue = False
            protocol.loop.call_soon(self._flush_head)  # no body right behind it: the head goes out alone
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
                    protocol.transport.close()  # the framing the head promised cannot be kept
                    raise RuntimeError("Response content does not match its Content-Length.")
            head = self.head
            if head is not None:
                self.head = None
                protocol.transport.writelines((head, body))
            elif body:
                protocol.transport.write(body)
            if not more:
                self.response_complete = True
                self.wake()
                protocol.response_done(self)
        else:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent, after the response was complete.")

    def _flush_head(self) -> None:
        head = self.head
        if head is not None and not self.disconnected:
            self.head = None
            self.protocol.transport.write(head)

    def _head(self, status: int, headers: Any) -> bytes:
        server_headers, server_lines = self.protocol.server_headers()
        lines = [STATUS_LINE[status], server_headers]
        framed = closes = False
        for name, value in headers:
            lines.append(b"%b: %b\r\n" % (name, value))
            lower = name.lower()
            if lower == b"content-length":
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
            if self.scope["http_version"] == "1.0":  # no chunked encoding in HTTP/1.0: the close ends the body
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


class HttpProtocol(asyncio.Protocol):
    """One client connection. See the module docstring; deadlines are class attributes, set by
    :func:`configured_protocol`, since uvicorn builds one protocol per connection from the class alone."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0

    __slots__ = (
        "_body_cycle",
        "_clock",
        "_drain_waiter",
        "_extensions",
        "_head_deadline",
        "_headers",
        "_idle_deadline",
        "_in_head",
        "_last_read",
        "_loss",
        "_parser",
        "_pipeline",
        "_timer",
        "_timer_at",
        "_upgraded",
        "_url",
        "active",
        "app",
        "app_state",
        "client",
        "keepalive_s",
        "limit",
        "loop",
        "read_paused",
        "server",
        "server_state",
        "transport",
        "write_paused",
    )

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        self.limit = config.limit_concurrency
        self.keepalive_s = float(config.timeout_keep_alive)
        self._clock = self.loop.time
        self._parser = httptools.HttpRequestParser(self)
        self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.read_paused = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.active: _Cycle | None = None  # the request whose response is being served
        self._body_cycle: _Cycle | None = None  # the latest request whose head is in (its body may still come)
        self._pipeline: deque[_Cycle] = deque()  # complete heads waiting for the active response to end
        self._in_head = False  # part of a head has arrived
        self._upgraded = False  # the parser stopped at an Upgrade request
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._last_read = 0.0  # loop time of the latest read
        self._head_deadline = 0.0
        self._idle_deadline = 0.0  # when an idle connection is closed
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER
        self._loss: ConnectionLoss | None = None
        self._extensions: dict[str, dict[str, Any]] = {}

    # --- the connection ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are no subclass of it
        self.server_state.connections.add(self)  # type: ignore[arg-type]  # uvicorn calls shutdown() on each
        self.server = _address(self.transport.get_extra_info("sockname"))
        self.client = _address(self.transport.get_extra_info("peername"))
        self._loss = ConnectionLoss(self.resume_reading)
        self._extensions = {CONNECTION_LOSS: {"loss": self._loss}}
        self._last_read = self._clock()
        # the first request's head must be in within header_timeout_s of the connection opening
        self._idle_deadline = self._head_deadline = self._last_read + self.header_timeout_s
        self._arm(self._idle_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        for cycle in (self.active, self._body_cycle):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.head = None
            if cycle is not None:
                cycle.wake()
        self._pipeline.clear()
        if self._loss is not None:
            self._loss.lost()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.write_paused = False
        self._wake_drain()

    def eof_received(self) -> bool:
        return False  # the transport closes: a half-closed client is gone

    def data_received(self, data: bytes) -> None:
        self._last_read = self._clock()
        if self._upgraded:
            return  # the parser stopped at an Upgrade: what follows is not ours to read
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgraded = True
            log.debug("Upgrade request served as plain HTTP; the connection closes after the response")
            cycle = self._body_cycle
            if cycle is not None:
                cycle.keep_alive = False
                if not cycle.body_complete:  # the parser reads no further: no more of this body will come
                    self.on_message_complete()
        except httptools.HttpParserError as exc:
            self._bad_request(f"Invalid HTTP request: {exc}")

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now if idle, else once the response in progress is sent."""
        if self.active is None or self.active.response_complete:
            self.transport.close()
        else:
            self.active.keep_alive = False
            self._pipeline.clear()

    # --- flow control -----------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    async def drain(self) -> None:
        if self._drain_waiter is None or self._drain_waiter.done():
            self._drain_waiter = self.loop.create_future()
        await asyncio.shield(self._drain_waiter)

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def pipeline_empty(self) -> bool:
        return not self._pipeline

    # --- the parser's callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._in_head = True
        if self._body_cycle is not None:  # a later request: its head clock starts at its first byte
            self._head_deadline = self._last_read + self.header_timeout_s
            self._arm(self._head_deadline)

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        url = self._url
        if url[:1] == b"/":
            raw_path, _, query = url.partition(b"?")
        else:  # absolute form (http://host/path) or asterisk form
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        try:
            path = raw_path.decode("ascii")
        except UnicodeDecodeError:
            raise httptools.HttpParserError("the request target is not ASCII") from None
        if "%" in path:
            path = unquote(path)
        http_version = parser.get_http_version()
        headers = self._headers
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": http_version,
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": headers,
            "state": self.app_state.copy(),
            "extensions": self._extensions,
        }
        expect_continue = any(name == b"expect" and value.lower() == b"100-continue" for name, value in headers)
        cycle = _Cycle(self, scope, http_version != "1.0" and parser.should_keep_alive(), expect_continue)
        self._body_cycle = cycle
        self._arm(self._last_read + self.body_timeout_s)
        if self.limit is not None and (
            len(self.server_state.connections) >= self.limit or len(self.server_state.tasks) >= self.limit
        ):
            log.warning("Exceeded concurrency limit (listen.max_connections): answering 503")
            self._plain(503, b"Service Unavailable")
            self.transport.close()
            cycle.disconnected = True
        elif self.active is None:
            self._start(cycle)
        else:  # pipelined behind a response still owed
            self._pipeline.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self._body_cycle
        if cycle is None or cycle.response_complete or cycle.disconnected:
            return
        cycle.body.append(body)
        cycle.body_size += len(body)
        if cycle.body_size > _HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self._body_cycle
        if cycle is None:
            return
        cycle.body_complete = True
        cycle.wake()

    # --- requests and responses ---------------------------------------------------------------------------

    def _start(self, cycle: _Cycle) -> None:
        self.active = cycle
        tasks = self.server_state.tasks
        task = self.loop.create_task(self._run(cycle))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _run(self, cycle: _Cycle) -> None:
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except BaseException as exc:
            log.error("Exception in ASGI application", exc_info=exc)
            if not cycle.response_started and not cycle.disconnected:
                self._plain(500, b"Internal Server Error")
            self.transport.close()
            return
        if not cycle.disconnected and not cycle.response_complete:
            step = "ending" if cycle.response_started else "starting"
            log.error("ASGI application returned without %s its response", step)
            if not cycle.response_started:
                self._plain(500, b"Internal Server Error")
            self.transport.close()

    def response_done(self, cycle: _Cycle) -> None:
        """The response went out whole: close, or serve the next pipelined request, or wait idle."""
        self.server_state.total_requests += 1
        if self.active is cycle:
            self.active = None
        if not cycle.keep_alive:
            self.transport.close()
            return
        if self.transport.is_closing():
            return
        if self._pipeline:
            self._start(self._pipeline.popleft())
            if not self._pipeline:
                self.resume_reading()
        else:
            self.resume_reading()
            self._idle_deadline = self._clock() + self.keepalive_s
            self._arm(self._idle_deadline)

    def _bad_request(self, message: str) -> None:
        log.debug("closing %s: %s", self.client, message)
        if self.active is None or not self.active.response_started:
            self._plain(400, b"Invalid HTTP request received.")
        self.transport.close()

    def server_headers(self) -> tuple[bytes, int]:
        """uvicorn's default headers (``date``, ``server``), which its server refreshes every second, encoded
        (once per refresh), and how many lines they make."""
        default = self.server_state.default_headers
        if _server_headers.source is not default:
            _server_headers.source = default
            _server_headers.encoded = b"".join(b"%b: %b\r\n" % (name, value) for name, value in default)
            _server_headers.lines = len(default)
        return _server_headers.encoded, _server_headers.lines

    def _plain(self, status: int, text: bytes) -> None:
        self.transport.write(plain_response(status, text, self.server_headers()[0]))

    # --- the timer -------------------------------------------------------------------------------------

    def _arm(self, when: float) -> None:
        """Make sure the timer fires by ``when``; a timer due earlier re-checks then (and re-arms)."""
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(when, self._on_timer)
            self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = _NEVER
        if self.transport.is_closing():
            return
        now = self._clock()
        cycle = self._body_cycle
        if self._in_head:
            if self.active is not None:  # a pipelined head behind a response still owed: not its turn yet
                self._arm(now + self.header_timeout_s)
                return
            deadline, expired = self._head_deadline, "head"
        elif cycle is not None and not cycle.body_complete and not cycle.disconnected:
            if self.read_paused or cycle.expect_continue:
                self._arm(now + self.body_timeout_s)  # we are not reading: the silence is ours
                return
            deadline, expired = self._last_read + self.body_timeout_s, "body"
        elif self.active is not None or self._pipeline:
            return  # a response is owed: no deadline; response_done arms the keep-alive one
        else:
            deadline, expired = self._idle_deadline, "idle"
        if now < deadline:
            self._arm(deadline)
            return
        log.debug("closing %s: %s deadline", self.client, expired)
        answer = expired == "head"  # a connection that never sent a byte is just closed
        if expired == "body" and cycle is not None:
            answer = not cycle.response_started
            cycle.disconnected = True  # the app, waiting in receive(), sees http.disconnect and sends nothing
            cycle.wake()
        if answer:
            self._plain(408, b"Request Timeout")
        self.transport.close()


class _ServerHeaders:
    source: object = None
    encoded = b""
    lines = 0


_server_headers = _ServerHeaders()


def _address(value: object) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def configured_protocol(listen: ListenConfig) -> type[HttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with ``listen``'s head and body timeouts (the
    keep-alive one is uvicorn's ``timeout_keep_alive``)."""

    class ConfiguredHttpProtocol(HttpProtocol):
        __slots__ = ()
        header_timeout_s = listen.header_timeout_s
        body_timeout_s = listen.body_timeout_s

    return ConfiguredHttpProtocol
