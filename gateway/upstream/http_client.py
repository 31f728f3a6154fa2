"""A lean HTTP/1.1 client for the hot path: send one request to the engine, stream its answer back.

Why not aiohttp here: a bare uvicorn relay spends most of its CPU in the upstream client, and aiohttp's
request machinery (URL objects, multidicts, payload classes, tracing hooks) costs far more than the bytes
need (measured side by side: ``python3 loadtests/bench_upstream_client.py``). This client writes one
request with a single ``write``, parses the answer with httptools (the parser uvicorn uses) and hands body
chunks straight to the caller. It carries every request a client sends (generation and passthrough routes);
aiohttp serves kvgate's own calls to the engine: scrapes and ``/tokenize``.

What it does:

- keep-alive pool, LIFO, with idle connections dropped before the engine's own keep-alive timeout, and a
  connection the engine has closed (its FIN arrived while idle) discarded before anything is written on it;
- a request is written once and never sent again: once a byte of it went out, the engine may have it, so a
  failure after that is the caller's to report (a generation must never run twice);
- one silence limit per request: until the answer's head arrives, and between two chunks of its body (a long
  stream that keeps talking is never cut);
- a limit on the answer's head size;
- flow control: reading from the engine pauses while the caller has not taken what is buffered;
- leaving a response before its end closes the connection. That is how vLLM learns that the client went
  away, and how it frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

import httptools

Headers = list[tuple[bytes, bytes]]

_PAUSE_ABOVE_BYTES = 1 << 20  # buffered but not yet taken by the caller
MAX_INTERIM = 8  # 1xx responses before an answer: more is an engine that never answers
# Idle connections are dropped before uvicorn's 5 s keep-alive timeout in vLLM closes them, which would otherwise
# race with the next request on the same connection.
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """The engine could not be reached, or it broke off."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing was sent."""


class Disconnected(UpstreamError):
    """The connection broke (or the engine sent something that is not HTTP) before the answer was complete."""


class _Connection(asyncio.Protocol):
    """One TCP connection; carries one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.paused = False  # reading paused until the caller takes what is buffered
        self.head_bytes = 0  # of the current answer's head, against the pool's limit
        self.interim = False  # the message being parsed is a 1xx: its head is dropped, the final one follows
        self.interims = 0  # of the current answer

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: this connection cannot be trusted any more
            self.close()
            return
        response.last_activity = response.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:  # also what a callback raised (more than one response, ...)
            response.fail(Disconnected(f"the engine sent an invalid HTTP response: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        """The engine closed its side. An idle connection is then marked closed, so it is never written to."""
        if self.response is None:
            self.closed = True
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.complete:
            if exc is None and response.head_done and response.framed_by_close:
                response.finish()
            else:
                response.fail(Disconnected(f"the engine closed the connection{f': {exc}' if exc else ''}"))

    # --- httptools callbacks ------------------------------------------------------------------------
    # Raising in one stops the parser (feed_data raises), and data_received closes the connection.

    def on_message_begin(self) -> None:
        """A message after the answer's own final one (bytes past its Content-Length, a body after a 204 or
        304, a second response in the same read): never parsed into this answer, and the connection is not
        used again, or the next request would read them as its own answer."""
        response = self.response
        if response is None or response.complete:
            raise Disconnected("the engine sent more than one response")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.pool.max_header_bytes:
            error = Disconnected(f"the engine's response head exceeds {self.pool.max_header_bytes} bytes")
            self.response.fail(error)
            raise error
        self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (100 Continue, 103 Early Hints): the final one follows
            self.interims += 1
            if self.interims > MAX_INTERIM:
                error = Disconnected(f"the engine sent {self.interims} interim responses")
                response.fail(error)
                raise error
            self.interim = True
            response.headers.clear()
            self.head_bytes = 0
            return
        if not 200 <= status <= 599:  # 101 Switching Protocols, or no status HTTP has
            error = Disconnected(f"the engine answered with status {status}")
            response.fail(error)
            raise error
        response.status = status
        response.head_received()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        if self.interim:  # a 1xx that says it has a body (only 100, 102 and 103 are known bodiless): not ours
            return
        if self.response.feed(body) > _PAUSE_ABOVE_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self.interim:  # the end of a 1xx: the answer itself is still to come
            self.interim = False
            return
        # idle from here: the engine's keep-alive timer starts as its response ends, not when our caller is done
        # relaying it (a slow client's stream can be released seconds later)
        self.idle_since = time.monotonic()
        self.response.keep_alive = self.parser.should_keep_alive()
        self.response.finish()

    # --- used by Response and Pool ------------------------------------------------------------------

    def send(self, data: bytes, response: Response) -> None:
        assert self.transport is not None
        self.response = response
        self.head_bytes = 0
        self.interim = False
        self.interims = 0
        self.transport.write(data)

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """The engine's answer: ``status`` and ``headers`` once :meth:`Pool.request` returns, then the body."""

    def __init__(self, conn: _Connection, silence_s: float) -> None:
        self.conn = conn
        self.status = 0
        self.headers: Headers = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.loop = asyncio.get_running_loop()
        self.silence_s = silence_s
        self.last_activity = self.loop.time()  # the request going out, then every byte of the answer
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = self.loop.call_at(self.last_activity + silence_s, self._on_timer)

    # --- what the caller sees -----------------------------------------------------------------------

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def media_type(self) -> str:
        """``content-type`` without its parameters, lower-cased (``text/event-stream``, ``application/json``)."""
        value = self.header(b"content-type")
        return "" if value is None else value.split(b";", 1)[0].strip().lower().decode("latin-1")

    async def next_chunk(self) -> bytes | None:
        """Everything of the body that has arrived, as one piece, once there is some; None after the last.
        A coroutine, not an async generator: the event loop's async-generator hooks cost a WeakSet entry per
        response on the hot path."""
        while True:
            if self._chunks:
                # Nothing waits for more, and a burst of SSE events costs one write downstream instead of one each.
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
                self._buffered -= len(chunk)
                if self._buffered <= _PAUSE_ABOVE_BYTES // 2:
                    self.conn.resume()
                return chunk
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            await self._wait()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive."""
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Done with the answer: a finished keep-alive connection goes back to the pool; an unfinished one is
        closed, which tells the engine to abort the request."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self.conn
        if conn.response is not self:
            return  # already closed
        conn.response = None
        if self.complete and self.keep_alive and self._error is None and not conn.closed:
            conn.resume()  # reading may have been paused by a body left (partly) unread
            conn.pool.release(conn)
        else:
            conn.close()
            conn.pool.forget(conn)

    # --- fed by the connection ----------------------------------------------------------------------

    @property
    def framed_by_close(self) -> bool:
        """No content-length and not chunked: the body ends when the connection does."""
        return self.header(b"content-length") is None and self.header(b"transfer-encoding") is None

    def head_received(self) -> None:
        self.head_done = True
        self._wake()

    def feed(self, chunk: bytes) -> int:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        self._wake()
        return self._buffered

    def finish(self) -> None:
        self.complete = True
        if self._timer is not None:  # the engine is done: its silence no longer matters
            self._timer.cancel()
            self._timer = None
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
            self._wake()

    def _on_timer(self) -> None:
        """Fires ``silence_s`` after the last activity was seen; the timer is pushed back lazily (one
        reschedule per silence period, not one per chunk). Paused reading is our caller's silence, not the
        engine's."""
        now = self.loop.time()
        if self.conn.paused:  # our caller is slow, not the engine: look again a whole period later
            self.last_activity = now
        due = self.last_activity + self.silence_s
        if due > now:
            self._timer = self.loop.call_at(due, self._on_timer)
            return
        self._timer = None
        self.fail(TimeoutError(f"the engine sent nothing for {self.silence_s:g}s"))
        self.conn.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_head(self) -> None:
        while True:
            if self._error is not None:  # before the head: a head parsed past a failure is not to be relayed
                raise self._error
            if self.head_done:
                return
            await self._wait()


