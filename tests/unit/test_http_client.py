"""The lean upstream client (gateway.upstream.http_client) against real socket servers on 127.0.0.1, no mocks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

import pytest

from gateway.upstream.http_client import _PAUSE_ABOVE_BYTES, ConnectFailed, Disconnected, Pool

TIMEOUT_S = 10.0  # deadline of requests that should succeed: a hang fails the test instead of blocking it
WAIT_S = 5.0  # how long a test waits for something the server should observe
ONE_READ = 256 * 1024  # the most one socket read hands to the protocol (asyncio's and uvloop's read size)


@dataclass
class Peer:
    """The server's side of one accepted connection."""

    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    eof: asyncio.Event = field(default_factory=asyncio.Event)

    async def read_request(self) -> bytes | None:
        """One request (head and body), or None when the client closed the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            assert exc.partial == b"", f"the connection ended inside a request head: {exc.partial!r}"
            self.eof.set()
            return None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return head + await self.reader.readexactly(length)

    async def until_eof(self) -> None:
        """Wait for the client to close the connection, discarding whatever else it sends."""
        while await self.reader.read(65536):
            pass
        self.eof.set()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


Handler = Callable[[Peer], Awaitable[None]]


class Server:
    """A TCP server on 127.0.0.1 that runs ``handler`` for every connection it accepts and keeps a ``Peer`` for
    each, in order. Leaving it closes every connection and stops every handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.peers: list[Peer] = []
        self.errors: list[BaseException] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    @property
    def connections(self) -> int:
        return len(self.peers)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = Peer(len(self.peers), reader, writer)
        self.peers.append(peer)
        try:
            await self.handler(peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: several tests do that on purpose
        except asyncio.CancelledError:
            pass  # stopped by __aexit__ (ending as cancelled makes asyncio's stream machinery log an error)
        except BaseException as exc:  # a broken test server must not pass for a working client
            self.errors.append(exc)
        finally:
            writer.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for peer in self.peers:
            peer.writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        if exc_type is None:
            assert not self.errors, self.errors


@contextlib.asynccontextmanager
async def open_pool(
    url: str,
    *,
    max_connections: int = 1024,
    keepalive_s: float = 4.0,
    on_stale: Callable[[], object] | None = None,
    max_header_bytes: int = 64 * 1024,
) -> AsyncIterator[Pool]:
    pool = Pool(
        url,
        connect_timeout_s=WAIT_S,
        max_connections=max_connections,
        keepalive_s=keepalive_s,
        on_stale=on_stale,
        max_header_bytes=max_header_bytes,
    )
    try:
        yield pool
    finally:
        await pool.close()


def response_bytes(body: bytes, *extra: bytes) -> bytes:
    """A complete keep-alive response with a content-length."""
    head = [b"HTTP/1.1 200 OK", b"content-type: text/plain", b"content-length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve_keep_alive(peer: Peer) -> None:
    """Answers every request with ``reply <i>``, i being the index of the connection it came on."""
    while await peer.read_request() is not None:
        await peer.send(response_bytes(b"reply %d" % peer.index))


async def get(pool: Pool, timeout_s: float = TIMEOUT_S) -> tuple[int, bytes]:
    async with await pool.request("POST", "/v1/x", [], b"{}", timeout_s) as response:
        return response.status, await response.read()


async def observed(event: asyncio.Event) -> bool:
    """Whether ``event`` is set within WAIT_S."""
    try:
        async with asyncio.timeout(WAIT_S):
            await event.wait()
    except TimeoutError:
        return False
    return True


@contextlib.asynccontextmanager
async def bounded() -> AsyncIterator[None]:
    """Around a wait that only the client's own deadline ends: a test fails, rather than hangs, without it."""
    try:
        async with asyncio.timeout(WAIT_S) as scope:
            yield
    except TimeoutError:
        if scope.expired():
            raise AssertionError(f"still waiting after {WAIT_S} s: the request deadline never fired") from None
        raise


async def until(condition: Callable[[], bool]) -> None:
    """Wait (at most WAIT_S) for a state of the client that it signals no other way."""
    async with asyncio.timeout(WAIT_S):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.002)


# --- framing and keep-alive -------------------------------------------------------------------------------


async def test_content_length_response_and_the_connection_is_reused() -> None:
    requests: list[bytes] = []

    async def handle(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            requests.append(request)
            body = b"answer %d" % len(requests)
            await peer.send(response_bytes(body, b"X-Engine-Id: Abc", b"Set-Cookie: a=1", b"Set-Cookie: b=2"))

    async with Server(handle) as server, open_pool(server.url + "/base/") as pool:
        for n in (1, 2):
            headers = [(b"authorization", b"Bearer k"), (b"x-request-id", b"r%d" % n)]
            async with await pool.request("POST", "/v1/completions", headers, b'{"n":%d}' % n, TIMEOUT_S) as resp:
                assert resp.status == 200
                assert resp.header(b"x-engine-id") == b"Abc"  # names lower-cased, values as sent
                assert [value for name, value in resp.headers if name == b"set-cookie"] == [b"a=1", b"b=2"]
                assert resp.media_type == "text/plain"
                assert await resp.read() == b"answer %d" % n
        assert server.connections == 1  # the second request went over the first connection

    host = server.url.removeprefix("http://").encode()
    for n, request in enumerate(requests, 1):
        head, _, body = request.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /base/v1/completions HTTP/1.1"
        assert sorted(lines[1:]) == sorted(
            [b"host: " + host, b"content-length: %d" % len(body), b"authorization: Bearer k", b"x-request-id: r%d" % n]
        )
        assert body == b'{"n":%d}' % n


async def test_chunked_body_is_handed_over_as_it_arrives() -> None:
    more = asyncio.Event()

    async def handle(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"first"))
            await more.wait()  # the rest only once the client has handed over the first chunk
            more.clear()
            await peer.send(chunk(b"second") + chunk(b"third") + b"0\r\n\r\n")

    async with Server(handle) as server, open_pool(server.url) as pool:
        for _ in range(2):
            async with await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S) as response:
                chunks = response.chunks()
                received = b""
                while len(received) < len(b"first"):  # a client holding chunks back until the end times out here
                    received += await anext(chunks)
                assert received == b"first"
                assert not response.complete
                more.set()
                assert b"".join([c async for c in chunks]) == b"secondthird"
                assert response.complete
        assert server.connections == 1  # the chunked terminator ended the exchange, not the connection


