"""kvgate's client-facing HTTP/1.1 server protocol: ASGI over httptools, with read deadlines (slowloris).

uvicorn still runs the server (sockets, lifespan, signals, graceful shutdown); only its per-connection protocol
is replaced, through ``uvicorn.Config(http=...)``. Why: CPU per request, which is measured against a Rust
router (``loadtests/bench_routers.py``). Serving the same minimal ASGI app, uvicorn's protocol cost ~0.079 ms
per request and this one ~0.062; the whole gateway costs 4-10% less with it (``loadtests/bench_builds.py``).
It also stops depending on uvicorn's private per-request state, which the read deadlines used to read.
What it does differently:

* a response's head goes out with its first body chunk, in one write (uvicorn writes them apart: two sends,
  two segments to the client); a head with no body behind it within the same loop iteration goes out alone;
* a request body that has fully arrived is handed over without an event to wait on;
* one timer per connection, re-armed lazily, serves every deadline (head, body, keep-alive); the hot path
  only stamps the time of each read; uvicorn arms and cancels a keep-alive timer per request;
* the response head is checked once as a whole for stray CR/LF instead of two regular expressions per header.

Deadlines (uvicorn has no limit on how long a client may take to send a request):

* head: a request's whole head must arrive within ``header_timeout_s`` of the connection opening (first
  request) or of its own first byte (later ones);
* body: while a body is being received, no body byte for longer than ``body_timeout_s`` ends it. Silence
  that is ours does not count: reading paused by flow control, ``Expect: 100-continue`` not yet answered, a
  pipelined request waiting its turn. A slow but steady body is never cut;
* keep-alive: a connection idle between requests for ``keepalive_timeout_s`` is closed.

On a head or body deadline the connection is closed, after a ``408`` when part of a request arrived and no
response to it has started. While a response is owed nothing is timed: it takes as long as the engine takes.

Limits on what a client can make the server hold:

* a request head (or trailers, or chunk extensions: anything that is not body) past ``MAX_STALL_BYTES``:
  ``431`` (``400``) and close; trailers are not kept;
* at most ``MAX_PIPELINED`` complete requests queue behind the one being answered; past that no more are
  read, and the connection closes once the queued ones are answered;
* a client that takes nothing of its response for ``body_timeout_s`` is cut off (its request is cancelled),
  and so is one that takes nothing of what is left to send after a close (a slow reader gets it all).

Also: pipelined requests are answered in turn (reading pauses behind them), and a malformed one is refused in
its turn, after the answers owed before it; ``Expect: 100-continue`` is
answered when the app first reads the body; an answer sent before its request's body is in says
``connection: close`` and the rest is not read; an ``Upgrade`` request (websocket, h2c) is served as plain HTTP
and the connection closed after its answer (the parser stops at an upgrade), and one that declares a body is
refused (``400``: the app would see an empty one); beyond uvicorn's ``limit_concurrency`` (``max_connections``)
a request gets ``503`` and the connection closes. A connection's drop is told to the request it is serving
through :class:`~gateway.server.disconnect.ConnectionLoss` (the scope extension ``kvgate.connection_loss``), so no
request parks a task in ``receive()`` to hear of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, cast
from urllib.parse import unquote

import httptools
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.config import ListenConfig
from gateway.server.disconnect import CONNECTION_LOSS, ConnectionLoss
from gateway.server.http_cycle import RequestCycle, plain_response

log = logging.getLogger("kvgate")

_NEVER = float("inf")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HIGH_WATER = 65536  # request body bytes received, not yet taken by the app, before reading pauses
# Bytes a connection may send without progress (a complete head, a piece of body) before it is cut off: bounds a
# head's size (431), and trailers or chunk extensions (400). httptools joins a header value a piece at a time,
# so an unbounded one costs the event loop time that grows with its square.
MAX_STALL_BYTES = 65536
MAX_PIPELINED = 16  # complete requests queued behind the one being answered; more: the connection closes after them


class _StopParsing(Exception):
    """Raised inside a parser callback to stop reading requests from the connection (not an error)."""


class _HeadTooLarge(Exception):
    """Raised inside a parser callback when a request head passes ``MAX_STALL_BYTES``: ``431`` and close."""


class _UrlTooLong(_HeadTooLarge):
    """The request target alone passes ``MAX_STALL_BYTES``: ``414`` (RFC 9110 15.5.15) and close."""


class _UnknownCoding(Exception):
    """A transfer coding other than chunked alone (``gzip, chunked``): the parser would strip the chunking and
    pass the rest on as if it were the body; ``501`` and close (RFC 9112 6.1)."""


class HttpProtocol(asyncio.Protocol):
    """One client connection. See the module docstring; deadlines are class attributes, set by
    :func:`configured_protocol`, since uvicorn builds one protocol per connection from the class alone."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    control_port: ClassVar[int | None] = None  # its connections are probes and scrapes: no concurrency limit
    over_limit: ClassVar[OverLimit]  # requests answered 503 past max_connections, one tally per server

    __slots__ = (
        "_body_cycle",
        "_clock",
        "_drain_waiter",
        "_expect_continue",
        "_extensions",
        "_flush_check",
        "_head_bytes",
        "_head_deadline",
        "_headers",
        "_hosts",
        "_idle_deadline",
        "_in_head",
        "_last_read",
        "_loss",
        "_parser",
        "_pipeline",
        "_progress_at",
        "_refusal",
        "_stall_bytes",
        "_stopped",
        "_timer",
        "_timer_at",
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
        self.active: RequestCycle | None = None  # the request whose response is being served
        self._body_cycle: RequestCycle | None = None  # the latest request whose head is in (its body may still come)
        self._pipeline: deque[RequestCycle] = deque()  # complete heads waiting for the active response to end
        self._in_head = False  # part of a head has arrived
        self._stopped = False  # no more requests are read from this connection (an Upgrade, too many queued)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._hosts = 0  # Host headers of the request being parsed: HTTP/1.1 needs exactly one
        self._stall_bytes = 0  # bytes received since the last progress (a complete head, a piece of body)
        self._head_bytes = 0  # of the request head being parsed, counted by the parser's callbacks
        self._last_read = 0.0  # loop time of the latest read
        self._progress_at = 0.0  # loop time of the latest progress of the body being received
        self._head_deadline = 0.0
        self._idle_deadline = 0.0  # when an idle connection is closed
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER
        self._flush_check: asyncio.TimerHandle | None = None  # after a close, while written bytes are left
        self._refusal: int | None = None  # a later request's error status, answered once those before it are
        self._loss: ConnectionLoss | None = None
        self._extensions: dict[str, dict[str, Any]] = {}

    # --- the connection ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are no subclass of it
        self.server_state.connections.add(self)  # type: ignore[arg-type]  # uvicorn calls shutdown() on each
        self.server = _address(self.transport.get_extra_info("sockname"))
        self.client = _address(self.transport.get_extra_info("peername"))
        if self.server is not None and self.server[1] == self.control_port:
            self.limit = None  # clients filling max_connections must not fail the probes (a liveness restart)
        self._loss = ConnectionLoss(self.resume_reading)  # up to MAX_PIPELINED may then queue
        self._extensions = {CONNECTION_LOSS: {"loss": self._loss}}
        self._last_read = self._clock()
        # the first request's head must be in within header_timeout_s of the connection opening
        self._idle_deadline = self._head_deadline = self._last_read + self.header_timeout_s
        self._arm(self._idle_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        for cycle in (self.active, self._body_cycle):
            if cycle is not None and not cycle.response_complete:  # a complete one has no one waiting in it
                cycle.disconnect()
        self._pipeline.clear()
        if self._loss is not None:
            self._loss.lost()
        for timer in (self._timer, self._flush_check):
            if timer is not None:
                timer.cancel()
        self._timer = self._flush_check = None
        self.write_paused = False
        self._wake_drain()

    def eof_received(self) -> bool:
        return False  # the transport closes: a half-closed client is gone

    def data_received(self, data: bytes) -> None:
        self._last_read = self._clock()
        if self._stopped:
            return  # what follows an Upgrade, or requests past the queue's limit, is not read
        self._stall_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            log.debug("Upgrade request served as plain HTTP; the connection closes after the response")
            self._stop_reading_requests()
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _StopParsing):
                self._stop_reading_requests()
            elif isinstance(cause, _UrlTooLong):
                self._refuse(414, "request target too long")
            elif isinstance(cause, _HeadTooLarge):
                self._refuse(431, "request head too large")
            elif isinstance(cause, _UnknownCoding):
                self._refuse(501, "a transfer coding other than chunked")
            else:
                if cause is not None and not isinstance(cause, httptools.HttpParserError):
                    log.error("a parser callback failed", exc_info=cause)  # a bug, not the client's fault
                self._refuse(400, f"invalid HTTP request: {exc}")
            return
        if self._stall_bytes > MAX_STALL_BYTES:
            if self._in_head:
                self._refuse(431, "request head too large")
            else:
                self._refuse(400, "too many bytes without body progress (trailers, chunk extensions)")

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now if idle, else once the response in progress is sent."""
        if self.active is None:
            self._close()
        else:
            self.active.keep_alive = False
            self._pipeline.clear()

    def _stop_reading_requests(self) -> None:
        """Read no more requests; the ones already in are answered, then the connection closes."""
        self._stopped = True
        last = self._pipeline[-1] if self._pipeline else self._body_cycle
        if last is not None:
            last.keep_alive = False
            if not last.body_complete:  # the parser reads no further: no more of this body will come
                self.on_message_complete()

    def _close(self) -> None:
        """Close once what is written has gone out; a client that takes none of it for body_timeout_s is cut
        off (one that keeps reading, however slowly, gets all of it)."""
        transport = self.transport
        if transport.is_closing():
            return
        transport.close()
        pending = transport.get_write_buffer_size()
        if pending:
            self._flush_check = self.loop.call_later(self.body_timeout_s, self._check_flush, pending)

    def _check_flush(self, before: int) -> None:
        self._flush_check = None
        left = self.transport.get_write_buffer_size()
        if left >= before:
            log.debug("closing %s: it read nothing of the rest for %.0f s", self.client, self.body_timeout_s)
            self.transport.abort()
        elif left:
            self._flush_check = self.loop.call_later(self.body_timeout_s, self._check_flush, left)

    # --- flow control -----------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    async def drain(self) -> None:
        """Wait until the client takes what was written; one that takes nothing for body_timeout_s is cut off
        (its request is cancelled, and what it held released)."""
        if self._drain_waiter is None or self._drain_waiter.done():
            self._drain_waiter = self.loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._drain_waiter), self.body_timeout_s)
        except TimeoutError:
            log.debug("closing %s: it read nothing of its response for %.0f s", self.client, self.body_timeout_s)
            if self.active is not None:
                self.active.disconnect()
            self.transport.abort()

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
            self._progress_at = self._clock()  # the silence so far was ours
            self.transport.resume_reading()

    def reading_wanted(self) -> None:
        if self.read_paused and not self._pipeline:
            self.resume_reading()

    def send_continue(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self._progress_at = self._clock()  # the client may send the body only now

    # --- the parser's callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_continue = False
        self._hosts = 0
        self._in_head = True
        self._head_bytes = 0  # a head that arrives in one read makes no stall: its size is counted here
        if self._body_cycle is not None:  # a later request: its head clock starts at its first byte
            self._head_deadline = self._last_read + self.header_timeout_s
            self._arm(self._head_deadline)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_STALL_BYTES:
            raise _UrlTooLong

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer (after a chunked body): not read
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_bytes > MAX_STALL_BYTES:  # inline: a call per header costs on the hot path
            raise _HeadTooLarge
        name = name.lower()
        if name == b"host":
            self._hosts += 1
        elif name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        elif name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            raise _UnknownCoding
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stall_bytes = 0
        self._progress_at = self._last_read
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
        headers = self._headers
        if parser.should_upgrade() and _declares_body(headers):
            # the parser stops at an Upgrade head and would hand the app an empty body in place of this one
            raise httptools.HttpParserError("an Upgrade request with a body")
        http_version = parser.get_http_version()
        if self._hosts != 1 and http_version == "1.1":  # RFC 9112 3.2: none, or two that may disagree
            raise httptools.HttpParserError("an HTTP/1.1 request needs exactly one Host header")
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
        keep_alive = http_version == "1.1" and parser.should_keep_alive()
        # an HTTP/1.0 client's Expect is ignored (RFC 9110 10.1.1): it waits for no 100
        cycle = RequestCycle(self, scope, keep_alive, self._expect_continue and http_version == "1.1")
        self._body_cycle = cycle
        self._arm(self._last_read + self.body_timeout_s)
        if self.active is None:
            self._start(cycle)
        elif len(self._pipeline) < MAX_PIPELINED:  # behind a response still owed
            self._pipeline.append(cycle)
            self.pause_reading()
        else:
            self._body_cycle = self._pipeline[-1]
            raise _StopParsing

    def on_body(self, body: bytes) -> None:
        self._stall_bytes = 0
        self._progress_at = self._last_read
        cycle = self._body_cycle
        if cycle is None or cycle.response_complete or cycle.disconnected:
            return
        cycle.body.append(body)
        cycle.body_size += len(body)
        if cycle.body_size > _HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        self._stall_bytes = 0
        cycle = self._body_cycle
        if cycle is None:
            return
        cycle.body_complete = True
        cycle.wake()

    # --- requests and responses ---------------------------------------------------------------------------

    def _start(self, cycle: RequestCycle) -> None:
        """Its turn has come: run the app on it, or answer 503 past the concurrency limit."""
        self.active = cycle
        state = self.server_state
        if self.limit is not None and (len(state.connections) >= self.limit or len(state.tasks) >= self.limit):
            self.over_limit.refused(self._clock())
            self._plain(503)
            cycle.disconnect()
            self._close()
            return
        task = self.loop.create_task(self._run(cycle))
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)

    async def _run(self, cycle: RequestCycle) -> None:
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except BaseException as exc:
            log.error("Exception in ASGI application", exc_info=exc)
            if cycle.response_complete:
                return  # it failed after its answer went out whole: the connection serves on
            if not cycle.response_started and not cycle.disconnected:
                self._plain(500)
            self._close()
            return
        if not cycle.disconnected and not cycle.response_complete:
            step = "ending" if cycle.response_started else "starting"
            log.error("ASGI application returned without %s its response", step)
            if not cycle.response_started:
                self._plain(500)
            self._close()

    def response_done(self, cycle: RequestCycle) -> None:
        """The response went out whole: close, or serve the next pipelined request, or wait idle."""
        self.server_state.total_requests += 1
        if self.active is cycle:
            self.active = None
        if not cycle.keep_alive:
            if self._refusal is not None and not self._pipeline:
                self._plain(self._refusal)
            self._close()
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

    def _refuse(self, status: int, reason: str) -> None:
        """A request that cannot be read. Answered in its turn: at once when nothing is owed before it (or the
        error is in the body of the request being answered, which then cannot be served), else after the
        answers owed, as the connection's last word; then the connection closes."""
        log.debug("refusing %s: %s", self.client, reason)
        self._stopped = True
        active = self.active
        if active is not None and self._body_cycle is active and not active.body_complete:
            if not active.response_started:
                active.disconnect()
                self._plain(status)
            self._close()
            return
        queued = self._pipeline
        if queued and self._body_cycle is queued[-1] and not queued[-1].body_complete:
            queued.pop()  # a queued request whose body broke off: refused in its turn, not served
        last = queued[-1] if queued else active
        if last is None:
            self._plain(status)
            self._close()
            return
        if last.keep_alive:  # a client that asked to close after it has no use for a refusal
            self._refusal = status
        last.keep_alive = False

    def server_headers(self) -> tuple[bytes, int]:
        """uvicorn's default headers (``date``, ``server``), which its server refreshes every second, encoded
        (once per refresh), and how many lines they make."""
        default = self.server_state.default_headers
        if _server_headers.source is not default:
            _server_headers.source = default
            _server_headers.encoded = b"".join(b"%b: %b\r\n" % (name, value) for name, value in default)
            _server_headers.lines = len(default)
        return _server_headers.encoded, _server_headers.lines

    def _plain(self, status: int) -> None:
        self.transport.write(plain_response(status, self.server_headers()[0]))

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
            if self.read_paused or cycle.expect_continue or self.active not in (None, cycle):
                self._arm(now + self.body_timeout_s)  # we are not reading it (yet): the silence is ours
                return
            deadline, expired = self._progress_at + self.body_timeout_s, "body"
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
            cycle.disconnect()  # the app, waiting in receive(), sees http.disconnect and sends nothing
        if answer:
            self._plain(408)
        self._close()


class OverLimit:
    """Requests refused past ``listen.max_connections``: counted (``on_refused``, the gateway's counter), and
    logged at most once per ``LOG_EVERY_S`` with how many since, not once each (an overload is thousands)."""

    LOG_EVERY_S = 60.0

    def __init__(self, on_refused: Callable[[], None] = lambda: None) -> None:
        self.on_refused = on_refused
        self._logged_at = -_NEVER
        self._unlogged = 0

    def refused(self, now: float) -> None:
        self.on_refused()
        self._unlogged += 1
        if now - self._logged_at >= self.LOG_EVERY_S:
            log.warning(
                "Exceeded concurrency limit (listen.max_connections): answered %d request(s) with 503 since the "
                "last report",
                self._unlogged,
            )
            self._logged_at, self._unlogged = now, 0


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0") for name, value in headers
    )


class _ServerHeaders:
    source: object = None
    encoded = b""
    lines = 0


_server_headers = _ServerHeaders()


def _address(value: object) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def configured_protocol(listen: ListenConfig, on_over_limit: Callable[[], None] = lambda: None) -> type[HttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with ``listen``'s head and body timeouts (the
    keep-alive one is uvicorn's ``timeout_keep_alive``) and its control port, whose connections
    ``max_connections`` does not limit; ``on_over_limit`` counts the requests refused past that limit."""

    class ConfiguredHttpProtocol(HttpProtocol):
        __slots__ = ()
        header_timeout_s = listen.header_timeout_s
        body_timeout_s = listen.body_timeout_s
        control_port = listen.control_port
        over_limit = OverLimit(on_over_limit)

    return ConfiguredHttpProtocol