class Pool:
    """Keep-alive connections to one engine (``http://host:port`` or ``https://...``)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        max_connections: int = 1024,
        keepalive_s: float = KEEPALIVE_S,
        max_header_bytes: int = 64 * 1024,
        on_stale: Callable[[], object] | None = None,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"upstream URL must be http(s)://host[:port], got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.base_path = url.path.rstrip("/")
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        default_port = (url.scheme == "https" and self.port == 443) or (url.scheme == "http" and self.port == 80)
        host = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
        self._host_header = b"host: " + (host if default_port else f"{host}:{self.port}").encode("idna") + b"\r\n"
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self._idle: list[_Connection] = []
        self._closed = False
        self._open = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._on_stale = on_stale

    async def request(
        self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]], body: bytes, timeout_s: float
    ) -> Response:
        """Send the request once and wait for the answer's head. Use the response as ``async with``.

        ``timeout_s`` bounds getting a connection and then every silence of the engine: until the head arrives,
        and between two chunks of the body."""
        deadline = asyncio.get_running_loop().time() + timeout_s  # on the loop's clock, for timeout_at
        data = self._encode(method, path, headers, body)
        conn = await self._acquire(deadline)
        response = Response(conn, timeout_s)
        try:
            conn.send(data, response)
            await response.wait_head()
        except BaseException:
            response.close()
            raise
        return response

    async def close(self) -> None:
        """Close the idle connections now, and each busy one as its exchange ends (an engine that left the
        pool may still be answering requests placed on it)."""
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._open -= len(self._idle)
        self._idle.clear()

    # --- internals ----------------------------------------------------------------------------------

    def _encode(self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
        parts = [
            f"{method} {self.base_path}{path} HTTP/1.1\r\n".encode("latin-1"),
            self._host_header,
            b"content-length: %d\r\n" % len(body),
        ]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"\r\n", body)
        return b"".join(parts)

    async def _acquire(self, deadline: float) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            if conn.closed and self._on_stale is not None:
                self._on_stale()
            conn.close()
            self._open -= 1
        while self._open >= self.max_connections:
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken in the instant it gave up: the freed slot goes to the next in line
                raise
            finally:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
            if self._idle:
                return await self._acquire(deadline)
        self._open += 1
        try:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout_at(min(deadline, loop.time() + self.connect_timeout_s)):
                _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl)
        except BaseException as exc:
            self._open -= 1  # the slot taken above goes back, whatever went wrong
            self._wake_one()
            if isinstance(exc, TimeoutError):
                raise ConnectFailed(f"connecting to {self.host}:{self.port} timed out") from exc
            if isinstance(exc, OSError):
                raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
            raise
        return conn

    def release(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            self._open -= 1
            return
        self._idle.append(conn)  # idle since its response ended (see _Connection.on_message_complete)
        self._wake_one()

    def forget(self, conn: _Connection) -> None:
        """A connection that was closed while carrying an exchange."""
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