async def test_body_framed_by_the_connection_closing_is_read_to_its_end() -> None:
    parts = [bytes([i]) * 100_000 for i in range(5)]

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n")  # neither length nor chunked
        for part in parts:
            await peer.send(part)
        peer.writer.close()  # the end of the body

    async with Server(handle) as server, open_pool(server.url) as pool:
        for n in (1, 2):
            status, body = await get(pool)
            assert status == 200
            assert body == b"".join(parts)
            assert server.connections == n  # such a connection cannot carry another exchange


# --- abandoning, deadlines, failures ----------------------------------------------------------------------


async def test_leaving_a_response_before_its_end_closes_the_connection() -> None:
    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.read_request()
            await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
            await peer.until_eof()
        else:
            await serve_keep_alive(peer)

    async with Server(handle) as server, open_pool(server.url, max_connections=1) as pool:
        async with await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S) as response:
            assert await anext(response.chunks()) == b"x" * 10
        assert await observed(server.peers[0].eof)  # how the engine learns that the client went away
        # With a single slot this also proves the abandoned connection gave its slot back.
        assert await get(pool) == (200, b"reply 1")
        assert server.connections == 2


async def test_deadline_before_the_head_raises_timeout_and_closes_the_connection() -> None:
    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.until_eof()  # never answers
        else:
            await serve_keep_alive(peer)

    async with Server(handle) as server, open_pool(server.url, max_connections=1) as pool:
        async with bounded():
            with pytest.raises(TimeoutError):
                await pool.request("POST", "/v1/x", [], b"", 0.5)
        assert await observed(server.peers[0].eof)
        assert await get(pool) == (200, b"reply 1")  # a new connection, in the slot the dead one gave back


async def test_deadline_in_the_middle_of_the_body_raises_timeout_from_chunks() -> None:
    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"y" * 10)
        await peer.until_eof()  # the other 90 bytes never come

    async with Server(handle) as server, open_pool(server.url) as pool:
        async with await pool.request("POST", "/v1/x", [], b"", 1.0) as response:
            received = b""
            async with bounded():
                with pytest.raises(TimeoutError):
                    async for data in response.chunks():
                        received += data
            assert received == b"y" * 10  # what arrived before the deadline was handed over first
        assert await observed(server.peers[0].eof)


async def test_the_deadline_of_a_finished_request_leaves_its_connection_alone() -> None:
    async with Server(serve_keep_alive) as server, open_pool(server.url) as pool:
        assert await get(pool, timeout_s=1.0) == (200, b"reply 0")
        await asyncio.sleep(1.5)  # past that deadline: had its timer not been cancelled, it would close the connection
        assert await get(pool) == (200, b"reply 0")
        assert server.connections == 1


async def test_a_reused_connection_times_out_by_its_new_request() -> None:
    """A kept-alive connection's second request, which the engine never answers, ends by its own silence
    limit: nothing left of the first request's deadline keeps it waiting or cuts it short."""

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(response_bytes(b"first"))
        await peer.read_request()
        await peer.until_eof()

    async with Server(handle) as server, open_pool(server.url) as pool:
        assert await get(pool, timeout_s=0.5) == (200, b"first")
        await asyncio.sleep(0.3)  # the first request's deadline now falls inside the second one's wait
        async with bounded():
            with pytest.raises(TimeoutError):
                await get(pool, timeout_s=0.5)
        assert server.connections == 1
        assert await observed(server.peers[0].eof)


async def test_connection_refused_is_connect_failed() -> None:
    # A bound socket that does not listen: connecting to its port is refused, and no one else can take the port.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        retries: list[None] = []
        async with open_pool(
            f"http://127.0.0.1:{sock.getsockname()[1]}", max_connections=1, on_stale=lambda: retries.append(None)
        ) as pool:
            for _ in range(2):  # the failed attempt gave its slot back: the second one fails the same way
                with pytest.raises(ConnectFailed):
                    await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S)
        assert retries == []


async def test_garbage_instead_of_http_is_disconnected() -> None:
    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"SSH-2.0-OpenSSH_9.6\r\nthis is not HTTP at all\r\n\r\n")
        await peer.until_eof()

    retries: list[None] = []
    async with Server(handle) as server, open_pool(server.url, on_stale=lambda: retries.append(None)) as pool:
        with pytest.raises(Disconnected):
            await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S)
        assert await observed(server.peers[0].eof)
        assert retries == []


async def test_garbage_on_a_reused_connection_is_not_retried() -> None:
    """Bytes came back, so the engine did see the request: sending it again could run it twice."""

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(response_bytes(b"ok"))
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n")
        await peer.until_eof()

    retries: list[None] = []
    async with Server(handle) as server, open_pool(server.url, on_stale=lambda: retries.append(None)) as pool:
        assert await get(pool) == (200, b"ok")
        with pytest.raises(Disconnected):
            await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S)
        assert retries == []
        assert server.connections == 1


# --- flow control -----------------------------------------------------------------------------------------


async def test_reading_pauses_while_the_caller_does_not_take_the_body() -> None:
    total = 16 << 20
    block = bytes(range(256)) * 256  # 64 KiB

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // len(block)):
            await peer.send(block)  # as fast as the client lets it
        await peer.until_eof()

    async with Server(handle) as server, open_pool(server.url) as pool:
        async with await pool.request("POST", "/v1/x", [], b"", 30.0) as response:
            await until(lambda: response._buffered > _PAUSE_ABOVE_BYTES)
            for _ in range(50):  # not consuming, while the loop runs (and would read, were it not paused)
                await asyncio.sleep(0.005)
                buffered = sum(len(c) for c in response._chunks)
                assert response._buffered == buffered <= _PAUSE_ABOVE_BYTES + ONE_READ
            assert not response.complete
            received = bytearray()
            async for data in response.chunks():  # taking the body resumes reading
                received += data
                assert response._buffered <= _PAUSE_ABOVE_BYTES + ONE_READ
            assert len(received) == total
            assert received == block * (total // len(block))
        assert server.connections == 1


async def test_a_finished_response_left_unread_does_not_stall_its_connection() -> None:
    """The last piece of a body can push the buffer over the pause threshold: the response is then complete
    while reading is paused. Closing it unread returns the connection to the pool, where it must read again."""
    first = b"z" * (_PAUSE_ABOVE_BYTES - 1000)
    last = b"z" * 2000  # one small write: it arrives in one read, with the end of the message
    first_buffered = asyncio.Event()

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(first) + len(last)) + first)
        await first_buffered.wait()
        await peer.send(last)
        await serve_keep_alive(peer)

    async with Server(handle) as server, open_pool(server.url) as pool:
        async with await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S) as response:
            await until(lambda: response._buffered == len(first))
            first_buffered.set()
            await until(lambda: response.complete)
            assert response._buffered > _PAUSE_ABOVE_BYTES  # reading is paused now
        assert await get(pool) == (200, b"reply 0")
        assert server.connections == 1


# --- the pool ---------------------------------------------------------------------------------------------


async def test_one_connection_carries_concurrent_requests_one_after_the_other() -> None:
    in_flight = 0
    most_in_flight = 0

    async def handle(peer: Peer) -> None:
        nonlocal in_flight, most_in_flight
        while (request := await peer.read_request()) is not None:
            in_flight += 1
            most_in_flight = max(most_in_flight, in_flight)
            await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
            await asyncio.sleep(0.05)  # the other request is waiting for the connection meanwhile
            in_flight -= 1
            await peer.send(request[-2:])

    async with Server(handle) as server, open_pool(server.url, max_connections=1) as pool:

        async def call(body: bytes) -> bytes:
            async with await pool.request("POST", "/v1/x", [], body, TIMEOUT_S) as response:
                assert response.status == 200
                return await response.read()

        assert list(await asyncio.gather(call(b"11"), call(b"22"), call(b"33"))) == [b"ab11", b"ab22", b"ab33"]
        assert server.connections == 1
        assert most_in_flight == 1


async def test_the_most_recently_used_idle_connection_is_taken_first() -> None:
    """LIFO: under light load the spare connections stay idle, expire and close instead of all being kept
    barely alive (each then more likely to meet the engine's keep-alive timeout)."""
    async with Server(serve_keep_alive) as server, open_pool(server.url) as pool:
        async with (
            await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S) as first,
            await pool.request("POST", "/v1/x", [], b"", TIMEOUT_S) as second,
        ):
            assert (await first.read(), await second.read()) == (b"reply 0", b"reply 1")
            # leaving: the second connection goes back to the pool first, the first one last
        assert await get(pool) == (200, b"reply 0")
        assert server.connections == 2


async def test_a_request_the_engine_read_and_dropped_is_never_sent_again() -> None:
    """Once any byte of a request went out, the engine may have it: a generation must not run twice, so the
    failure is reported instead of retried (on a reused connection as on a fresh one)."""
    received: list[bytes] = []

    async def handle(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            received.append(request)
            if len(received) == 1:
                await peer.send(response_bytes(b"served"))
            else:
                peer.writer.transport.abort()  # read it, then drop the connection without an answer
                return

    retries: list[None] = []
    async with Server(handle) as server, open_pool(server.url, on_stale=lambda: retries.append(None)) as pool:
        assert await get(pool) == (200, b"served")
        with pytest.raises(Disconnected):
            await get(pool)  # on the reused connection
        assert len(received) == 2 and server.connections == 1  # the second request went out once, not twice
        with pytest.raises(Disconnected):
            await get(pool)  # on a fresh connection
        assert len(received) == 3 and server.connections == 2
        assert retries == []


async def test_an_idle_connection_seen_closed_is_discarded_before_anything_is_written() -> None:
    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(response_bytes(b"served on %d" % peer.index))
        peer.writer.close()  # while the connection sits idle in the pool

    stale: list[None] = []
    async with Server(handle) as server, open_pool(server.url, on_stale=lambda: stale.append(None)) as pool:
        assert await get(pool) == (200, b"served on 0")
        await until(lambda: pool._idle[0].closed)  # the client has seen the close (the engine's FIN)
        assert await get(pool) == (200, b"served on 1")
        assert stale == [None] and server.connections == 2


async def test_a_stream_that_keeps_talking_is_not_cut_by_the_silence_limit() -> None:
    """The limit is on silence, not on length: chunks every 0.1 s for 3 s pass a 1 s limit (ten times a gap: a
    loaded machine's hiccup between two chunks is not silence; 0.2 s gaps under a 0.6 s limit once failed)."""

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(30):
            await asyncio.sleep(0.1)
            await peer.send(b"1\r\nz\r\n")
        await peer.send(b"0\r\n\r\n")
        await peer.until_eof()

    async with (
        Server(handle) as server,
        open_pool(server.url) as pool,
        await pool.request("POST", "/v1/x", [], b"", 1.0) as response,
    ):
        assert await response.read() == b"z" * 30


async def test_a_response_head_over_the_limit_is_refused() -> None:
    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(response_bytes(b"x", b"x-big: " + b"a" * 4000))
        await peer.until_eof()

    async with Server(handle) as server, open_pool(server.url, max_header_bytes=1024) as pool:
        with pytest.raises(Disconnected, match="exceeds 1024 bytes"):
            await get(pool)
        assert await observed(server.peers[0].eof)


async def test_an_idle_connection_past_keepalive_is_closed_and_not_reused() -> None:
    async with Server(serve_keep_alive) as server, open_pool(server.url, keepalive_s=0.0) as pool:
        assert await get(pool) == (200, b"reply 0")
        assert await get(pool) == (200, b"reply 1")
        assert await observed(server.peers[0].eof)


async def test_a_connection_is_idle_from_the_end_of_its_response_not_from_its_release() -> None:
    """The engine's keep-alive timer (uvicorn's 5 s in vLLM) starts when its response ends. A stream relayed to a
    slow client is released later; counting the idle time from the release reused a connection the engine was
    closing at that moment, and the request sent on it was lost (502 in a real-engine burst)."""
    async with Server(serve_keep_alive) as server, open_pool(server.url, keepalive_s=0.2) as pool:
        async with await pool.request("POST", "/v1/x", [], b"{}", TIMEOUT_S) as response:
            assert await response.read() == b"reply 0"
            await asyncio.sleep(0.3)  # the caller is still relaying it: the connection idles past keepalive_s
        assert await get(pool) == (200, b"reply 1")  # a fresh connection, not the one idle for 0.3 s
        assert await observed(server.peers[0].eof)


async def test_close_closes_idle_connections() -> None:
    async with Server(serve_keep_alive) as server:
        async with open_pool(server.url) as pool:
            assert await get(pool) == (200, b"reply 0")
            assert await get(pool) == (200, b"reply 0")
            await pool.close()
            assert await observed(server.peers[0].eof)
        assert server.connections == 1


# --- one answer per request: what an engine (or a proxy in front of it) sends beyond or before it ---------------


async def test_interim_responses_are_skipped_and_the_final_one_is_the_answer() -> None:
    """A client must take 1xx responses it did not ask for (RFC 9110 15.2): 100 Continue was relayed as the
    final answer (and the real one, left on the connection, reached the next request); 103's headers joined
    the answer's."""

    async def handle(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            await peer.send(b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n")
            await peer.send(b"HTTP/1.1 199 Odd\r\ncontent-length: 5\r\n\r\nEVIL!")  # a 1xx llhttp reads a body of
            await peer.send(response_bytes(b"final %d" % peer.index))

    async with Server(handle) as server, open_pool(server.url) as pool:
        async with await pool.request("POST", "/v1/x", [], b"{}", TIMEOUT_S) as response:
            assert (response.status, await response.read()) == (200, b"final 0")
            assert response.header(b"link") is None
        assert await get(pool) == (200, b"final 0")  # the same connection, reused: nothing left over on it
        assert server.connections == 1


@pytest.mark.parametrize(
    "reply",
    [
        response_bytes(b"first") + response_bytes(b"smuggled", b"x-evil: 1"),  # past its Content-Length
        b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n" + response_bytes(b"EVIL"),  # a 204 has no body
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunk(b"data: [DONE]\n\n")
        + b"0\r\n\r\n"
        + response_bytes(b"after the stream"),
    ],
    ids=["past-content-length", "body-after-204", "after-the-last-chunk"],
)
async def test_bytes_after_the_answer_are_never_read_as_an_answer(reply: bytes) -> None:
    """Sent in one write with the answer: its first message is the answer, whole and alone, and the connection
    is closed (not pooled), so no later request reads the rest as its own."""

    async def handle(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(reply if peer.index == 0 else response_bytes(b"clean"))

    async with Server(handle) as server, open_pool(server.url) as pool:
        async with await pool.request("POST", "/v1/x", [], b"{}", TIMEOUT_S) as response:
            body = await response.read()
            assert response.header(b"x-evil") is None and b"EVIL" not in body and b"smuggled" not in body
            assert b"after the stream" not in body
        assert await observed(server.peers[0].eof)  # that connection is done
        assert await get(pool) == (200, b"clean")  # the next request: a new connection, its own answer
        assert server.connections == 2


@pytest.mark.parametrize("status", [b"101 Switching Protocols", b"600 Nope"])
async def test_a_status_that_is_no_answer_is_disconnected(status: bytes) -> None:
    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
        await peer.until_eof()

    async with Server(handle) as server, open_pool(server.url) as pool:
        with pytest.raises(Disconnected, match="status"):
            await get(pool)


async def test_a_head_over_the_limit_in_one_read_is_not_relayed() -> None:
    """The limit stops the parser: the head it cut short is never handed over as the answer's."""

    async def handle(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(response_bytes(b"x", b"x-big: " + b"a" * 4000) + b"\r\n")
        await peer.until_eof()

    async with Server(handle) as server, open_pool(server.url, max_header_bytes=1024) as pool:
        with pytest.raises(Disconnected, match="exceeds 1024 bytes"):  # no head handed over, no 200 relayed
            await pool.request("POST", "/v1/x", [], b"{}", TIMEOUT_S)
